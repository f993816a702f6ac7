"""Draft-model proposer: a smaller model with the target's vocabulary guesses the next tokens.
Runs in the engine thread of a worker, beside the target model, on the same device.

The draft has its own `ModelRunner` (weights and a paged KV cache of its own) and its own
`BlockPool` (no prefix caching). Per request it keeps the blocks of its KV and how many of the
request's positions they hold. One `propose` for a batch of requests:

1. **Catch up.** A request's draft KV is valid for its first `n` positions (0 the first time:
   a local prompt, a prefilled hand-off, a migration's re-prefill alike: the draft prefills
   whatever it lacks from the request's own tokens). One forward runs every request's missing
   tokens up to and including the pending one, as a chunk per request; its last row gives the
   distribution of the first guess.
2. **Guess.** Guess j (j = 1..m) is picked from the draft's distribution as the target will
   pick the token at that position (`verify`): greedy requests take the argmax; sampled ones
   apply their temperature, top-k and top-p and take the exponential race the target's
   seeded generator will draw there (a copy of the generator, so the request's own stream is
   untouched) — the Gumbel-max coupling, under which a draft that agrees with the target is
   accepted whatever the temperature. Ids banned below `min_tokens` are banned here too.
   Then one decode step per further guess, all requests batched (the fused C step where the
   draft is packed for it). A guess that would end the request (EOS, a stop id) is the last.
3. **Remember.** The draft's KV now also holds guesses 1..m-1. At the next `propose`, the ones
   the target kept are still valid; the rest are rolled back by lowering `n` (their positions
   are overwritten by the next catch-up, as the target's are).

A request whose draft KV does not fit the draft's free blocks gets no guesses (its draft
state is dropped and rebuilt later); speculation is a hint, never a reason to wait.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model_runtime.block_pool import BlockPool
from model_runtime.config import ModelConfig
from model_runtime.engine_config import EngineConfig
from model_runtime.model_runner import ModelRunner, StepInput
from model_runtime.request import Request
from model_runtime.sampler import Sampler
from model_runtime.speculative.config import DraftConfig
from model_runtime.speculative.verify import banned_ids, ends_request

FUSED_CATCH_UP = 64
"""Catch-up chunks up to this long run as one row per token (the fused C step, where every
request's chunk is this short: after a verified step, or after up to `adapt.MAX_IDLE` steps
without proposals); longer ones (a prompt) as a prefill chunk on the torch path. On the small
draft of `benchmarks/bench_spec_overhead.py` 64 tokens took 10.5 ms as fused rows and 16.5 ms
on the torch path (shared machine)."""


@dataclass
class _DraftState:
    """One request's draft KV: its blocks, the positions whose K/V is valid, and the guesses
    whose K/V was written at positions `tail_start ..` (checked against the request's tokens
    at the next `propose`)."""

    block_ids: list[int] = field(default_factory=list)
    computed: int = 0
    tail_start: int = 0
    tail: list[int] = field(default_factory=list)


def check_same_vocabulary(draft_dir: Path, target_dir: Path | None, target: ModelConfig) -> None:
    """ValueError naming both unless the draft's logits and tokens are the target's: the same
    vocab_size and, where both folders have a tokenizer.json, the same token table."""
    draft = ModelConfig.from_model_dir(draft_dir)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"engine.speculative.model: the draft's vocab_size {draft.vocab_size} is not the "
            f"target's {target.vocab_size}"
        )
    if target_dir is None:
        return
    a, b = draft_dir / "tokenizer.json", target_dir / "tokenizer.json"
    if a.is_file() and b.is_file():
        va = json.loads(a.read_text()).get("model", {}).get("vocab")
        vb = json.loads(b.read_text()).get("model", {}).get("vocab")
        if va != vb:
            raise ValueError(
                f"engine.speculative.model: {draft_dir}'s tokenizer is not {target_dir}'s"
            )


class DraftProposer:
    """`base.Proposer` with a draft model (module docstring)."""

    def __init__(self, runner: ModelRunner) -> None:
        """`runner`: the draft model and its KV cache (this proposer's alone)."""
        self.runner = runner
        self.block_size = runner.block_size
        self.pool = BlockPool(runner.kv_cache.num_blocks, enable_prefix_caching=False)
        self._state: dict[str, _DraftState] = {}

    @classmethod
    def load(
        cls, config: DraftConfig, engine: EngineConfig, target: ModelConfig, num_blocks: int
    ) -> DraftProposer:
        """The draft of `config` on `engine`'s device, block size, attention backend, linear
        kernel and KV cache dtype, with `config.num_kv_blocks` blocks (None: `num_blocks`,
        the target's). ValueError when its vocabulary size is not the target's."""
        check_same_vocabulary(config.model, None, target)
        runner = ModelRunner.from_model_dir(
            config.model,
            num_blocks=config.num_kv_blocks or num_blocks,
            block_size=engine.block_size,
            device=engine.device,
            dtype=engine.dtype if config.dtype == "auto" else config.dtype,
            attention_backend=engine.attention_backend,
            linear_kernel=engine.linear_kernel,
            kv_cache_dtype=engine.kv_cache_dtype,
        )
        return cls(runner)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        live: list[int] = []  # the requests that guess this round (indices into `requests`)
        caps: list[int] = []
        inputs: list[StepInput] = []
        for i, (request, limit) in enumerate(zip(requests, limits, strict=True)):
            cap, chunk = self._catch_up(request, limit)
            if chunk is not None:
                live.append(i)
                caps.append(cap)
                inputs.append(chunk)
        if not live:
            return out
        if all(len(x.token_ids) <= FUSED_CATCH_UP for x in inputs):  # one row per token
            inputs = [
                StepInput(x.token_ids, x.start_pos, x.block_table, len(x.token_ids)) for x in inputs
            ]
        # each chunk's last row, as views: an indexing kernel here may wait at an OpenMP
        # barrier for a thread a loaded CPU has not scheduled (3 ms of CPU for one row)
        logits = self.runner.execute(inputs)
        rows = [logits[e - 1] for e in itertools.accumulate(x.num_logits for x in inputs)]
        gens = [self._generator(requests[i]) for i in live]
        active = list(range(len(live)))  # positions in `live` still guessing
        for j in itertools.count():
            going = []
            for n, k in enumerate(active):
                request = requests[live[k]]
                token = self._pick(request, rows[n], gens[k], j)
                out[live[k]].append(token)
                if j + 1 < caps[k] and not ends_request(request, token, j):
                    going.append(k)
            if not going:
                break
            # guess j of each going request at its position: the distribution of guess j + 1
            step = []
            for k in going:
                request = requests[live[k]]
                st = self._state[request.request_id]
                step.append(StepInput([out[live[k]][-1]], request.num_tokens + j, st.block_ids))
            logits = self.runner.execute(step)
            rows = [logits[n] for n in range(len(going))]
            active = going
        for i in live:
            request, guesses = requests[i], out[i]
            st = self._state[request.request_id]
            # K/V written: the pending token at num_tokens - 1, guesses[:-1] after it
            st.computed = request.num_tokens + len(guesses) - 1
            st.tail_start = request.num_tokens
            st.tail = guesses[:-1]
        return out

    def _catch_up(self, request: Request, limit: int) -> tuple[int, StepInput | None]:
        """The request's catch-up chunk (its tokens the draft KV lacks, through the pending
        one) and how many guesses its blocks allow (0: none, its state dropped)."""
        rid = request.request_id
        st = self._state.get(rid)
        if st is None:
            st = self._state[rid] = _DraftState()
        end = request.num_tokens
        if st.tail:  # keep the guesses the target kept; roll the others back
            tokens = request.output_token_ids
            first = st.tail_start - request.num_prompt_tokens
            kept = 0
            for guess, actual in zip(st.tail, tokens[first:], strict=False):
                if guess != actual:
                    break
                kept += 1
            st.computed = st.tail_start + kept
            st.tail = []
        st.computed = min(st.computed, end - 1)
        # blocks for the pending position and guesses 1..cap-1 after it
        bs = self.block_size
        need = -(-(end + limit - 1) // bs) - len(st.block_ids)
        if need > 0:
            new = self.pool.allocate(need)
            if new is None:
                room = len(st.block_ids) * bs - end + 1
                if room < 1:
                    self.release(rid)
                    return 0, None
                limit = room
            else:
                st.block_ids.extend(new)
        p = request.num_prompt_tokens
        if st.computed >= p:
            chunk = request.output_token_ids[st.computed - p :]
        else:
            chunk = request.prompt_token_ids[st.computed :] + request.output_token_ids
        return limit, StepInput(chunk, st.computed, st.block_ids)

    def _generator(self, request: Request) -> torch.Generator | None:
        """A copy of a sampled request's generator: its draws are the races the target's
        verification will draw at the request's next positions."""
        if request.params.greedy or request.generator is None:
            return None
        g = torch.Generator(device=request.generator.device)
        g.set_state(request.generator.get_state())
        return g

    @staticmethod
    def _pick(request: Request, row: torch.Tensor, g: torch.Generator | None, ahead: int) -> int:
        """Guess number `ahead` (0-based) from the draft's logits `row` (module docstring)."""
        row = row.float()
        banned = banned_ids(request, ahead)
        if banned:
            row = row.clone()
            row[list(banned)] = float("-inf")
        if g is None:
            return int(row.max(dim=-1).indices)
        return int(Sampler._sample_row(row, request.params, g))

    def release(self, request_id: str) -> None:
        st = self._state.pop(request_id, None)
        if st is not None and st.block_ids:
            self.pool.free(list(reversed(st.block_ids)))

    def check_integrity(self, live: Collection[str]) -> None:
        stale = [rid for rid in self._state if rid not in live]
        assert not stale, f"draft state for requests that left: {stale}"
        held: dict[int, int] = {}
        for st in self._state.values():
            assert len(st.block_ids) * self.block_size >= st.computed, st
            for b in st.block_ids:
                held[b] = held.get(b, 0) + 1
        for b in range(self.pool.num_blocks):
            assert self.pool.ref_count(b) == held.get(b, 0), (
                f"draft block {b}: ref count {self.pool.ref_count(b)}, held {held.get(b, 0)}"
            )
        self.pool.check_integrity()
