"""Colocated LLM engine: one process runs prefill and decode with continuous batching.

Runs in the engine thread of a colocated worker (and in tests and `pdserve batch` directly).
It is the baseline every disaggregated goodput report compares against. One `step()` is three
calls — the policy lives in the `Scheduler`, the math in the `ModelRunner`::

    scheduler.schedule()  ->  runner.execute() + sampler.sample()  ->  scheduler.update()

The engine owns the runner (model + KV cache), the block pool, the scheduler and one
`torch.Generator` per sampled request: seeded from the request's `seed`, or else from the
engine's own RNG (`EngineConfig.seed`), so a seeded request draws the same tokens whatever else
shares its batches.

Disaggregated workers drive the same engine through extra paths, all through their hand-off
owner (`worker.kv_handoff.KVHandoff`, which pairs the KV transport with this engine's
scheduler): `step(before_forward=...)` (prefill: open KV transfers before the forward, so a
finished request keeps its blocks until the transport's result, and push each layer from the
runner's `on_layer_done`), the scheduler's "receiving KV" reservations and `prefilled_request`
(a request whose prompt KV arrived in blocks the worker reserved), and `add_prefilled_request`
(the same with blocks the caller allocated).
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from model_runtime.block_pool import BlockPool, KVCacheEventListener
from model_runtime.config import ModelConfig
from model_runtime.engine_config import EngineConfig
from model_runtime.grammar import GrammarError, Grammars
from model_runtime.kv_cache import KVCache
from model_runtime.limits import check_context
from model_runtime.model_runner import ModelRunner, StepInput, resolve_dtype
from model_runtime.request import Request, RequestOutput, RequestStatus
from model_runtime.sampler import Sampler, skip_draws
from model_runtime.sampling_params import SamplingParams, TopLogprobs
from model_runtime.scheduler import (
    AcceptedToken,
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from model_runtime.speculative.base import Proposer
from model_runtime.speculative.config import DraftConfig, NgramConfig
from model_runtime.speculative.draft import DraftProposer, check_same_vocabulary
from model_runtime.speculative.ngram import NgramProposer
from model_runtime.speculative.speculator import Speculator
from model_runtime.speculative.verify import Verifier, accepted_prefix, banned_ids

LayerCallback = Callable[[int], None]
BeforeForward = Callable[[SchedulerOutput], LayerCallback | None]
"""Called with a step's schedule just before its forward; may return the step's
`on_layer_done(layer)` callback (see `ModelRunner.execute`)."""

logger = logging.getLogger(__name__)


def num_kv_blocks_for(config: EngineConfig, model_config: ModelConfig) -> int:
    """`config.num_kv_blocks`, or as many blocks as `kv_cache_memory_mb` holds (at least 1)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    dtype = resolve_dtype(config.dtype, model_config)
    per_block = KVCache.bytes_per_block(
        model_config, config.block_size, dtype, config.kv_cache_dtype
    )
    return max(1, int(config.kv_cache_memory_mb * 2**20) // per_block)


class LLMEngine:
    """Continuous-batching engine over one `ModelRunner`. Not thread-safe: one owner thread."""

    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        kv_event_listener: KVCacheEventListener | None = None,
        grammars: Grammars | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        """`grammars`: the model's grammar engine (`model_runtime.grammar`), shared with
        whatever compiles ahead of the engine thread; None refuses structured requests.
        `proposer`: speculate with it instead of the one `config.speculative` names (which
        must be set: it gives k); tests pass their fakes here."""
        self.config = config
        self.grammars = grammars
        self._masks = grammars.new_masks(config.max_num_seqs) if grammars is not None else None
        self.runner = runner
        self.model_config: ModelConfig = runner.config
        self.num_kv_blocks: int = runner.kv_cache.num_blocks
        if runner.kv_cache.block_size != config.block_size:
            raise ValueError(
                f"runner block_size {runner.kv_cache.block_size} != config block_size "
                f"{config.block_size}"
            )
        self.block_pool = BlockPool(
            self.num_kv_blocks, config.enable_prefix_caching, kv_event_listener
        )
        self.scheduler = self._new_scheduler()
        self.sampler = Sampler()
        self.verifier = Verifier(
            self.sampler, grammars.new_masks(1) if grammars is not None else None
        )
        self.speculator = self._new_speculator(proposer)
        """Speculative decoding (`EngineConfig.speculative`); None when off."""
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self.last_step_size = 0
        """Items run by the latest `step()` (0: nothing could run, e.g. blocks all held)."""

    def _new_speculator(self, proposer: Proposer | None) -> Speculator | None:
        spec = self.config.speculative
        if spec is None:
            if proposer is not None:
                raise ValueError("a proposer needs engine.speculative (its k)")
            return None
        if proposer is None:
            proposer = (
                NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
                if isinstance(spec, NgramConfig)
                else DraftProposer.load(spec, self.config, self.model_config, self.num_kv_blocks)
            )
        return Speculator(proposer, spec.num_speculative_tokens, spec.max_step_rows)

    def _new_scheduler(self) -> Scheduler:
        config = self.config
        return Scheduler(
            SchedulerConfig(
                block_size=config.block_size,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.model_config.max_position_embeddings,
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.block_pool,
        )

    def reset_scheduler(self) -> None:
        """Start over with an empty scheduler on the same runner, KV cache and block pool (the
        prefix cache is kept). RuntimeError if any request is unfinished or holds blocks."""
        sched = self.scheduler
        if sched.requests or sched.holds_kv():
            held = len(sched.sending) + len(sched.remote) + len(sched.abandoned)
            raise RuntimeError(
                f"reset_scheduler needs an idle engine: {len(sched.requests)} unfinished, "
                f"{held} holding blocks"
            )
        self.scheduler = self._new_scheduler()

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        kv_event_listener: KVCacheEventListener | None = None,
        proposer: Proposer | None = None,
    ) -> LLMEngine:
        """Load an HF model folder and size the KV cache from `config` (default config if
        None). Logs the effective config and the resolved block count. `proposer`: as in
        `LLMEngine.__init__`."""
        config = config or EngineConfig()
        model_config = ModelConfig.from_model_dir(model_dir)
        if isinstance(config.speculative, DraftConfig) and proposer is None:  # before loading
            check_same_vocabulary(config.speculative.model, Path(model_dir), model_config)
        num_blocks = num_kv_blocks_for(config, model_config)
        logger.info(
            "engine config %s; %d KV blocks of %d tokens",
            config.model_dump_json(),
            num_blocks,
            config.block_size,
        )
        runner = ModelRunner.from_model_dir(
            model_dir,
            num_blocks=num_blocks,
            block_size=config.block_size,
            device=config.device,
            dtype=config.dtype,
            attention_backend=config.attention_backend,
            linear_kernel=config.linear_kernel,
            kv_cache_dtype=config.kv_cache_dtype,
            quant_activations=config.quant_activations,
        )
        logger.info(
            "weights %s; linear kernel %s; decode-only steps: %s%s",
            runner.weights_label,
            runner.linear_kernel,
            runner.decode_path,
            f" ({runner.fused_unsupported})" if runner.fused_unsupported else "",
        )
        grammars = None
        if (Path(model_dir) / "tokenizer.json").is_file():
            grammars = Grammars.from_model_dir(
                model_dir, model_config.vocab_size, model_config.eos_token_ids
            )
        return cls(runner, config, kv_event_listener, grammars, proposer)

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        num_sampled: int = 0,
    ) -> None:
        """Queue a request. Raise ValueError for a duplicate id, bad params, token ids outside
        the vocabulary, or a request that can never fit (context length, KV capacity).

        `num_sampled`: tokens of this request already sampled elsewhere (its prompt ends with
        them); a sampled request's generator skips their draws, so a seeded one continues its
        seed's stream.
        """
        request = self._make_request(request_id, prompt_token_ids, params, num_sampled, num_sampled)
        self.scheduler.add(request)

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_token: int,
        params: SamplingParams,
        block_ids: Sequence[int],
        num_sampled: int = 0,
    ) -> RequestOutput | None:
        """Admit a request whose prompt KV is already in `block_ids` (allocated by the caller
        from `block_pool`, one reference each, covering at least the prompt) and whose first
        output token `first_token` was sampled elsewhere. The engine takes the blocks over and
        frees them exactly once, when the request finishes or is aborted. A sampled request's
        generator skips the draws of `first_token` and of the `num_sampled` tokens sampled
        before it (elsewhere), so a seeded request continues the same random stream as in a
        single engine.

        Returns the final output if `first_token` already ends the request (its blocks are
        freed then), else None; later outputs never repeat `first_token`. Raises ValueError
        (nothing taken over) for a duplicate id, bad params or tokens, or a prompt +
        max_tokens beyond the model's context.
        """
        request = self.prefilled_request(
            request_id, prompt_token_ids, first_token, params, num_sampled
        )
        request.block_ids = list(block_ids)
        return self.scheduler.add_prefilled(request, first_token)

    def prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_token: int,
        params: SamplingParams,
        num_sampled: int = 0,
    ) -> Request:
        """A request whose prompt ran elsewhere and whose first output token `first_token` was
        sampled there, ready to take over received KV (`worker.kv_handoff.KVHandoff.admit`).
        A sampled request's generator skips the draws of `first_token` and of the
        `num_sampled` tokens sampled before it. Raises ValueError for bad params or tokens, or
        a prompt + max_tokens beyond the model's context."""
        request = self._make_request(
            request_id, prompt_token_ids, params, num_sampled + 1, num_sampled
        )
        vocab = self.model_config.vocab_size
        if isinstance(first_token, bool) or not 0 <= first_token < vocab:
            raise ValueError(f"request {request_id!r}: first_token must be in [0, {vocab})")
        if request.matcher is not None and not request.matcher.allows(first_token):
            raise ValueError(
                f"request {request_id!r}: first_token {first_token} is not allowed by its "
                "grammar after its tokens so far: the workers disagree"
            )
        request.status = RequestStatus.RUNNING
        return request

    def _make_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        draws_to_skip: int = 0,
        num_sampled: int = 0,
    ) -> Request:
        """A new request; `draws_to_skip` sampling steps already made elsewhere (its
        generator skips them), `num_sampled` of its prompt's last tokens sampled elsewhere (a
        constrained request's matcher is rebuilt over them, and refuses ones that disagree)."""
        vocab = self.model_config.vocab_size
        params.validate(vocab)
        tokens = list(prompt_token_ids)
        bad = [
            t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
        ]
        if bad:
            raise ValueError(
                f"request {request_id!r}: prompt token ids must be ints in [0, {vocab}), "
                f"got {bad[0]!r}"
            )
        context = self.model_config.max_position_embeddings
        check_context(request_id, len(tokens), params.max_tokens, context)
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            generator = torch.Generator(device=self.runner.device).manual_seed(seed)
            skip_draws(generator, vocab, draws_to_skip)
        matcher = None
        if params.structured is not None:
            if self.grammars is None:
                raise ValueError(
                    f"request {request_id!r}: structured output needs the model's tokenizer.json"
                )
            if not 0 <= num_sampled <= len(tokens):
                raise ValueError(f"request {request_id!r}: num_sampled {num_sampled} out of range")
            try:
                matcher = self.grammars.matcher(
                    params.structured, tokens[len(tokens) - num_sampled :]
                )
            except GrammarError as exc:
                raise ValueError(f"request {request_id!r}: {exc}") from None
        return Request(
            request_id=request_id,
            prompt_token_ids=tokens,
            params=params,
            eos_token_ids=self.model_config.eos_token_ids,
            generator=generator,
            matcher=matcher,
        )

    def abort_request(self, request_id: str) -> RequestOutput:
        """Finish an unfinished request now ('abort') and free its blocks; return its final
        output. Raise KeyError for an unknown or already finished id."""
        out = self.scheduler.abort(request_id)
        if self.speculator is not None:
            self.speculator.release(request_id)
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ one step

    def step(self, before_forward: BeforeForward | None = None) -> list[RequestOutput]:
        """Run one batch; return an output for every request that got a token this step.

        `before_forward(scheduled)`, if given, runs after scheduling and before the forward
        (not at all for an empty step); the callback it returns, if any, is passed to
        `ModelRunner.execute` as `on_layer_done`. A step can be empty while requests wait if
        finished requests' open sends (`Scheduler.open_send`) hold the blocks they need.
        """
        spec = self.speculator
        scheduled = (
            self.scheduler.schedule()
            if spec is None
            else self.scheduler.schedule(spec.lookahead, spec.max_step_rows)
        )
        # An empty step with work left is a deadlock, unless finished requests hold blocks
        # (prefill worker: they come back when their KV transfers end).
        assert scheduled.items or not self.has_unfinished() or self.scheduler.holds_kv(), (
            f"no progress: {len(self.scheduler.waiting)} waiting, "
            f"{len(self.scheduler.running)} running, {self.block_pool.num_free} free blocks"
        )
        self.last_step_size = len(scheduled.items)
        on_layer_done = before_forward(scheduled) if before_forward and scheduled.items else None
        run = self._run(scheduled, on_layer_done)
        outputs = self.scheduler.update(
            scheduled, run.tokens, run.logprobs, run.tops, run.accepted if spec else None
        )
        if spec is not None:
            spec.end_step(run.verified)
            for out in outputs:
                if out.finished:
                    spec.release(out.request_id)
        return outputs

    def _run(
        self, scheduled: SchedulerOutput, on_layer_done: LayerCallback | None = None
    ) -> _StepResult:
        """Forward the step (with the proposals of its speculating rows), then verify the
        proposals (`speculative.verify`) and sample the other rows whose chunk reaches the
        last known token."""
        items = scheduled.items
        result = _StepResult(items)
        if not items:
            return result
        proposals = self._propose(scheduled)
        inputs = [
            StepInput(it.token_ids + guess, it.start_pos, it.block_table, 1 + len(guess))
            if guess
            else StepInput(it.token_ids, it.start_pos, it.block_table)
            for it, guess in zip(items, proposals, strict=True)
        ]
        logits = self.runner.execute(inputs, on_layer_done)
        first_row = list(itertools.accumulate((x.num_logits for x in inputs), initial=0))
        for i, guess in enumerate(proposals):
            if guess:
                self._verify(result, i, logits[first_row[i] : first_row[i + 1]], guess)
        rows = [i for i, it in enumerate(items) if it.samples and not proposals[i]]
        if rows:
            picked = [first_row[i] for i in rows]
            self._sample(result, rows, logits if len(picked) == len(logits) else logits[picked])
        return result

    def _verify(self, result: _StepResult, i: int, logits: torch.Tensor, guess: list[int]) -> None:
        """Item i's verification rows' tokens into `result`: the kept proposals, the last
        emitted token as its sampled one, and (proposed, accepted) for the speculator."""
        request = self.scheduler.requests[result.items[i].request_id]
        emitted = self.verifier.verify(request, logits, guess)
        result.tokens[i], result.logprobs[i], result.tops[i] = emitted[-1]
        result.accepted[i] = emitted[:-1]
        result.verified[request.request_id] = (len(guess), accepted_prefix(emitted, guess))

    def _sample(self, result: _StepResult, rows: list[int], logits: torch.Tensor) -> None:
        """Sample items `rows` (one logits row each, in order) into `result`, in one batch (a
        request below its `min_tokens` may not pick its EOS or stop ids)."""
        items = result.items
        requests = [self.scheduler.requests[items[i].request_id] for i in rows]
        constrained = [k for k, r in enumerate(requests) if r.matcher is not None]
        masks = None
        if constrained:  # one batched fill; unconstrained batches never get here
            assert self.grammars is not None and self._masks is not None
            masks = self._masks[: len(constrained)]
            matchers = [requests[k].matcher for k in constrained]
            self.grammars.fill_masks(matchers, masks)  # type: ignore[arg-type]
        out = self.sampler.sample(
            logits,
            [r.params for r in requests],
            [r.generator for r in requests],
            [banned_ids(r) for r in requests],
            masks,
            constrained,
        )
        for k, i in enumerate(rows):
            result.tokens[i] = out.token_ids[k]
            result.logprobs[i] = out.logprobs[k]
            result.tops[i] = out.top_logprobs[k]

    def _propose(self, scheduled: SchedulerOutput) -> list[list[int]]:
        """The proposer's guesses for each item granted lookahead ([] for the others)."""
        items = scheduled.items
        out: list[list[int]] = [[] for _ in items]
        granted = [i for i, it in enumerate(items) if it.num_lookahead]
        if granted and self.speculator is not None:
            requests = [self.scheduler.requests[items[i].request_id] for i in granted]
            guesses = self.speculator.propose(requests, [items[i].num_lookahead for i in granted])
            for i, guess in zip(granted, guesses, strict=True):
                out[i] = guess
        return out

    # ------------------------------------------------------------------ offline use

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[RequestOutput]:
        """Run `prompts` to completion; final outputs in input order.

        `params` is shared, or one per prompt. The engine must be idle (RuntimeError
        otherwise), since other requests' outputs would have nowhere to go.
        """
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; it has unfinished requests")
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p in zip(ids, prompts, per_prompt, strict=True):
                self.add_request(rid, prompt, p)
        except ValueError:
            for rid in ids:
                if rid in self.scheduler.requests:
                    self.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def check_integrity(self) -> None:
        """Scheduler and block-pool invariants (see `Scheduler.check_integrity`), and the
        speculator's state held for live requests only."""
        self.scheduler.check_integrity()
        if self.speculator is not None:
            self.speculator.check_integrity(self.scheduler.requests)


class _StepResult:
    """One step's sampled and verified tokens, per item (`LLMEngine._run`): what
    `Scheduler.update` takes, and each verified request's (proposed, accepted)."""

    def __init__(self, items: Sequence[ScheduledRequest]) -> None:
        self.items = items
        n = len(items)
        self.tokens: list[int | None] = [None] * n
        self.logprobs: list[float] = [0.0] * n
        self.tops: list[TopLogprobs | None] = [None] * n
        self.accepted: list[Sequence[AcceptedToken]] = [()] * n
        self.verified: dict[str, tuple[int, int]] = {}
