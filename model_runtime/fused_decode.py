"""The fused decode runner: a whole decode step in one C call (`kernels/decode_step.c`,
bound by `kernels/decode_step.py`), or one C call per layer where the caller runs code
between layers (`FusedDecode.run`'s `on_layer_done`: a decode worker's between-layers RPCs).
Runs in the engine thread of a worker.

Why: a batch-1 decode step streams the weights once, and the rest should be nearly free. In
torch it is ~15 ops and 4 module calls per layer, each a few microseconds of Python and
dispatch, which on a 2-core CPU added 30-50 % to the weight-streaming time of a 12-layer model
(issue 21's profile) and grows with the layer count (issue 30). `FusedDecode.run` does the
embedding gather, every layer (RMSNorm, one QKV GEMM, RoPE, the K/V cache write, paged
attention, o_proj + residual, RMSNorm, one gate/up GEMM, SiLU * up, down + residual), the final
norm and the LM head in C, on panel-packed weights (`panel_gemm`'s layout: the `avx2` kernel's,
or the copy 'auto' keeps beside oneDNN's, `Linear.panel_weight`), with
`torch.get_num_threads()` threads.

Contract: the same function as `LlamaModel` + `compute_logits` on the same packed weights for
steps whose every row is one new token, and the same K/V written to the cache. In float32 the
GEMMs, RoPE and attention give the torch path's bits; RMSNorm's sum of squares and SiLU's exp
may differ in the last bit, which the layers amplify: on the tiny test model logits agreed to
1.1e-5 relative (the test allows 1e-4), and float32 greedy tokens equal HF's. In bfloat16
every value is rounded to bf16 at the points where the torch model's ops round it, and the same
near-ties apply. When the panels are a copy beside oneDNN's packing, prefill steps (oneDNN)
and decode steps (panels) use different GEMMs on the same weights: in float32 they agree to
summation order (~1e-6 relative), and float32 greedy tokens still equal HF's
(`tests/integration/test_fidelity_hf.py` runs that default). On an int8 KV cache the K/V write
quantizes each head row with `kernels/kv_quant.h` (the bytes `kv_quant.quantize` writes, from
the same K/V) and attention reads the cache dequantized in registers, so the fused step and the
torch path differ there only where their K/V differ in the last bit (a value may then round to
the neighbouring int8). Weights kept quantized (`Linear.kernel` "quant", `Linear.panel_code`)
run qgemm.c's kernels inside the same step (int8 activations where the Linears say so), and a
quantized embedding's rows are dequantized as they are gathered; the torch modules run the
same kernels (`kernels.qgemm`). `FusedDecode.unsupported` says
when a model cannot take this path (a layer without panel weights, a bias other than the QKV
one, shapes the attention kernel does not take); the runner then keeps the torch model.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Sequence
from typing import cast

import torch

from model_runtime.kernels import build
from model_runtime.kernels.decode_step import (
    KV_FIELD,
    LAYER_FIELDS,
    MAX_BLOCK,
    MAX_GROUP,
    MAX_HEAD_DIM,
    MAX_HEADS,
    OPS,
    ModelStruct,
    load,
    unavailable_reason,
)
from model_runtime.kv_cache import KVCache
from model_runtime.linear import Linear
from model_runtime.model import DecoderLayer, LlamaModel

_NO_SPAN = contextlib.nullcontext()


def decoder_layers(model: LlamaModel) -> list[DecoderLayer]:
    """The model's layers, typed."""
    return [cast(DecoderLayer, layer) for layer in model.layers]


