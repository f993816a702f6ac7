"""Model tooling outside the serving path: the random test models (tiny/small) and the corpus
their tokenizers learn, fetching real checkpoints, and converting GGUF files."""
