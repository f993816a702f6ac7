"""pdserve model runtime: the Llama-family model, paged KV cache, attention, sampler, engine.

This package is shared by every worker process. Importing the package itself is cheap and
torch-free; the torch-free modules (`hashing`, `sampling_params`, `config`) are also used by the
router, which must never import torch.
"""
