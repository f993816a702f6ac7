"""The steps of `benchmarks.gpu_check` (one module per step; `common` holds what they share).
Each step module has ``run(ctx) -> StepReport``; the orchestrator runs each in its own
subprocess with a timeout."""