class FusedDecode:
    """The decode step of one packed model over one KV cache. Holds references to every
    tensor whose address it passes to C, so they live as long as it does; the model's weights
    must not be replaced or repacked while it is in use. The cache may move
    (`KVCache.adopt_kv`, e.g. into shared memory by a KV transport after the engine is built):
    each `run` reads the cache's current tensor."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, isa: str | None = None) -> None:
        reason = FusedDecode.unsupported(model, kv_cache, isa)
        assert not reason, reason
        self.isa = isa or build.default_isa()
        self._lib = load(isa)
        cfg = model.config
        kv = kv_cache.kv  # [L, blocks, 2, bs, KVH, D], or int8 [L, blocks, block bytes]
        self.vocab = cfg.vocab_size
        self._dtype = kv_cache.model_dtype
        embed = model.embed_quant.panels if model.embed_quant is not None else model.embed_tokens
        self._keep: list[torch.Tensor] = [embed.detach(), model.norm.weight.detach()]
        self._keep += [model.cos_cache.contiguous(), model.sin_cache.contiguous()]
        self._kv_cache = kv_cache
        self._kv = kv  # the cache tensor whose layer addresses `_layers` holds
        rows = []
        for i, layer in enumerate(decoder_layers(model)):
            attn, mlp = layer.self_attn, layer.mlp
            bias = attn.qkv_proj.bias
            tensors = [
                layer.input_layernorm.weight.detach(),
                attn.qkv_proj.panel_weight(),
                None if bias is None else bias.detach().contiguous(),
                attn.o_proj.panel_weight(),
                layer.post_attention_layernorm.weight.detach(),
                mlp.gate_up_proj.panel_weight(),
                mlp.down_proj.panel_weight(),
                kv[i],
            ]
            # (not the cache's layer views: `_kv` holds the cache, which may move)
            self._keep += [t for t in tensors[:-1] if t is not None]
            codes = [lin.panel_code() for lin in (attn.qkv_proj, attn.o_proj)]
            codes += [lin.panel_code() for lin in (mlp.gate_up_proj, mlp.down_proj)]
            rows.append([0 if t is None else t.data_ptr() for t in tensors] + codes)
        self._layers = torch.tensor(rows, dtype=torch.int64)
        assert self._layers.shape == (cfg.num_hidden_layers, LAYER_FIELDS), self._layers.shape
        lm_head = model.lm_head.panel_weight()
        assert lm_head is not None
        self._keep.append(lm_head)
        # None, or len(OPS) seconds that every `run` adds each op's wall time to (profiling).
        self.op_seconds: torch.Tensor | None = None
        # Offsets inside a block (`model_runtime.kv_cache`): elements of the cache dtype, so
        # bytes on an int8 cache, whose scales follow the values.
        bs, kvh, dim = kv_cache.block_size, cfg.num_key_value_heads, cfg.head_dim
        values = bs * kvh * dim
        self._model = ModelStruct(
            num_layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            inter=cfg.intermediate_size,
            vocab=cfg.vocab_size,
            block_size=bs,
            block_stride=kv.stride(1),
            v_offset=values if kv_cache.quantized else kv.stride(2),
            max_position=model.cos_cache.shape[0],
            eps=decoder_layers(model)[0].input_layernorm.eps,
            scale=cfg.head_dim**-0.5,
            bf16=int(self._dtype == torch.bfloat16),
            embed=self._keep[0].data_ptr(),
            final_norm=self._keep[1].data_ptr(),
            lm_head=lm_head.data_ptr(),
            cos_table=self._keep[2].data_ptr(),
            sin_table=self._keep[3].data_ptr(),
            layers=self._layers.data_ptr(),
            kv_int8=int(kv_cache.quantized),
            ks_offset=2 * values,
            vs_offset=2 * values + 2 * bs * kvh,
            scale_stride=kv.stride(1) // 2,
            embed_code=0 if model.embed_quant is None else model.embed_quant.code,
            lm_head_code=model.lm_head.panel_code(),
            int8=int(
                any(lin.int8_activations for lin in model.modules() if isinstance(lin, Linear))
            ),
        )

    @staticmethod
    def unsupported(model: LlamaModel, kv_cache: KVCache, isa: str | None = None) -> str:
        """Why this model and cache cannot take the fused step built for `isa` ('' when they
        can)."""
        if load(isa) is None:
            return unavailable_reason(isa)
        cfg = model.config
        kv, dtype = kv_cache.kv, kv_cache.model_dtype
        if kv.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return f"it takes CPU float32 or bfloat16 models, got {kv.device} {dtype}"
        linears = [model.lm_head]
        for layer in decoder_layers(model):
            linears += [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
            linears += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
        if any(lin.panel_weight() is None for lin in linears):
            return (
                "every Linear must have panel-packed weights (linear kernel 'avx2', or 'auto' "
                "where it resolves to oneDNN and keeps a panel copy)"
            )
        qkv = {id(layer.self_attn.qkv_proj) for layer in decoder_layers(model)}
        if any(lin.bias is not None and id(lin) not in qkv for lin in linears):
            return "only the QKV projection may carry a bias"
        params = [model.embed_tokens, model.norm.weight]
        for layer in decoder_layers(model):
            params += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        if any(p.dtype != dtype or not p.is_contiguous() for p in params):
            return f"embedding and norm weights must be contiguous {dtype}"
        if not kv.is_contiguous():
            return "the KV cache must be contiguous"
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        block = kv_cache.block_size
        if (
            cfg.head_dim % 8
            or heads > MAX_HEADS
            or heads % kv_heads
            or heads // kv_heads > MAX_GROUP
            or block > MAX_BLOCK
            or (kv_cache.quantized and cfg.head_dim > MAX_HEAD_DIM)
        ):
            return (
                f"shapes outside the attention kernel's range (head_dim {cfg.head_dim}, heads "
                f"{heads}, kv heads {kv_heads}, block {block})"
            )
        return ""

    def _bind_cache(self, kv: torch.Tensor) -> None:
        """Point every layer at `kv`, the cache's tensor after `KVCache.adopt_kv` (same shape,
        dtype and strides, so only the addresses change)."""
        assert kv.shape == self._kv.shape and kv.stride() == self._kv.stride(), (
            f"the KV cache changed layout: {tuple(kv.shape)} {kv.stride()}, built for "
            f"{tuple(self._kv.shape)} {self._kv.stride()}"
        )
        assert kv.dtype == self._kv.dtype, (kv.dtype, self._kv.dtype)
        for i in range(self._layers.shape[0]):
            self._layers[i, KV_FIELD] = kv[i].data_ptr()
        self._kv = kv

    def start_op_timing(self) -> None:
        """From now on, add each op's wall time to `op_seconds` (zeroed here), by `OPS` name."""
        self.op_seconds = torch.zeros(len(OPS), dtype=torch.float64)

    def stop_op_timing(self) -> dict[str, float]:
        """Stop timing ops; the seconds per op since `start_op_timing`."""
        assert self.op_seconds is not None, "op timing was not started"
        out = dict(zip(OPS, self.op_seconds.tolist(), strict=True))
        self.op_seconds = None
        return out

    def run(
        self,
        token_ids: Sequence[int],
        block_tables: torch.Tensor,
        seq_lens: Sequence[int],
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """float32 logits [B, vocab] for B sequences of one new token each: `token_ids[r]` at
        position `seq_lens[r] - 1`, whose blocks are row r of `block_tables` (int64
        [B, >= blocks], row-contiguous). Writes each layer's K/V for those positions.

        Without `on_layer_done` the step is one C call. With it, one C call per layer and one
        for the final norm and LM head, `on_layer_done(l)` called after layer l's K/V for every
        row is in the cache (as `LlamaModel.forward` calls it); the results are the same bits
        either way (the residual stream is carried between the calls in the weight dtype)."""
        if self._kv_cache.kv is not self._kv:
            self._bind_cache(self._kv_cache.kv)
        batch = len(token_ids)
        tokens = torch.tensor(token_ids, dtype=torch.int64)
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        assert block_tables.dtype == torch.int64 and block_tables.stride(-1) == 1
        logits = torch.empty((batch, self.vocab), dtype=torch.float32)
        residual = torch.empty((batch, self._model.hidden), dtype=self._dtype)
        lib = self._lib
        assert lib is not None
        args = (
            ctypes.byref(self._model),
            tokens.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            lens.data_ptr(),
            batch,
            logits.data_ptr(),
            torch.get_num_threads(),
            None if self.op_seconds is None else self.op_seconds.data_ptr(),
        )
        layers = self._model.num_layers
        # (first layer, end layer, head): every layer and the head in one call, or one call
        # per layer and one for the head
        if on_layer_done is None:
            spans = [(0, layers, 1)]
        else:
            spans = [(layer, layer + 1, 0) for layer in range(layers)] + [(layers, layers, 1)]
        profiled = torch.autograd._profiler_enabled()  # type: ignore[attr-defined]
        with torch.profiler.record_function("pdserve::decode_step") if profiled else _NO_SPAN:
            for first, end, head in spans:
                rc = lib.pdserve_decode_step(*args, first, end, head, residual.data_ptr())
                assert rc == 0, (
                    f"decode step rejected batch {batch}, seq_lens {list(seq_lens)}, layers "
                    f"[{first}, {end}) (rc {rc})"
                )
                if on_layer_done is not None and end > first:
                    on_layer_done(first)
        return logits
