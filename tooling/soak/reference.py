"""Reference outputs of the soak's requests: the colocated `LLMEngine` in this process.

Runs in the soak process (imports torch), before the load starts and again after it for the
near-tie rule. Each distinct (prompt, engine-relevant sampling) pair runs once, batched, with
prefix caching off; a seeded sampled request draws from its own generator, so its tokens do not
depend on the batch. Stop strings are the router's business: `expected` applies them to the
engine's tokens with the router's own `TextStream`, as the router does to the stream.

Near-tie rule (as in tests/e2e): batching changes float32 summation order, so at a position
where two tokens' logits are closer than `TIE_TOL` either may win. At the first position where
a cluster's tokens differ from the reference, `is_near_tie` recomputes the reference logits
there: greedy — the cluster's token must be within `TIE_TOL` of the best logit; seeded
sampling — the same generator draw is replayed and the cluster's token must score within a
relative `TIE_TOL` of the winner's. Anything else is a wrong token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from model_runtime.model_runner import StepInput
from model_runtime.sampler import apply_top_k_top_p
from model_runtime.sampling_params import SamplingParams
from model_runtime.tokenizer import Tokenizer
from router.textstream import TextStream
from tooling.soak.workload import PlannedRequest

TIE_TOL = 1e-3
BATCH = 32


@dataclass(frozen=True)
class Expected:
    """What a request must produce when nothing goes wrong."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]  # after stop strings (the router cuts the stream there)
    text: str
    finish_reason: str
    full_text: str  # the text of the engine's tokens without stop strings


def sampling_params(r: PlannedRequest) -> SamplingParams:
    return SamplingParams(
        max_tokens=r.max_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        seed=r.seed,
        stop_token_ids=r.stop_token_ids,
        ignore_eos=r.ignore_eos,
    )


class Reference:
    """The tiny engine that says what every request must produce."""

    def __init__(self, model_dir: Path, block_size: int = 16) -> None:
        self.tokenizer = Tokenizer.from_model_dir(model_dir)
        self.block_size = block_size
        cfg = EngineConfig(
            block_size=block_size,
            num_kv_blocks=2048,
            max_num_batched_tokens=2048,
            max_num_seqs=BATCH,
            enable_prefix_caching=False,
        )
        self.engine = LLMEngine.from_model_dir(model_dir, cfg)
        self._runs: dict[tuple[object, ...], tuple[tuple[int, ...], str]] = {}

    def prompt(self, r: PlannedRequest) -> tuple[int, ...]:
        """The token ids the router will send for `r` (text: the model's tokenizer)."""
        if r.token_ids is not None:
            return r.token_ids
        return tuple(self.tokenizer.encode(r.text or ""))

    def run(self, requests: Sequence[PlannedRequest]) -> None:
        """Compute the engine output of every distinct (prompt, sampling) among `requests`."""
        todo: dict[tuple[object, ...], tuple[tuple[int, ...], SamplingParams]] = {}
        for r in requests:
            key = (self.prompt(r), r.sampling_key)
            if key not in self._runs:
                todo[key] = (self.prompt(r), sampling_params(r))
        keys = list(todo)
        for i in range(0, len(keys), BATCH):
            chunk = keys[i : i + BATCH]
            outs = self.engine.generate(
                [list(todo[k][0]) for k in chunk], [todo[k][1] for k in chunk]
            )
            for k, out in zip(chunk, outs, strict=True):
                self._runs[k] = (tuple(out.output_token_ids), out.finish_reason or "length")

    def expected(self, r: PlannedRequest) -> Expected:
        """`r`'s expected tokens, text and finish reason (after `run`), stop strings applied
        by the router's `TextStream` exactly as the router streams them."""
        prompt = self.prompt(r)
        tokens, finish = self._runs[(prompt, r.sampling_key)]
        full_text = self.tokenizer.decode(list(tokens))
        stream = TextStream(self.tokenizer, r.stop)
        kept: list[int] = []
        pieces: list[str] = []
        for tok in tokens:
            kept.append(tok)
            delta = stream.push([tok])
            pieces.append(delta.text)
            if delta.stopped:
                break
        if stream.stopped:
            finish = "stop"
        else:
            pieces.append(stream.finish())
            if stream.stopped:
                finish = "stop"
        return Expected(prompt, tuple(kept), "".join(pieces), finish, full_text)

    def is_near_tie(self, r: PlannedRequest, want: Sequence[int], got: Sequence[int]) -> bool:
        """True when `got` first leaves `want` at a numerical near-tie (module docstring)."""
        i = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        if i is None:
            return False  # no differing token: a length difference is never a near-tie
        prompt = list(self.prompt(r))
        logits = self._logits(prompt + list(want[:i]))
        if r.temperature == 0.0:
            return float(logits.max() - logits[got[i]]) <= TIE_TOL
        assert r.seed is not None, "the soak sends only seeded sampled requests"
        gen = torch.Generator().manual_seed(r.seed)
        race = torch.empty(logits.shape[0])
        for _ in range(i + 1):  # the sampler draws one race per step (sampler.py, step 4)
            race.exponential_(generator=gen)
        probs = torch.softmax(apply_top_k_top_p(logits / r.temperature, r.top_k, r.top_p), -1)
        score = probs / race
        best = float(score.max())
        return best > 0 and (best - float(score[got[i]])) / best <= TIE_TOL

    def _logits(self, tokens: list[int]) -> torch.Tensor:
        n_blocks = -(-len(tokens) // self.block_size)
        step = StepInput(tokens, 0, list(range(n_blocks)))
        return self.engine.runner.execute([step])[0].float()
