"""End-to-end helpers: cluster configs, the `E2ECluster` client wrapper, the prompt set and
its reference tokens. The fixtures that use them are in conftest.py.

Runs in the pytest process.

`PROMPTS` is the fidelity set: token-id prompts of 1 token, around block boundaries (block
size 16), long ones, and prompts that share a 32-token prefix with an earlier one (so prefix
caching is exercised), plus two text prompts. `Reference` runs them through the in-process
colocated `LLMEngine` (greedy, one at a time, same block size); the engine itself is compared
with HF transformers in tests/integration, so equality here means equality with HF too.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from deploy.client import CHANNEL_OPTIONS, build_request
from deploy.config import ClusterConfig, load_cluster_config
from deploy.launcher import LocalCluster
from proto.pdserve.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc

BLOCK = 16
ENGINE = {
    "block_size": BLOCK,
    "num_kv_blocks": 512,
    "max_num_batched_tokens": 512,
    "max_num_seqs": 64,
}
MAX_TOKENS = 12
TIE_TOL = 1e-3


@dataclass(frozen=True)
class Prompt:
    """One fidelity case: token ids (None for text) or text, and its max_tokens."""

    name: str
    token_ids: tuple[int, ...] | None = None
    text: str | None = None
    max_tokens: int = MAX_TOKENS

    def request(self, **kw: object) -> inference_pb2.GenerateRequest:
        ids = list(self.token_ids) if self.token_ids is not None else None
        return build_request(
            prompt=self.text, token_ids=ids, max_tokens=self.max_tokens, temperature=0.0, **kw
        )  # type: ignore[arg-type]


def _make_prompts() -> list[Prompt]:
    rng = random.Random(1234)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(4, 1024) for _ in range(n))  # 0..3: special tokens

    out = [
        Prompt(f"len{n}", ids(n))
        for n in (1, 2, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 255, 256, 257, 700)
    ]
    shared = ids(2 * BLOCK)
    out += [Prompt(f"shared{k}", shared + ids(n)) for k, n in enumerate((1, 16, 40))]
    out += [
        Prompt("one-token-out", ids(20), max_tokens=1),
        Prompt("long-out", ids(9), max_tokens=40),
        Prompt("text-short", text="The lighthouse keeper"),
        Prompt("text-long", text="Once upon a time, far beyond the harbour wall, " * 6),
    ]
    return out


PROMPTS = _make_prompts()


class Reference:
    """Greedy tokens of the in-process colocated `LLMEngine` (one request at a time, no prefix
    cache), and its next-token logits for the near-tie rule."""

    def __init__(self, model_dir: Path) -> None:
        from model_runtime.engine import EngineConfig, LLMEngine
        from model_runtime.sampling_params import SamplingParams
        from model_runtime.tokenizer import Tokenizer

        tok = Tokenizer.from_model_dir(model_dir)
        cfg = EngineConfig(**{**ENGINE, "enable_prefix_caching": False})  # type: ignore[arg-type]
        self.engine = LLMEngine.from_model_dir(model_dir, cfg)
        self.prompt_ids: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        for p in PROMPTS:
            ids = list(p.token_ids) if p.token_ids is not None else tok.encode(p.text or "")
            (res,) = self.engine.generate([ids], SamplingParams(max_tokens=p.max_tokens))
            self.prompt_ids[p.name] = ids
            self.tokens[p.name] = list(res.output_token_ids)

    def logit_gap(self, tokens: list[int], candidate: int) -> float:
        """max logit - logit of `candidate`, for the next token after `tokens`."""
        from model_runtime.model_runner import StepInput

        table = list(range(-(-len(tokens) // BLOCK)))
        logits = self.engine.runner.execute([StepInput(tokens, 0, table)])[0]
        return float((logits.max() - logits[candidate]).item())

    def check(self, got: dict[str, list[int]], names: Sequence[str] | None = None) -> None:
        """Token-for-token equality with the near-tie rule of tests/integration/test_engine.py:
        at the first differing position the cluster's token must be within `TIE_TOL` of the
        reference's best logit (batching changes float32 summation order); anything else fails,
        listing every bad prompt."""
        bad = []
        for name in names if names is not None else got:
            want, have = self.tokens[name], got[name]
            if have == want:
                continue
            i = next((k for k, (a, b) in enumerate(zip(have, want, strict=False)) if a != b), None)
            if i is not None:
                gap = self.logit_gap(self.prompt_ids[name] + want[:i], have[i])
                if gap <= TIE_TOL:
                    continue  # a near-tie: numerics, not a bug
            bad.append(f"{name}: got {have}, want {want}")
        assert not bad, "greedy tokens differ from the colocated engine:\n" + "\n".join(bad)


def cluster_config(
    model_dir: Path, mode: str, overrides: dict[str, object] | None = None, **counts: int
) -> ClusterConfig:
    """A process-launched cluster of the tiny model, router on a free port; `overrides` are
    dotted config keys applied last."""
    base: dict[str, object] = {
        "model": str(model_dir),
        "mode": mode,
        "launcher": "process",
        "engine": ENGINE,
        "router.port": 0,
        "router.status_poll_interval_s": 0.2,
        "router.default_timeout_s": 30.0,
        "transfer.timeout_s": 10.0,
    }
    for role, n in counts.items():
        base[f"workers.{role}"] = n
    return load_cluster_config(None, {**base, **(overrides or {})})


@dataclass
class E2ECluster:
    """A running cluster plus sync gRPC clients; `baseline` = free blocks per worker at start."""

    name: str
    local: LocalCluster
    channel: grpc.Channel
    baseline: dict[str, int] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.local.address

    @property
    def stub(self) -> inference_pb2_grpc.InferenceStub:
        return inference_pb2_grpc.InferenceStub(self.channel)

    def worker_addresses(self) -> list[str]:
        return [w.address for w in self.local.workers.workers]

    def worker_stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        """A stub with the cluster's worker credentials (its calls carry the secret)."""
        internal = self.local.workers.internal
        return internal.stub(worker_pb2_grpc.WorkerStub(internal.channel(address, CHANNEL_OPTIONS)))

    def status(self, address: str) -> worker_pb2.WorkerStatus:
        internal = self.local.workers.internal
        with internal.channel(address, CHANNEL_OPTIONS) as ch:
            return internal.stub(worker_pb2_grpc.WorkerStub(ch)).GetStatus(
                worker_pb2.GetStatusRequest(), timeout=5.0
            )

    def free_blocks(self) -> dict[str, int]:
        return {a: self.status(a).free_blocks for a in self.worker_addresses()}

    def wait_no_leaks(self, timeout_s: float = 10.0) -> None:
        """Every worker's free_blocks returns to `baseline` (cleanup is asynchronous)."""
        wait_until(
            lambda: self.free_blocks() == self.baseline,
            timeout_s,
            lambda: f"free blocks {self.free_blocks()} != start {self.baseline}",
        )

    def generate(
        self,
        req: inference_pb2.GenerateRequest,
        timeout: float | None = 30.0,
        channel: grpc.Channel | None = None,
    ) -> tuple[list[int], inference_pb2.FinalInfo]:
        """All tokens of one call and its final info (raises grpc.RpcError on failure);
        through `channel` when given (another router), else this cluster's router."""
        stub = inference_pb2_grpc.InferenceStub(channel or self.channel)
        tokens: list[int] = []
        final = None
        for resp in stub.Generate(req, timeout=timeout):
            tokens += resp.token_ids
            if resp.HasField("final"):
                final = resp.final
        assert final is not None, "stream ended without a final message"
        return tokens, final


def wait_until(
    pred: Callable[[], bool], timeout_s: float, what: Callable[[], str] | str = ""
) -> None:
    """Poll `pred` every 50 ms; AssertionError with `what` after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(
                f"timed out after {timeout_s} s: {what() if callable(what) else what}"
            )
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
