"""`model_runtime.fused_decode` over `kernels/decode_step`: the decode step in C against torch.

Two runners on the same tiny model and the same packed ('avx2') weights, one on the fused step
and one on the torch modules, are prefilled with the same prompts (the torch path in both:
prefill rows never take the fused step) and then decode in lock step: logits and every
layer's KV cache rows must agree, in float32 to 1e-4 relative (RMSNorm's sum and SiLU's exp
may round differently) and in bfloat16 to a few bf16 steps (the two round at the same points,
but a one-step difference early in a layer propagates). Batches of 1 and 3 with contexts that
cross block boundaries, one and two threads, and the dispatch rules (prefill keeps the torch
path; a layer callback keeps the fused step, one C call per layer). Every build
(`kernels.build.ISA_FLAGS`) this CPU runs is tested; the others are skipped with the reason.

Weights kept quantized (the tiny model as Q8_0, Q4_0 and Q4_1 GGUFs, `--weights keep`): the
fused step with float activations against the plain reference (every Linear dequantized, then
`F.linear`: `linear_kernel="torch"`) to the same tolerances; with int8 activations (AVX-512
VNNI) against the torch modules on the same `qgemm` kernels, which must agree as closely.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from model_runtime.config import QUANT_TYPES
from model_runtime.fused_decode import decoder_layers
from model_runtime.kernels import build, decode_step, qgemm
from model_runtime.linear import Linear, QuantActivations, keeps_panels, resolve_linear_kernel
from model_runtime.model_runner import ModelRunner, StepInput

pytestmark = pytest.mark.skipif(
    decode_step.load() is None,
    reason=f"decode step kernel unavailable here: {decode_step.unavailable_reason()}",
)

BLOCK = 16
ISAS = [
    pytest.param(
        isa,
        marks=pytest.mark.skipif(
            isa not in build.cpu_isas(), reason=f"this CPU runs {build.cpu_isas()}, not {isa}"
        ),
    )
    for isa in build.ISA_FLAGS
]
# Per dtype: max |fused - torch| over logits, relative to the logits' largest magnitude.
LOGIT_REL = {torch.float32: 1e-4, torch.bfloat16: 0.05}


def _runner(
    model_dir: Path,
    dtype: str,
    fused: bool,
    isa: str | None = None,
    kv_cache_dtype: str = "auto",
    activations: QuantActivations = "auto",
) -> ModelRunner:
    """A runner on avx2-packed weights (quantized ones on `qgemm`, `activations`); `fused`:
    all-decode steps on the fused step built for `isa` (None: the default build), else on the
    torch modules."""
    loaded = ModelRunner.from_model_dir(
        model_dir,
        64,
        BLOCK,
        dtype=dtype,
        linear_kernel="avx2",
        kv_cache_dtype=kv_cache_dtype,
        quant_activations=activations,
    )
    runner = ModelRunner(
        loaded.config, loaded.model, loaded.kv_cache, loaded.backend, "avx2", decode_isa=isa
    )
    assert runner.decode_path == "fused", runner.fused_unsupported
    if not fused:
        runner.set_decode_path("torch")
        assert runner.fused is None, runner.decode_path
    return runner


def _tables(lens: list[int]) -> list[list[int]]:
    """Disjoint, non-consecutive block ids per sequence (enough for 8 more tokens)."""
    tables, nxt = [], 1
    for n in lens:
        need = -(-(n + 8) // BLOCK)
        tables.append([nxt + 2 * i for i in range(need)])  # every other block: gaps
        nxt += 2 * need
    return tables


def _lock_step(
    fused: ModelRunner,
    ref: ModelRunner,
    lens: list[int],
    share_prefill: bool = False,
    share_every_step: float | None = None,
) -> None:
    """Prefill both runners with the same prompts, then decode 6 steps in lock step: logits and
    every layer's KV cache rows within LOGIT_REL of the cache dtype. `share_prefill`: the
    reference decodes from `fused`'s prefilled cache (bf16 prefill over quantized weights
    multiplies bf16-rounded weights, the reference exact ones: a difference of prefill, not of
    the decode step under test). `share_every_step`: the reference starts every step from
    `fused`'s cache, and logits must agree to this relative tolerance (int8 activations: a last-
    bit difference upstream can move an activation across an int8 rounding boundary, a
    difference that the next steps would amplify)."""
    g = torch.Generator().manual_seed(len(lens))
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lens]
    tables = _tables(lens)
    items = [StepInput(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    for runner in (fused, ref):
        runner.execute(items)
    if share_prefill:
        ref.kv_cache.kv.copy_(fused.kv_cache.kv)
    tol = share_every_step or LOGIT_REL[fused.kv_cache.dtype]
    tokens = [p[-1] for p in prompts]
    for step in range(6):
        items = [
            StepInput([tok], n + step, t) for tok, n, t in zip(tokens, lens, tables, strict=True)
        ]
        if share_every_step is not None:
            ref.kv_cache.kv.copy_(fused.kv_cache.kv)
        got, want = fused.execute(items), ref.execute(items)
        assert got.dtype == want.dtype == torch.float32
        assert got.shape == want.shape == (len(lens), fused.config.vocab_size)
        diff = (got - want).abs().max().item()
        scale = want.abs().max().item()
        assert diff <= tol * scale, f"step {step}: logits differ by {diff} (scale {scale})"
        kv_diff = (fused.kv_cache.kv.float() - ref.kv_cache.kv.float()).abs().max().item()
        kv_scale = ref.kv_cache.kv.float().abs().max().item()
        assert kv_diff <= tol * kv_scale, f"step {step}: KV differs by {kv_diff}"
        tokens = want.argmax(-1).tolist()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("lens", [[5], [15, 16, 40]], ids=["batch1", "batch3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_fused_decode_over_quantized_weights_matches_the_reference(
    tiny_kept: Callable[[str, str], Path], qtype: str, dtype: str, lens: list[int], isa: str
) -> None:
    """Float activations: the fused step over packed weights is the reference model's function
    (dequantize every weight, `F.linear`) to the float tolerances."""
    model = tiny_kept(qtype, dtype)
    fused = _runner(model, dtype, True, isa, activations="float32")
    ref = ModelRunner.from_model_dir(model, 64, BLOCK, dtype=dtype, linear_kernel="torch")
    assert ref.decode_path == "torch" and ref.model.lm_head.kernel == "torch"
    assert fused.model.embed_quant is not None and fused.model.lm_head.kernel == "quant"
    _lock_step(fused, ref, lens, share_prefill=True)


@pytest.mark.skipif(not qgemm.has_int8(), reason="no AVX-512 VNNI here: no int8 path to test")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_fused_int8_decode_runs_the_int8_path(
    tiny_kept: Callable[[str, str], Path], qtype: str, dtype: str, threads: int
) -> None:
    """int8 activations reach the fused step's GEMMs: its logits differ from the float path's
    (the kernel itself is bounded in `test_qgemm`; the plumbing of every weight is the float
    test's above) and stay near the torch modules running the same kernels from the same
    cache. Near, not equal: a last-bit difference upstream (RMSNorm, SiLU) moves an activation
    across an int8 rounding boundary now and then, and this model's sharp attention (the
    tiny model's q/k gain) amplifies that; 10 % of the logits' scale still catches a wrong
    scale or a mis-wired weight, which are off by the whole scale."""
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = tiny_kept(qtype, dtype)
        fused = _runner(model, dtype, True, activations="int8")
        ref = _runner(model, dtype, False, activations="int8")
        exact = _runner(model, dtype, True, activations="float32")
        assert fused.model.lm_head.int8_activations and ref.model.lm_head.int8_activations
        assert not exact.model.lm_head.int8_activations
        _lock_step(fused, ref, [15, 16, 40], share_every_step=0.1)
        exact.kv_cache.kv.copy_(fused.kv_cache.kv)
        item = [StepInput([7], 20, _tables([20])[0])]
        assert not torch.equal(fused.execute(item), exact.execute(item))
    finally:
        torch.set_num_threads(old_threads)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens", [[5], [15, 16, 40]], ids=["batch1", "batch3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_matches_torch_model(
    tiny_model_dir: Path, dtype: str, lens: list[int], threads: int, isa: str
) -> None:
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused = _runner(tiny_model_dir, dtype, True, isa)
        ref = _runner(tiny_model_dir, dtype, False)
        assert fused.fused is not None and fused.fused.isa == isa
        g = torch.Generator().manual_seed(len(lens))
        prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lens]
        tables = _tables(lens)
        items = [StepInput(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
        for runner in (fused, ref):
            runner.execute(items)
        tol = LOGIT_REL[fused.kv_cache.dtype]
        tokens = [p[-1] for p in prompts]
        for step in range(6):
            items = [
                StepInput([tok], n + step, t)
                for tok, n, t in zip(tokens, lens, tables, strict=True)
            ]
            got, want = fused.execute(items), ref.execute(items)
            assert got.dtype == want.dtype == torch.float32
            assert got.shape == want.shape == (len(lens), fused.config.vocab_size)
            diff = (got - want).abs().max().item()
            scale = want.abs().max().item()
            assert diff <= tol * scale, f"step {step}: logits differ by {diff} (scale {scale})"
            kv_diff = (fused.kv_cache.kv.float() - ref.kv_cache.kv.float()).abs().max().item()
            kv_scale = ref.kv_cache.kv.float().abs().max().item()
            assert kv_diff <= tol * kv_scale, f"step {step}: KV differs by {kv_diff}"
            tokens = want.argmax(-1).tolist()
    finally:
        torch.set_num_threads(old_threads)


@pytest.mark.parametrize("isa", ISAS)
def test_fused_decode_float32_greedy_tokens_equal_torch(tiny_model_dir: Path, isa: str) -> None:
    """Greedy float32 tokens over 24 steps are the torch path's, token for token."""
    fused = _runner(tiny_model_dir, "float32", True, isa)
    ref = _runner(tiny_model_dir, "float32", False)
    prompt = list(range(3, 40))
    table = _tables([len(prompt) + 24])[0]
    outs = []
    for runner in (fused, ref):
        tok = int(runner.execute([StepInput(prompt, 0, table)]).argmax(-1).item())
        toks = [tok]
        for i in range(24):
            tok = int(runner.execute([StepInput([tok], len(prompt) + i, table)]).argmax(-1).item())
            toks.append(tok)
        outs.append(toks)
    assert outs[0] == outs[1]


def _dequantized(runner: ModelRunner) -> torch.Tensor:
    """Every layer of an int8 cache as float32 K and V [layers, 2, blocks, bs, H, D]."""
    from model_runtime.kv_quant import dequantize

    layers = []
    for layer in range(runner.config.num_hidden_layers):
        k, v, scales = runner.kv_cache.layer(layer)
        assert scales is not None
        layers.append(torch.stack([dequantize(k, scales[0]), dequantize(v, scales[1])]))
    return torch.stack(layers)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_on_int8_cache_matches_torch_model(
    tiny_model_dir: Path, dtype: str, isa: str
) -> None:
    """On an int8 KV cache the fused step quantizes each new K/V row as the torch path does
    (`kv_quant.h` = `kv_quant.quantize`) and attends over the dequantized cache: logits within
    the full-precision tolerance, the caches equal up to a value that rounds the other way
    where the two paths' K/V differ in the last bit (at most one quantization step), and
    float32 greedy tokens equal."""
    fused = _runner(tiny_model_dir, dtype, True, isa, kv_cache_dtype="int8")
    ref = _runner(tiny_model_dir, dtype, False, kv_cache_dtype="int8")
    assert fused.kv_cache.quantized and fused.fused is not None
    lens = [15, 16, 40]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lens]
    tables = _tables(lens)
    items = [StepInput(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    for runner in (fused, ref):
        runner.execute(items)
    assert torch.equal(fused.kv_cache.kv, ref.kv_cache.kv)  # prefill: the torch path in both
    tol = LOGIT_REL[getattr(torch, dtype)]
    tokens = [p[-1] for p in prompts]
    for step in range(6):
        items = [
            StepInput([tok], n + step, t) for tok, n, t in zip(tokens, lens, tables, strict=True)
        ]
        got, want = fused.execute(items), ref.execute(items)
        diff = (got - want).abs().max().item()
        scale = want.abs().max().item()
        assert diff <= tol * scale, f"step {step}: logits differ by {diff} (scale {scale})"
        a, b = _dequantized(fused), _dequantized(ref)
        step_size = b.abs().amax(-1, keepdim=True) / 127
        assert bool(((a - b).abs() <= step_size * 1.01 + tol * step_size * 127).all()), (
            f"step {step}: int8 caches differ by more than a step"
        )
        if dtype == "float32":
            assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), f"step {step}"
        tokens = want.argmax(-1).tolist()


def test_prefill_keeps_the_torch_path(tiny_model_dir: Path) -> None:
    """A step with a prefill row runs the torch model (the callback sees every layer); the
    fused runner's results equal the torch runner's."""
    fused, ref = _runner(tiny_model_dir, "float32", True), _runner(tiny_model_dir, "float32", False)
    tables = _tables([20, 20])
    mixed = [StepInput(list(range(3, 23)), 0, tables[0]), StepInput([5], 0, tables[1])]
    seen: list[int] = []
    got = fused.execute(mixed, on_layer_done=seen.append)
    assert seen == list(range(fused.config.num_hidden_layers))
    want = ref.execute(mixed)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_with_a_layer_callback_stay_fused(tiny_model_dir: Path, dtype: str) -> None:
    """A decode-only step with an `on_layer_done` callback (a decode worker's between-layers
    RPCs) runs the fused step one layer per C call: the callback sees every layer in order,
    each after that layer's K/V is in the cache, and the logits and K/V are the bits of the
    same step in one call."""
    lens = [15, 16, 40]
    tables = _tables(lens)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lens]
    whole, layered = _runner(tiny_model_dir, dtype, True), _runner(tiny_model_dir, dtype, True)
    items = [StepInput(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    for runner in (whole, layered):
        runner.execute(items)
    decode = [StepInput([p[-1]], n, t) for p, n, t in zip(prompts, lens, tables, strict=True)]
    slots = [t[n // BLOCK] * BLOCK + n % BLOCK for n, t in zip(lens, tables, strict=True)]
    kv = layered.kv_cache.kv  # [layers, blocks, 2, block, kv heads, head dim]
    written: list[int] = []

    def on_layer_done(layer: int) -> None:
        # this layer's new K rows are written, the next layer's not yet
        rows = kv[layer].transpose(0, 1).reshape(2, -1, *kv.shape[-2:])[0, slots]
        assert rows.abs().sum().item() > 0, f"layer {layer}: K not in the cache yet"
        if layer + 1 < kv.shape[0]:
            nxt = kv[layer + 1].transpose(0, 1).reshape(2, -1, *kv.shape[-2:])[0, slots]
            assert nxt.abs().sum().item() == 0, f"layer {layer + 1} written before its turn"
        written.append(layer)

    assert layered.fused is not None
    layered.fused.start_op_timing()  # counts only time spent in the C step
    got = layered.execute(decode, on_layer_done=on_layer_done)
    in_c = layered.fused.stop_op_timing()
    assert in_c["qkv gemm"] > 0 and in_c["lm head gemm"] > 0, f"the C step did not run: {in_c}"
    want = whole.execute(decode)
    assert written == list(range(layered.config.num_hidden_layers))
    assert torch.equal(got, want), (got - want).abs().max().item()
    assert torch.equal(layered.kv_cache.kv, whole.kv_cache.kv)


def test_unsupported_models_say_why(tiny_model_dir: Path) -> None:
    runner = ModelRunner.from_model_dir(tiny_model_dir, 8, BLOCK, linear_kernel="torch")
    assert runner.decode_path == "torch"
    assert "avx2" in runner.fused_unsupported
    with pytest.raises(ValueError, match="avx2"):
        runner.set_decode_path("fused")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_fuses_decode_steps_and_keeps_onednn_for_prefill(
    tiny_model_dir: Path, dtype: str
) -> None:
    """On a host where 'auto' resolves to oneDNN (AVX-512/AMX), decode-only steps run the fused
    step on the panel copy while prefill runs oneDNN: its prefill logits are the bits of a
    oneDNN-only runner's, and its decode logits and K/V agree with that runner's torch-path
    decode within the fused step's tolerance (float32 greedy tokens: equal)."""
    torch_dtype = getattr(torch, dtype)
    cpu = torch.device("cpu")
    resolved = resolve_linear_kernel("auto", cpu, torch_dtype)
    if not keeps_panels("auto", resolved, cpu, torch_dtype):
        pytest.skip(f"'auto' is {resolved!r} here for {dtype}, without a panel copy")
    auto = ModelRunner.from_model_dir(tiny_model_dir, 64, BLOCK, dtype=dtype)
    assert auto.linear_kernel == "onednn" and auto.decode_path == "fused", auto.fused_unsupported
    ref = ModelRunner.from_model_dir(tiny_model_dir, 64, BLOCK, dtype=dtype, linear_kernel="onednn")
    assert ref.decode_path == "torch" and "panel" in ref.fused_unsupported
    lens = [15, 16, 40]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lens]
    tables = _tables(lens)
    items = [StepInput(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    assert torch.equal(auto.execute(items), ref.execute(items))  # prefill: oneDNN in both
    tol = LOGIT_REL[torch_dtype]
    tokens = [p[-1] for p in prompts]
    auto_tokens, ref_tokens = [], []
    for step in range(8):
        items = [
            StepInput([tok], n + step, t) for tok, n, t in zip(tokens, lens, tables, strict=True)
        ]
        got, want = auto.execute(items), ref.execute(items)
        diff = (got - want).abs().max().item()
        scale = want.abs().max().item()
        assert diff <= tol * scale, f"step {step}: logits differ by {diff} (scale {scale})"
        kv_diff = (auto.kv_cache.kv.float() - ref.kv_cache.kv.float()).abs().max().item()
        assert kv_diff <= tol * ref.kv_cache.kv.float().abs().max().item(), kv_diff
        auto_tokens.append(got.argmax(-1).tolist())
        ref_tokens.append(want.argmax(-1).tolist())
        tokens = ref_tokens[-1]
    if dtype == "float32":
        assert auto_tokens == ref_tokens


def test_a_model_the_fused_step_cannot_take_frees_the_panel_copy(tiny_model_dir: Path) -> None:
    """'auto' keeps panels beside oneDNN only for the fused step; where the step cannot take
    the model (here: an o_proj bias), the runner frees them and decodes on the torch path."""
    cpu = torch.device("cpu")
    if not keeps_panels(
        "auto", resolve_linear_kernel("auto", cpu, torch.float32), cpu, torch.float32
    ):
        pytest.skip("'auto' keeps no panel copy on this host")
    loaded = ModelRunner.from_model_dir(tiny_model_dir, 8, BLOCK)
    o_proj = decoder_layers(loaded.model)[0].self_attn.o_proj
    assert o_proj.panels is not None
    o_proj.bias = torch.nn.Parameter(torch.zeros(o_proj.out_features), requires_grad=False)
    runner = ModelRunner(loaded.config, loaded.model, loaded.kv_cache, loaded.backend, "onednn")
    assert runner.decode_path == "torch" and "bias" in runner.fused_unsupported
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.panels is None and m.packed is not None for m in linears)


def test_fused_step_follows_the_cache_when_it_moves(tiny_model_dir: Path) -> None:
    """A KV transport moves the cache into shared memory after the engine is built
    (`KVCache.adopt_kv`); the fused step must read and write the new tensor, not the old."""
    fused, ref = _runner(tiny_model_dir, "float32", True), _runner(tiny_model_dir, "float32", False)
    prompt = list(range(3, 30))
    table = _tables([len(prompt)])[0]
    for runner in (fused, ref):
        runner.execute([StepInput(prompt, 0, table)])
    old = fused.kv_cache.kv
    fused.kv_cache.adopt_kv(torch.empty_like(old))
    old.zero_()  # what the fused step would read if it still pointed here
    tok = 5
    for i in range(4):
        item = [StepInput([tok], len(prompt) + i, table)]
        got, want = fused.execute(item), ref.execute(item)
        diff = (got - want).abs().max().item()
        assert diff <= LOGIT_REL[torch.float32] * want.abs().max().item(), (i, diff)
        tok = int(want.argmax(-1).item())
    assert torch.allclose(fused.kv_cache.kv, ref.kv_cache.kv, rtol=1e-4, atol=1e-5)
    assert old.abs().max().item() == 0  # nothing written to the old tensor
