"""Speculative decoding in the engine: proposers behind one seam (`base.Proposer`), the
verification rule (`verify`), each request's adaptive proposal length (`adapt`), counters
(`stats`) and the `[engine.speculative]` config (`config`). Runs in the engine thread of a
worker; `config` is torch-free."""
