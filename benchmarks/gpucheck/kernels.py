"""Step 2, kernels: the Triton attention kernels (`model_runtime.attention.triton_kernels`)
compiled for the GPU, against the torch reference, over the shapes and dtypes the tests use
(tests/unit/test_triton_attention.py, tests/gpu/test_triton_cuda.py; duplicated here in short,
since benchmarks never import tests). Prints the max abs difference of every case.

Dry run: Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by the orchestrator before
triton is imported) on the float32 cases with short contexts; bfloat16 is wrong in the
interpreter and is skipped there.
"""

from __future__ import annotations

import time

import torch

from benchmarks.gpucheck.common import Ctx, StepReport

# (atol, rtol): about two ulp of the output dtype (as the tests).
TOL = {torch.float32: (2e-5, 0.0), torch.float16: (1e-3, 4e-3), torch.bfloat16: (8e-3, 3e-2)}
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# decode: (block_size, heads, kv_heads, head_dim, dtype, long contexts?)
DECODE = [
    (8, 2, 2, 16, F32, False),
    (16, 4, 2, 32, F32, False),
    (32, 8, 2, 64, F32, False),
    (16, 8, 2, 128, F32, False),
    (8, 4, 2, 24, F32, False),
    (16, 4, 2, 64, F16, False),
    *[
        (bs, h, kv, d, dt, True)
        for dt in (BF16, F16, F32)
        for bs, h, kv, d in ((16, 32, 32, 128), (16, 32, 8, 128), (32, 14, 2, 64), (8, 16, 2, 96))
    ],
]
# prefill (varlen, causal, after a cached prefix): (block_size, group, head_dim, dtype)
PREFILL = [
    (8, 1, 32, F32),
    (16, 2, 32, F32),
    (32, 4, 32, F32),
    (16, 4, 128, BF16),
    (16, 4, 64, F16),
    (16, 4, 128, F32),
]


def run(ctx: Ctx) -> StepReport:
    rep = StepReport()
    from triton.runtime.interpreter import InterpretedFunction

    from model_runtime.attention import triton_kernels as tk

    interpreted = isinstance(tk._paged_attention_kernel, InterpretedFunction)
    if ctx.dry_run != interpreted:
        rep.check("compiled kernels", False, f"interpreted={interpreted}, dry_run={ctx.dry_run}")
        return rep
    dev = ctx.device
    t0 = time.perf_counter()
    for bs, heads, kv_heads, hd, dtype, long in DECODE:
        name = f"decode {str(dtype)[6:]} bs={bs} {heads}/{kv_heads}x{hd}{' long' if long else ''}"
        if ctx.dry_run and (dtype is not F32 or long):
            rep.skip(name, "interpreter: float32 short cases only")
            continue
        _decode_case(rep, tk, dev, name, bs, heads, kv_heads, hd, dtype, long)
    for bs, group, hd, dtype in PREFILL:
        name = f"prefill {str(dtype)[6:]} bs={bs} g={group} d={hd}"
        if ctx.dry_run and dtype is not F32:
            rep.skip(name, "interpreter: float32 only")
            continue
        _prefill_case(rep, tk, dev, name, bs, group, hd, dtype)
    rep.metric("seconds_all_cases", round(time.perf_counter() - t0, 1))
    return rep


def _close(
    rep: StepReport, name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype
) -> None:
    atol, rtol = TOL[dtype]
    err = (got.float() - want.float()).abs()
    bad = int((err > atol + rtol * want.float().abs()).sum())
    diff = float(err.max()) if err.numel() else 0.0
    rep.check(name, bad == 0 and not bool(torch.isnan(got).any()), f"{bad} elements off", diff)


def _tables(lens: list[int], bs: int, num_blocks: int, dev: torch.device) -> torch.Tensor:
    need = [-(-n // bs) for n in lens]
    ids = torch.randperm(num_blocks)[: sum(need)].tolist()
    table = torch.zeros(len(lens), max(need), dtype=torch.long)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    return table.to(dev)


def _caches(
    num_blocks: int, bs: int, kv_heads: int, hd: int, dtype: torch.dtype, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer view of a KVCache-shaped tensor, strided like the real ones."""
    kv = torch.randn(2, num_blocks, 2, bs, kv_heads, hd, device=dev).to(dtype)
    return kv[1, :, 0], kv[1, :, 1]


def _decode_case(
    rep: StepReport,
    tk: object,
    dev: torch.device,
    name: str,
    bs: int,
    heads: int,
    kv_heads: int,
    hd: int,
    dtype: torch.dtype,
    long: bool,
) -> None:
    from model_runtime.attention.torch_ref import paged_decode_attention

    torch.manual_seed(bs * 131 + heads * 7 + hd)
    if long:
        lens = [1, bs, bs + 1, 4096, 4095, *torch.randint(1, 3000, (27,)).tolist()]
    else:
        lens = [1, bs - 1, bs, bs + 1, 3 * bs, 3 * bs + 1]
    num_blocks = sum(-(-n // bs) for n in lens) + 8
    kc, vc = _caches(num_blocks, bs, kv_heads, hd, dtype, dev)
    tables = _tables(lens, bs, num_blocks, dev)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(len(lens), heads, hd, device=dev).to(dtype)
    want = paged_decode_attention(q, kc, vc, tables, seq_lens, hd**-0.5)
    got = tk.paged_decode_attention_triton(q, kc, vc, tables, seq_lens, hd**-0.5)  # type: ignore[attr-defined]
    _close(rep, name, got, want, dtype)


def _prefill_case(
    rep: StepReport,
    tk: object,
    dev: torch.device,
    name: str,
    bs: int,
    group: int,
    hd: int,
    dtype: torch.dtype,
) -> None:
    from model_runtime.attention.torch_ref import prefill_attention

    torch.manual_seed(bs + group + hd)
    kv_heads = 2
    steps = [(0, 40), (bs, bs + 1), (2 * bs - 1, 1), (3, 2 * bs), (0, 300)]  # (cached, new)
    lens = [c + n for c, n in steps]
    num_blocks = sum(-(-n // bs) for n in lens) + 8
    kc, vc = _caches(num_blocks, bs, kv_heads, hd, dtype, dev)
    tables = _tables(lens, bs, num_blocks, dev)
    qsl = [0]
    for _, n in steps:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], kv_heads * group, hd, device=dev).to(dtype)
    out = torch.full_like(q, float("nan"))
    tk.paged_attention_triton(  # type: ignore[attr-defined]
        q,
        kc,
        vc,
        tables,
        torch.tensor(lens, dtype=torch.int32, device=dev),
        torch.tensor(qsl, dtype=torch.int32, device=dev),
        torch.arange(len(steps), dtype=torch.int32, device=dev),
        max_query_len=max(n for _, n in steps),
        scale=hd**-0.5,
        out=out,
    )
    want = torch.cat(
        [
            prefill_attention(q[qsl[b] : qsl[b + 1]], kc, vc, tables[b], lens[b], hd**-0.5)
            for b in range(len(steps))
        ]
    )
    _close(rep, name, out, want, dtype)
