"""Model runner: turns a step's sequences into one flat forward pass. Runs in the engine thread.

The runner owns the model and the paged KV cache of its worker. It knows nothing of requests,
scheduling or sampling: callers hand it `StepInput`s (new tokens, where they start, which blocks
hold them) and get back the logits of each item's last new token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import torch

from model_runtime.attention.base import AttentionBackend, AttentionMetadata
from model_runtime.attention.select import get_backend
from model_runtime.config import ModelConfig
from model_runtime.fused_decode import FusedDecode
from model_runtime.kv_cache import KVCache
from model_runtime.linear import Linear, LinearKernel, QuantActivations, pack_linears
from model_runtime.model import LlamaModel
from model_runtime.weights import load_model

DecodePath = Literal["fused", "torch"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | None, config: ModelConfig) -> torch.dtype:
    """'auto'/None -> the checkpoint's dtype; else one of float32, bfloat16, float16."""
    if name in (None, "auto"):
        return _DTYPES[config.torch_dtype]
    if name not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


@dataclass
class StepInput:
    """One sequence's share of one forward step.

    `token_ids` are the new tokens (a whole prompt, a prefill chunk, or one decode token) at
    positions `start_pos .. start_pos + len(token_ids) - 1`; the first `start_pos` tokens are
    already in the KV cache. `block_table` lists the blocks for positions
    `[0, start_pos + len(token_ids))` in order (it may list more). `num_logits`: how many of
    the last new tokens get logits (1: the last one; `len(token_ids)`: every one, as a
    speculative step's verification rows need).
    """

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    num_logits: int = 1


