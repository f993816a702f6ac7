"""Command-line flags derived from pydantic models, shared by every process's command line
(`python -m router`, `python -m worker_main`; `pdserve` for dotted overrides). Torch-free.

One declaration per setting: the model's field (its type, default and description) is the
config document's key, the flag, the flag's help and its default. See `model_flags`.
"""
