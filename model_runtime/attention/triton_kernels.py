# Kernel parameters stay unannotated: Triton reads annotations as type/constexpr hints.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton kernels for paged attention and paged KV writes. Run inside the engine thread of a
worker whose model lives on a CUDA device (`get_backend` picks them there).

Oracles: `model_runtime.attention.base.write_kv` and `model_runtime.attention.torch_ref`
(`paged_decode_attention`, `prefill_attention`); `tests/unit/test_triton_attention.py`
compares against them under Triton's interpreter on CPU tensors.

Cache layout (one layer; key and value caches have the same shape and strides)::

    key_cache[block_id, offset, kv_head, d]     token at position p of a sequence with
    slot = block_id * block_size + offset       block table bt: block bt[p // block_size],
                                                offset p % block_size

Attention work split — one program per (sequence, KV head, tile of new tokens). The program
packs the query heads that share its KV head (the GQA group, padded to ``GROUP_P``) and up to
``BLOCK_M // GROUP_P`` new tokens into ``BLOCK_M`` rows, so every K/V tile it loads is reused by
the whole group instead of being re-read once per query head::

    row r -> new token  q_tile * (BLOCK_M // GROUP_P) + r // GROUP_P
             query head kv_head * group + r % GROUP_P

It walks the sequence's context ``TILE_N`` positions at a time (a tile may span several cache
blocks: each position looks up its own block id), with an online softmax in fp32 (running
max ``m``, running sum ``l``, fp32 accumulator), and applies the causal mask per row. A decode
step is the case of one new token per sequence (``BLOCK_M`` = the padded group, at least 16
because `tl.dot` needs 16 rows). There is no split over the context (flash-decoding), so a
batch of few, very long sequences uses few SMs.

Scores are computed with `tl.dot` in the cache dtype (bf16/fp16 tensor cores, exact fp32
products, fp32 accumulation; IEEE fp32 for fp32 caches); probabilities are rounded to the
cache dtype before the P·V product, as FlashAttention does.

An int8 cache (`model_runtime.kv_cache`; ``KV_INT8``) passes its two float16 scale views
``[num_blocks, block_size, num_kv_heads]`` beside the value views. Values are converted to q's
dtype, exactly (an int8 is exact in bf16/fp16/fp32), so the dots keep the tensor cores; each
score column is then multiplied by its token's K scale, and each probability by its token's V
scale before it is rounded for the P·V product. The write kernel quantizes each new K/V row
(`kv_quant.quantize`'s rule: IEEE division via ``div_rn``, round half to even via the 1.5 * 2^23
addition, float16 scales rounded to nearest even) into the same bytes as the torch path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _quantize_rows(x):
    """int8 values and float16 scales of rows x [HEADS_P, HEAD_DIM_P] float32 (padding: 0),
    as `kv_quant.quantize`."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.minimum(tl.math.div_rn(amax, 127.0), 65504.0).to(tl.float16)
    s = scale.to(tl.float32)
    safe = tl.where(s > 0, s, 1.0)
    r = tl.where(s[:, None] > 0, tl.math.div_rn(x, safe[:, None]), 0.0)
    r = (r + 12582912.0) - 12582912.0  # round half to even (|r| < 2^22 wherever it matters)
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    return r.to(tl.int8), scale


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    KV_INT8: tl.constexpr,
):  # fmt: skip
    """One program per new token: copy its [num_kv_heads, head_dim] K and V rows to its slot
    (KV_INT8: quantize each row into the int8 values and its float16 scale)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    hs = tl.arange(0, HEADS_P)
    h = hs[:, None]
    d = tl.arange(0, HEAD_DIM_P)[None, :]
    # slot < 0 marks a padding token: nothing is written (memory safety, not an API feature).
    heads = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (h < heads) & (d < head_dim)
    dst = block * stride_cb + offset * stride_cs + h * stride_ch + d
    k_row = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v_row = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    if KV_INT8:
        sdst = block * stride_sb + offset * stride_ss + hs
        kq, ks = _quantize_rows(k_row.to(tl.float32))
        vq, vs = _quantize_rows(v_row.to(tl.float32))
        tl.store(key_cache_ptr + dst, kq, mask=mask)
        tl.store(value_cache_ptr + dst, vq, mask=mask)
        tl.store(key_scale_ptr + sdst, ks, mask=hs < heads)
        tl.store(value_scale_ptr + sdst, vs, mask=hs < heads)
    else:
        tl.store(key_cache_ptr + dst, k_row, mask=mask)
        tl.store(value_cache_ptr + dst, v_row, mask=mask)


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr, seq_ids_ptr,
    scale_log2e,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt, stride_sb, stride_ss,
    group, head_dim,
    BLOCK_SIZE: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, HEAD_DIM_P: tl.constexpr, TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_INT8: tl.constexpr,
):  # fmt: skip
    """Causal attention of one tile of a sequence's new tokens × one GQA group (module doc)."""
    seq = tl.load(seq_ids_ptr + tl.program_id(0)).to(tl.int64)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_start = seq_len - q_len  # position of the sequence's first new token

    rows = tl.arange(0, BLOCK_M)
    qi = q_tile * BLOCK_Q + rows // GROUP_P  # new-token index within the sequence
    head = kv_head * group + rows % GROUP_P
    d = tl.arange(0, HEAD_DIM_P)
    row_ok = (qi < q_len) & (rows % GROUP_P < group)
    io_mask = row_ok[:, None] & (d[None, :] < head_dim)
    q_rows = (q_start + qi).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=io_mask,
        other=0.0,
    )
    q_pos = ctx_start + qi  # [BLOCK_M] position of each row's token
    # Keys this tile can see: positions [0, kv_end).
    kv_end = tl.minimum(seq_len, ctx_start + (q_tile + 1) * BLOCK_Q)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    n = tl.arange(0, TILE_N)
    d_ok = d < head_dim
    table = block_tables_ptr + seq * stride_bt
    for start in range(0, kv_end, TILE_N):
        pos = start + n
        pos_ok = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        kv_off = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(  # [HEAD_DIM_P, TILE_N], loaded transposed for the dot
            key_cache_ptr + kv_off[None, :] + d[:, None],
            mask=d_ok[:, None] & pos_ok[None, :],
            other=0.0,
        )
        sc_off = block * stride_sb + (pos % BLOCK_SIZE) * stride_ss + kv_head  # int8's scales
        if KV_INT8:
            k_scale = tl.load(key_scale_ptr + sc_off, mask=pos_ok, other=0.0).to(tl.float32)
            s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION)
            s = s * (k_scale * scale_log2e)[None, :]  # [BLOCK_M, TILE_N]
        else:
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2e  # [BLOCK_M, TILE_N]
        allowed = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s, float("-inf"))
        # The first tile holds position 0, visible to every row, so m_new is finite from then on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            value_cache_ptr + kv_off[:, None] + d[None, :],
            mask=pos_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if KV_INT8:
            v_scale = tl.load(value_scale_ptr + sc_off, mask=pos_ok, other=0.0).to(tl.float32)
            pv = tl.dot(
                (p * v_scale[None, :]).to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION
            )
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4:
        raise ValueError(
            f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(key_cache.shape)}"
        )
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError(
            f"key_cache and value_cache must share shape and strides, got "
            f"{tuple(key_cache.shape)}/{key_cache.stride()} and "
            f"{tuple(value_cache.shape)}/{value_cache.stride()}"
        )
    if key_cache.stride(-1) != 1:
        raise ValueError(f"cache head_dim must be contiguous, got strides {key_cache.stride()}")


