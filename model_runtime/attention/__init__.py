"""Attention backends: the torch reference (any device) and Triton paged attention (CUDA)."""
