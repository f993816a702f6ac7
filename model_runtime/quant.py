"""Weights kept quantized in ggml's 32-value blocks (Q8_0, Q4_0, Q4_1): their bytes, the plain
torch reference, and the kernels' in-memory layout. Runs in worker processes (loading) and in
the CLI (`pdserve convert --weights keep`, `pdserve quantize`).

Three forms of one weight W [N, K] (K a multiple of 32):

- **blocks** (on disk, `config.WeightQuantization`): uint8 [N, K / 32 * B], each row's blocks
  as a GGUF file stores them (B = 34 for Q8_0: fp16 d, 32 int8; 18 for Q4_0: fp16 d, 16 bytes
  whose low nibbles are values 0..15 and high nibbles 16..31; 20 for Q4_1: fp16 d, fp16 m, the
  same 16 bytes). Value: Q8_0 d * q, Q4_0 d * (q - 8), Q4_1 d * q + m.
- **panels** (in memory, `QuantWeight`): the same bytes rearranged for the kernels
  (`kernels/qgemm.c` draws it): 16 rows interleaved per block, 4 such panels per group of 64
  rows stored block by block, N padded to 64 rows with zero blocks. Same byte count per row
  as the file; no float copy is ever made.
- **float**: `dequantize_blocks` / `dequantize`, the plain torch reference (gguf-py's
  arithmetic: d * q, then + m, each rounded to fp32), which `kernels.qgemm` is tested against
  and which the converter's dequantizing path equals.

`quantize` makes blocks from a float tensor with the `gguf` package's quantizers (llama.cpp's
reference quantization: Q8_0 and Q4_0 symmetric by the block's largest magnitude, Q4_1 by its
minimum and maximum).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from model_runtime.config import QUANT_TYPES, QuantType
from model_runtime.kernels.hugepages import empty_huge

BLOCK = 32  # values per block
BLOCK_BYTES: dict[QuantType, int] = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
TYPE_CODES: dict[QuantType, int] = {"Q8_0": 1, "Q4_0": 2, "Q4_1": 3}  # qgemm.c's QT_*
PANEL = 16  # rows interleaved per panel
GROUP = 64  # rows are padded to a multiple of this (one unit of parallel work)
_ZERO = {"Q8_0": 128, "Q4_0": 8, "Q4_1": 0}  # zero point of the unsigned codes


def check_type(qtype: str) -> QuantType:
    """`qtype` if it is one of QUANT_TYPES, else a ValueError naming them."""
    if qtype not in QUANT_TYPES:
        raise ValueError(f"quantization type {qtype!r} is not supported; supported: {QUANT_TYPES}")
    return qtype


def row_bytes(qtype: QuantType, in_features: int) -> int:
    """Bytes of one row of `in_features` values in blocks of `qtype`."""
    if in_features % BLOCK:
        raise ValueError(f"{qtype} rows need a multiple of {BLOCK} values, got {in_features}")
    return in_features // BLOCK * BLOCK_BYTES[qtype]


def _split(raw: torch.Tensor, qtype: QuantType) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks [N, nb * B] -> (unsigned codes u8 [N, nb, 32], d fp16 [N, nb], m fp16 [N, nb]
    (zeros unless Q4_1)). Codes are the stored value plus the zero point (Q8_0: int8 + 128)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, BLOCK_BYTES[qtype])
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    if qtype == "Q8_0":
        codes = (blocks[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(
            torch.uint8
        )
        return codes, d, torch.zeros_like(d)
    start = 4 if qtype == "Q4_1" else 2
    m = (
        blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
        if qtype == "Q4_1"
        else torch.zeros_like(d)
    )
    packed = blocks[..., start:]
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1)
    return codes, d, m


def dequantize_blocks(raw: torch.Tensor, qtype: QuantType, in_features: int) -> torch.Tensor:
    """The reference: blocks [N, row bytes] -> float32 [N, in_features], as gguf-py computes
    it (d * q, then + m for Q4_1; fp32, no fused multiply-add)."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes(qtype, in_features):
        raise ValueError(
            f"{qtype} blocks of {in_features}-value rows must be uint8 [N, "
            f"{row_bytes(qtype, in_features)}], got {raw.dtype} {tuple(raw.shape)}"
        )
    codes, d, m = _split(raw, qtype)
    q = codes.to(torch.float32) - float(_ZERO[qtype])
    w = d.float().unsqueeze(-1) * q
    if qtype == "Q4_1":
        w = w + m.float().unsqueeze(-1)
    return w.reshape(raw.shape[0], in_features)


