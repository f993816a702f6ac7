"""Model tooling outside the serving path: fetching real checkpoints and converting GGUF files."""