class ModelRunner:
    """Runs forward steps of one model over one paged KV cache (single owner thread)."""

    def __init__(
        self,
        config: ModelConfig,
        model: LlamaModel,
        kv_cache: KVCache,
        backend: AttentionBackend,
        linear_kernel: str = "torch",
        decode_isa: str | None = None,
    ) -> None:
        """`decode_isa`: the build of the fused decode step (`kernels.build.ISA_FLAGS`; None:
        the widest this CPU runs)."""
        self.config = config
        self.linear_kernel = linear_kernel  # as resolved by `pack_linears`
        # what the weights are, for logs, `/metrics` and the model listing: 'Q4_1+Q8_0', ...
        self.weights_label = config.weights_label(
            str(model.norm.weight.dtype).removeprefix("torch.")
        )
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = kv_cache.device
        self.block_size = kv_cache.block_size
        # Steps whose every row is one new token run as one C call where the model allows
        # (`kernels.decode_step`: panel-packed weights, `Linear.panel_weight`); prefill and
        # mixed steps run the torch modules (oneDNN or panel GEMMs, `linear_kernel`).
        # `decode_path` says which path decode steps take.
        self.fused_unsupported = FusedDecode.unsupported(model, kv_cache, decode_isa)
        self._fused = None if self.fused_unsupported else FusedDecode(model, kv_cache, decode_isa)
        if self._fused is None:  # a panel copy kept for the fused step is of no use: free it
            for layer in model.modules():
                if isinstance(layer, Linear):
                    layer.panels = None
        self.decode_path: DecodePath = "torch" if self._fused is None else "fused"

    def weight_bytes(self) -> int:
        """Bytes the model's weights take in memory: every parameter, packed copy and
        quantized weight, each storage counted once (a tied head shares the embedding's)."""
        seen: dict[int, int] = {}
        tensors: list[torch.Tensor | None] = list(self.model.parameters())
        if self.model.embed_quant is not None:
            tensors.append(self.model.embed_quant.panels)
        for layer in self.model.modules():
            if isinstance(layer, Linear):
                tensors += [layer.packed, layer.panels]
                tensors.append(None if layer.quant is None else layer.quant.panels)
        opaque = 0  # oneDNN's packed weights have no storage to share
        for t in tensors:
            if t is None or not t.numel():
                continue
            if t.layout != torch.strided:
                opaque += t.numel() * t.element_size()
                continue
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values()) + opaque

    @property
    def fused(self) -> FusedDecode | None:
        """The fused decode step while `decode_path` is 'fused', else None."""
        return self._fused if self.decode_path == "fused" else None

    def set_decode_path(self, path: DecodePath) -> None:
        """Run all-decode steps fused (one C call) or through the torch model's modules
        (benchmarks compare the two). 'fused' where `fused_unsupported` is not empty is a
        ValueError that says why."""
        if path not in get_args(DecodePath):
            raise ValueError(f"decode path must be one of {get_args(DecodePath)}, got {path!r}")
        if path == "fused" and self._fused is None:
            raise ValueError(f"the fused decode step cannot run here: {self.fused_unsupported}")
        self.decode_path = path

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        num_blocks: int,
        block_size: int,
        device: str | torch.device = "cpu",
        dtype: str | None = None,
        attention_backend: str = "auto",
        linear_kernel: LinearKernel = "auto",
        kv_cache_dtype: str = "auto",
        quant_activations: QuantActivations = "auto",
    ) -> ModelRunner:
        """Load config and weights from an HF folder and allocate `num_blocks` KV blocks.

        `linear_kernel` picks the GEMM behind every weight matmul (`model_runtime.linear`):
        'auto' packs weights for oneDNN on CPU where the build supports it, with a panel copy
        for the fused decode step where that kernel builds (AVX2-only CPUs: panels only).
        `kv_cache_dtype`: "auto" (the model dtype) or "int8" (`model_runtime.kv_cache`).
        Weights the folder keeps quantized stay so (`model_runtime.quant`); `quant_activations`
        says how decode steps multiply them (`linear.resolve_quant_activations`).
        """
        config = ModelConfig.from_model_dir(model_dir)
        device = torch.device(device)
        torch_dtype = resolve_dtype(dtype, config)
        model = load_model(model_dir, config, torch_dtype, device)
        resolved = pack_linears(model, linear_kernel, quant_activations)
        kv_cache = KVCache(
            config,
            num_blocks,
            block_size,
            torch_dtype,
            device,
            model_name=Path(model_dir).name,
            cache_dtype=kv_cache_dtype,
        )
        backend = get_backend(attention_backend, device)
        return cls(config, model, kv_cache, backend, linear_kernel=resolved)

    def build_metadata(
        self, items: Sequence[StepInput]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, positions, metadata, index of each token that gets logits: each item's
        last `num_logits`, in order) for a step."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        query_lens: list[int] = []
        seq_lens: list[int] = []
        max_blocks = 1
        for item in items:
            n = len(item.token_ids)
            end = item.start_pos + n
            assert 0 < item.num_logits <= n, f"StepInput of {n} tokens, {item.num_logits} logits"
            assert end <= self.config.max_position_embeddings, (
                f"position {end} beyond max_position_embeddings "
                f"{self.config.max_position_embeddings}"
            )
            needed = -(-end // bs)
            assert len(item.block_table) >= needed, (
                f"block_table has {len(item.block_table)} blocks, {needed} needed for {end} tokens"
            )
            input_ids.extend(item.token_ids)
            for pos in range(item.start_pos, end):
                positions.append(pos)
                slots.append(item.block_table[pos // bs] * bs + pos % bs)
            query_start_loc.append(query_start_loc[-1] + n)
            query_lens.append(n)
            seq_lens.append(end)
            max_blocks = max(max_blocks, needed)
        tables = torch.zeros((len(items), max_blocks), dtype=torch.long)
        for i, item in enumerate(items):
            needed = -(-seq_lens[i] // bs)
            tables[i, :needed] = torch.as_tensor(list(item.block_table[:needed]))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.as_tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=query_start_loc,
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=tables.to(dev),
            seq_lens_tensor=torch.as_tensor(seq_lens, dtype=torch.int32, device=dev),
            decode_indices=[i for i, n in enumerate(query_lens) if n == 1],
            prefill_indices=[i for i, n in enumerate(query_lens) if n > 1],
        )
        wanted = [
            i
            for item, end in zip(items, query_start_loc[1:], strict=True)
            for i in range(end - item.num_logits, end)
        ]
        last = torch.as_tensor(wanted, dtype=torch.long, device=dev)
        return (
            torch.as_tensor(input_ids, dtype=torch.long, device=dev),
            torch.as_tensor(positions, dtype=torch.long, device=dev),
            meta,
            last,
        )

    @torch.inference_mode()
    def execute(
        self,
        items: Sequence[StepInput],
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run one step; float32 logits [sum of num_logits, vocab]: each item's last
        `num_logits` new tokens' (one row each, items in order).

        `on_layer_done(l)` is called after layer `l`'s K/V for every item is in the cache.
        Which path runs: a step whose every item wants logits for every new token (one-token
        decode rows, and speculative verification rows: the pending token plus proposals)
        -> the fused step (`decode_path` 'fused'; each new token one row of the C call, rows of
        one item sharing its block table, so they attend causally to each other: the step
        writes every row's K/V of a layer before any row's attention of that layer; with
        `on_layer_done`, one C call per layer, so a decode worker's between-layers RPCs do not
        push its steps onto the torch model); any other step -> the torch model.
        Where the panels are a copy beside oneDNN's packing, a decode row in a step that also
        holds a prefill chunk thus gets oneDNN's GEMMs, not the panels': in float32 its logits
        differ from an all-decode step's by summation order (~1e-6 relative), so a greedy token
        at such a near-tie can depend on what shares its step.
        """
        if not items:
            return torch.empty((0, self.config.vocab_size), dtype=torch.float32)
        if self.fused is not None and all(len(it.token_ids) == it.num_logits for it in items):
            return self._execute_fused(self.fused, items, on_layer_done)
        input_ids, positions, meta, last = self.build_metadata(items)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, self.backend, on_layer_done)
        return self.model.compute_logits(hidden.index_select(0, last))

    def _execute_fused(
        self,
        fused: FusedDecode,
        items: Sequence[StepInput],
        on_layer_done: Callable[[int], None] | None,
    ) -> torch.Tensor:
        """`execute` for steps whose every new token gets logits, in C (`FusedDecode.run`):
        one row per token, a row at position p with sequence length p + 1."""
        bs = self.block_size
        ends = [item.start_pos + len(item.token_ids) for item in items]
        width = -(-max(ends) // bs)
        tokens: list[int] = []
        seq_lens: list[int] = []
        tables = []
        for item, end in zip(items, ends, strict=True):
            needed = -(-end // bs)
            assert len(item.block_table) >= needed, (
                f"block_table has {len(item.block_table)} blocks, {needed} needed for {end} tokens"
            )
            table = list(item.block_table[:needed]) + [0] * (width - needed)
            for j, token in enumerate(item.token_ids):
                tokens.append(token)
                seq_lens.append(item.start_pos + j + 1)
                tables.append(table)
        return fused.run(tokens, torch.tensor(tables, dtype=torch.int64), seq_lens, on_layer_done)