def quantize(weight: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """Float [N, K] -> blocks uint8 [N, row bytes] with the `gguf` package's quantizer
    (llama.cpp's reference quantization of `qtype`)."""
    import gguf

    check_type(qtype)
    if weight.dim() != 2:
        raise ValueError(f"only matrices are quantized, got shape {tuple(weight.shape)}")
    row_bytes(qtype, weight.shape[1])
    a = weight.detach().to(torch.float32).numpy()
    raw = gguf.quants.quantize(a, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8).reshape(a.shape[0], -1)


@dataclass(frozen=True)
class QuantWeight:
    """One weight in the kernels' panel layout (module doc): `panels` uint8
    [N_pad / 64, K / 32 * block bytes * 64], N_pad = `out_features` rounded up to 64."""

    qtype: QuantType
    out_features: int
    in_features: int
    panels: torch.Tensor

    @property
    def code(self) -> int:
        """The type's code in the C kernels."""
        return TYPE_CODES[self.qtype]

    @property
    def nbytes(self) -> int:
        """Bytes a GEMM over the weight reads (padding rows included)."""
        return self.panels.numel()


def _qs(codes: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """Codes [P, 16, nb, 32] -> the panels' code bytes [P, nb, 512 or 256] (qgemm.c's layout)."""
    p, _, nb, _ = codes.shape
    if qtype == "Q8_0":  # [g][r][j], k = 4g + j
        return codes.reshape(p, PANEL, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(p, nb, 512)
    # [h][r][j]: k = 8h + j in the low nibble, 8h + 4 + j in the high one
    c = codes.reshape(p, PANEL, nb, 4, 2, 4)
    byte = c[..., 0, :] | (c[..., 1, :] << 4)
    return byte.permute(0, 2, 3, 1, 4).reshape(p, nb, 256)


def pack_blocks(raw: torch.Tensor, qtype: QuantType, in_features: int) -> QuantWeight:
    """Blocks [N, row bytes] (one or several tensors' rows concatenated) -> `QuantWeight`."""
    check_type(qtype)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes(qtype, in_features):
        raise ValueError(
            f"{qtype} blocks of {in_features}-value rows must be uint8 [N, "
            f"{row_bytes(qtype, in_features)}], got {raw.dtype} {tuple(raw.shape)}"
        )
    n = raw.shape[0]
    n_pad = -(-n // GROUP) * GROUP
    nb = in_features // BLOCK
    codes, d, m = _split(raw, qtype)
    zero = torch.full((n_pad - n, nb, BLOCK), _ZERO[qtype], dtype=torch.uint8)
    codes = torch.cat([codes, zero]) if n_pad > n else codes
    pad = torch.zeros((n_pad - n, nb), dtype=torch.float16)
    d, m = torch.cat([d, pad]), torch.cat([m, pad])
    panels = n_pad // PANEL

    def per_panel(s: torch.Tensor) -> torch.Tensor:  # [N_pad, nb] fp16 -> [P, nb, 32] bytes
        flat = s.reshape(panels, PANEL, nb).transpose(1, 2).contiguous().view(-1)
        return flat.view(torch.uint8).reshape(panels, nb, 2 * PANEL)

    per = GROUP // PANEL
    groups = n_pad // GROUP

    def grouped(t: torch.Tensor) -> torch.Tensor:  # [P, nb, x] -> [G, nb, 4 * x]
        return t.reshape(groups, per, nb, -1).transpose(1, 2).reshape(groups, nb, -1)

    parts = [grouped(_qs(codes.reshape(panels, PANEL, nb, BLOCK), qtype)), grouped(per_panel(d))]
    if qtype == "Q4_1":
        parts.append(grouped(per_panel(m)))
    block = torch.cat(parts, dim=-1)  # [G, nb, group block bytes]
    out = empty_huge((groups, nb * block.shape[-1]), torch.uint8)  # streamed whole each step
    out.copy_(block.reshape(groups, -1))
    return QuantWeight(qtype, n, in_features, out)


def unpack_blocks(qw: QuantWeight) -> torch.Tensor:
    """Inverse of `pack_blocks`: the blocks [out_features, row bytes] (tests; writing back)."""
    qtype, k = qw.qtype, qw.in_features
    nb = k // BLOCK
    groups = qw.panels.shape[0]
    per = GROUP // PANEL
    panels = groups * per
    qsb = 512 if qtype == "Q8_0" else 256
    blocks = qw.panels.reshape(groups, nb, -1)

    def ungrouped(start: int, size: int) -> torch.Tensor:  # -> [P, nb, size] of each panel
        t = blocks[..., start : start + per * size].reshape(groups, nb, per, size)
        return t.transpose(1, 2).reshape(panels, nb, size)

    qs = ungrouped(0, qsb)
    if qtype == "Q8_0":
        codes = qs.reshape(panels, nb, 8, PANEL, 4).permute(0, 3, 1, 2, 4)
        codes = codes.reshape(panels * PANEL, nb, BLOCK)
    else:
        byte = qs.reshape(panels, nb, 4, PANEL, 4).permute(0, 3, 1, 2, 4)  # [P, r, nb, h, j]
        codes = torch.stack([byte & 0x0F, byte >> 4], dim=-2)  # [P, r, nb, h, 2, j]
        codes = codes.reshape(panels * PANEL, nb, BLOCK)

    def scales(offset: int) -> torch.Tensor:  # -> [N_pad, nb, 2] bytes of fp16
        s = ungrouped(offset, 32).contiguous().view(torch.float16)  # [P, nb, 16]
        flat = s.transpose(1, 2).contiguous().view(-1).view(torch.uint8)
        return flat.reshape(panels * PANEL, nb, 2)

    parts = [scales(per * qsb)]
    if qtype == "Q8_0":
        q8 = (codes.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
        parts.append(q8)
    else:
        if qtype == "Q4_1":
            parts.append(scales(per * (qsb + 32)))
        parts.append(codes[..., :16] | (codes[..., 16:] << 4))
    raw = torch.cat(parts, dim=-1).reshape(panels * PANEL, -1)
    return raw[: qw.out_features].contiguous()


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """The reference float32 [out_features, in_features] of a packed weight."""
    return dequantize_blocks(unpack_blocks(qw), qw.qtype, qw.in_features)


def dequantize_rows(qw: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """The reference float32 rows `ids` ([*ids.shape, in_features]) of a packed weight,
    dequantizing only the panels that hold them. An id out of range is a ValueError."""
    flat = ids.reshape(-1).to(torch.int64).cpu()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= qw.out_features):
        raise ValueError(f"token ids must be in [0, {qw.out_features}), got {flat.tolist()}")
    groups, where = torch.unique(flat // GROUP, return_inverse=True)
    sub = QuantWeight(qw.qtype, len(groups) * GROUP, qw.in_features, qw.panels[groups])
    rows = dequantize(sub)[where * GROUP + flat % GROUP]
    return rows.view(*ids.shape, qw.in_features).to(ids.device)