def _scale_args(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """(key scales, value scales, their block and slot strides) for a kernel launch: an int8
    cache's scale views, checked against its value views; without scales, placeholders the
    kernel never reads (KV_INT8 is off)."""
    if kv_scales is None:
        return key_cache, value_cache, (0, 0)
    key_scale, value_scale = kv_scales
    want = tuple(key_cache.shape[:3])
    if key_cache.dtype != torch.int8:
        raise ValueError(f"kv_scales need an int8 cache, got {key_cache.dtype}")
    if (
        tuple(key_scale.shape) != want
        or key_scale.shape != value_scale.shape
        or key_scale.stride() != value_scale.stride()
        or key_scale.stride(-1) != 1
        or key_scale.dtype != torch.float16
        or value_scale.dtype != torch.float16
    ):
        raise ValueError(
            f"kv_scales must be two float16 {list(want)} views with one set of strides, got "
            f"{tuple(key_scale.shape)}/{key_scale.stride()} {key_scale.dtype} and "
            f"{tuple(value_scale.shape)}/{value_scale.stride()} {value_scale.dtype}"
        )
    return key_scale, value_scale, (key_scale.stride(0), key_scale.stride(1))


def _check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x with a unit stride on its last dim (a copy only when needed)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv_triton(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int, slot of each new token
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an int8 cache's scales
) -> None:
    """Store new tokens' K/V at their slots, in place; same result as `base.write_kv` (the
    same bytes on an int8 cache, whose `kv_scales` [num_blocks, block_size, num_kv_heads]
    float16 receive each row's scale).

    Slots must be < num_blocks * block_size (not checked: checking would sync the device);
    a negative slot writes nothing. k/v may be strided views (e.g. slices of a fused QKV).
    """
    _check_cache(key_cache, value_cache)
    num_tokens = k.shape[0]
    if k.shape != v.shape or k.shape[1:] != key_cache.shape[2:]:
        raise ValueError(
            f"k and v must be [T, {key_cache.shape[2]}, {key_cache.shape[3]}], "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if kv_scales is None and (k.dtype != key_cache.dtype or v.dtype != key_cache.dtype):
        raise ValueError(f"k/v dtype {k.dtype}/{v.dtype} != cache dtype {key_cache.dtype}")
    _check_same_device(k=k, v=v, key_cache=key_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    key_scale, value_scale, scale_strides = _scale_args(key_cache, value_cache, kv_scales)
    _write_kv_kernel[(num_tokens,)](
        k, v, key_cache, value_cache, key_scale, value_scale, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), *scale_strides,
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size,
        HEADS_P=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
        KV_INT8=kv_scales is not None,
    )  # fmt: skip


def paged_attention_triton(
    q: torch.Tensor,  # [T, num_heads, head_dim], all sequences' new tokens, flattened
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    seq_lens: torch.Tensor,  # [B] int, context length after this step (cached + new)
    query_start_loc: torch.Tensor,  # [B+1] int, rows of sequence b: [qsl[b], qsl[b+1])
    seq_ids: torch.Tensor,  # [S] int, which of the B sequences to compute
    max_query_len: int,  # max new tokens among seq_ids (chooses the tile shape)
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim], rows of seq_ids are written
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an int8 cache's scales
) -> torch.Tensor:
    """Causal paged attention for the sequences in `seq_ids`, written into `out` (returned).

    Sequence b's new tokens sit at positions ``seq_lens[b] - q_len .. seq_lens[b] - 1`` and
    each attends to positions ``0 ..`` its own; the result equals `torch_ref.prefill_attention`
    per sequence (and `paged_decode_attention` when every q_len is 1). Preconditions, not
    checked because checking would sync the device: ``1 <= q_len <= seq_lens[b]`` and the block
    table covers ``seq_lens[b]`` positions with valid block ids. Rows of `out` that belong to
    other sequences are left untouched. Any head_dim (padded to a power of two >= 16) and any
    block_size work; num_heads must be a multiple of num_kv_heads.
    """
    _check_cache(key_cache, value_cache)
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"q must be [T, k * {num_kv_heads}, {head_dim}] for integer k, got {tuple(q.shape)}"
        )
    cache_dtype = q.dtype if kv_scales is not None else key_cache.dtype
    if q.dtype != cache_dtype or out.dtype != q.dtype or out.shape != q.shape:
        raise ValueError(
            f"q, out and the caches must share dtype and q/out shape, got q {q.dtype} "
            f"{tuple(q.shape)}, out {out.dtype} {tuple(out.shape)}, cache {key_cache.dtype}"
        )
    key_scale, value_scale, scale_strides = _scale_args(key_cache, value_cache, kv_scales)
    if out.stride(-1) != 1:
        raise ValueError(f"out head_dim must be contiguous, got strides {out.stride()}")
    _check_same_device(
        q=q, key_cache=key_cache, block_tables=block_tables, seq_lens=seq_lens,
        query_start_loc=query_start_loc, seq_ids=seq_ids, out=out,
    )  # fmt: skip
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    q = _rows_contiguous(q)
    if seq_ids.numel() == 0:
        return out
    group = q.shape[1] // num_kv_heads
    group_p = triton.next_power_of_2(group)
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    # Decode: one token, the group padded to the 16 rows tl.dot needs. Prefill: 64 rows.
    block_m = max(group_p, 16 if max_query_len == 1 else 64)
    tile_n = max(16, min(64, 4096 // head_dim_p))
    # 8 warps keep 64-row and fp32 tiles in registers (no spills in sm_80/sm_90 builds).
    num_warps = 4 if block_m == 16 and q.dtype != torch.float32 else 8
    grid = (seq_ids.numel(), num_kv_heads, triton.cdiv(max_query_len, block_m // group_p))
    _paged_attention_kernel[grid](
        out, q, key_cache, value_cache, key_scale, value_scale,
        block_tables, seq_lens, query_start_loc, seq_ids,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        *scale_strides,
        group, head_dim,
        BLOCK_SIZE=block_size, GROUP_P=group_p, BLOCK_M=block_m, BLOCK_Q=block_m // group_p,
        HEAD_DIM_P=head_dim_p, TILE_N=tile_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_INT8=kv_scales is not None,
        num_warps=num_warps,
    )  # fmt: skip
    return out


def paged_decode_attention_triton(
    q: torch.Tensor,  # [B, num_heads, head_dim], one new token per sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    seq_lens: torch.Tensor,  # [B] int, >= 1, including the new token
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an int8 cache's scales
) -> torch.Tensor:  # [B, num_heads, head_dim]
    """Each sequence's single query over its first seq_lens[b] cached tokens.

    Same contract and result as `torch_ref.paged_decode_attention` (the new token's K/V must
    already be in the cache). One program per (sequence, KV head) serves the whole GQA group.
    """
    batch = q.shape[0]
    idx = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    return paged_attention_triton(
        q, key_cache, value_cache, block_tables, seq_lens,
        query_start_loc=idx, seq_ids=idx[:batch], max_query_len=1, scale=scale,
        out=torch.empty_like(q, memory_format=torch.contiguous_format), kv_scales=kv_scales,
    )  # fmt: skip
