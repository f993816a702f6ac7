"""Decode-attention microbenchmark: torch reference vs the Triton kernel. Standalone, CUDA only.

    python -m benchmarks.bench_attention [--heads 32 --kv-heads 8 --head-dim 128 --dtype bf16]

For each (batch, context) it prints the median time of one layer's decode attention and the
KV bandwidth it reaches (bytes of K and V read / time), after checking the two agree.
"""

from __future__ import annotations

import argparse

import torch

from model_runtime.attention.torch_ref import paged_decode_attention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def bench_one(
    args: argparse.Namespace, batch: int, context: int, dtype: torch.dtype
) -> tuple[float, float, float]:
    """(torch ms, triton ms, max abs diff) for `batch` sequences of `context` tokens."""
    import triton.testing

    from model_runtime.attention.triton_kernels import paged_decode_attention_triton

    dev = torch.device("cuda")
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    key_cache = torch.randn(shape, device=dev).to(dtype)
    value_cache = torch.randn(shape, device=dev).to(dtype)
    tables = torch.randperm(num_blocks, device=dev).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch, args.heads, args.head_dim, device=dev).to(dtype)
    scale = args.head_dim**-0.5

    def ref() -> torch.Tensor:
        return paged_decode_attention(q, key_cache, value_cache, tables, seq_lens, scale)

    def fast() -> torch.Tensor:
        return paged_decode_attention_triton(q, key_cache, value_cache, tables, seq_lens, scale)

    diff = (ref().float() - fast().float()).abs().max().item()
    return triton.testing.do_bench(ref), triton.testing.do_bench(fast), diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=32, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA device (the Triton kernels compile for it)")
    dtype = DTYPES[args.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    print(f"{torch.cuda.get_device_name()}  {args.heads}/{args.kv_heads} heads x {args.head_dim}"
          f"  block {args.block_size}  {args.dtype}")  # fmt: skip
    print(f"{'batch':>6} {'context':>8} {'torch ms':>9} {'triton ms':>10} {'GB/s':>7} {'diff':>9}")
    for batch in args.batches:
        for context in args.contexts:
            t_ref, t_fast, diff = bench_one(args, batch, context, dtype)
            kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * elem
            print(f"{batch:>6} {context:>8} {t_ref:>9.3f} {t_fast:>10.3f} "
                  f"{kv_bytes / t_fast / 1e6:>7.0f} {diff:>9.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
