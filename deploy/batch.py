"""`pdserve batch`: offline batch inference from a JSONL file through the colocated engine.

Runs in the CLI process, which owns one `LLMEngine` (model + KV cache) for the whole run.
Input: one JSON object per line (blank lines are skipped)::

    {"id": "a", "prompt": "Once upon", "max_tokens": 32, "temperature": 0}
    {"prompt_token_ids": [0, 17, 99], "temperature": 0.8, "top_p": 0.9, "seed": 7}

Fields: exactly one of `prompt` (text; tokenized with BOS when the tokenizer adds one) or
`prompt_token_ids`; optional `id` (string or integer; default: the 1-based line number),
`max_tokens`, `temperature` (0 = greedy), `top_p`, `top_k`, `seed`, `stop_token_ids`,
`ignore_eos`. Output: one line per input line, in
the same order::

    {"id": "a", "token_ids": [...], "text": "...", "finish_reason": "stop" | "length",
     "usage": {"prompt_tokens": 4, "completion_tokens": 32, "cached_tokens": 0}}

A line that cannot run (invalid JSON, unknown field, wrong type, both or neither prompt field,
token id outside the vocabulary, prompt too long, bad sampling value) gets
`{"id": ..., "error": {"field": ..., "message": ...}}` instead, naming the field (null when the
line is not a JSON object); every other line still runs. Output lines are written as soon as
all earlier lines are done, so a partial output file is a prefix of the full one.

This module imports torch only inside `run_batch`, so `pdserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, ValidationError

from model_runtime.config import ModelConfig
from model_runtime.sampling_params import SamplingParams
from model_runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from model_runtime.engine_config import EngineConfig


class BatchRequest(BaseModel):
    """One input line. Strict types: "5" is not an integer, 1.0 is not a token id."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    id: str | int | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int = SamplingParams.max_tokens
    temperature: float = SamplingParams.temperature
    top_p: float = SamplingParams.top_p
    top_k: int = SamplingParams.top_k
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop_token_ids",
    "ignore_eos",
)


@dataclass(frozen=True)
class PreparedRequest:
    """A validated line, ready for `LLMEngine.add_request`."""

    line_id: str | int
    prompt_field: str  # "prompt" or "prompt_token_ids": the field blamed if the engine refuses
    prompt_token_ids: list[int]
    params: SamplingParams


class LineError(Exception):
    """A line that cannot run; becomes `{"id", "error": {"field", "message"}}`."""

    def __init__(self, line_id: str | int, field: str | None, message: str) -> None:
        super().__init__(message)
        self.line_id = line_id
        self.field = field
        self.message = message

    def to_json(self) -> dict[str, Any]:
        return {"id": self.line_id, "error": {"field": self.field, "message": self.message}}


def _pydantic_error(line_id: str | int, exc: ValidationError) -> LineError:
    err = exc.errors()[0]
    loc = err["loc"]
    field = str(loc[0]) if loc else None
    if err["type"] == "extra_forbidden":
        allowed = ", ".join(BatchRequest.model_fields)
        return LineError(line_id, field, f"unknown field {field!r}; allowed: {allowed}")
    got = repr(err.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    if field == "id":
        return LineError(line_id, field, f"id must be a string or an integer, got {got}")
    where = field or "line"
    if len(loc) > 1 and isinstance(loc[1], int):
        where = f"{field}[{loc[1]}]"
    return LineError(line_id, field, f"{where}: {err['msg']} (got {got})")


def prepare_line(
    line: str, line_number: int, tokenizer: Tokenizer, model_config: ModelConfig
) -> PreparedRequest:
    """Parse and validate one input line; raise `LineError` naming the offending field.

    Checks everything the engine would refuse, so errors name a field rather than carry an
    engine message: prompt fields, token ids in `[0, vocab_size)`, prompt length and
    prompt + max_tokens against `max_position_embeddings`, and `SamplingParams.validate`.
    """
    line_id: str | int = line_number
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise LineError(line_id, None, f"invalid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise LineError(line_id, None, f"line must be a JSON object, got {type(raw).__name__}")
    given_id = raw.get("id")
    if isinstance(given_id, str | int) and not isinstance(given_id, bool):
        line_id = given_id
    try:
        req = BatchRequest.model_validate(raw)
    except ValidationError as exc:
        raise _pydantic_error(line_id, exc) from None

    if (req.prompt is None) == (req.prompt_token_ids is None):
        field = "prompt" if req.prompt is None else "prompt_token_ids"
        raise LineError(line_id, field, "give exactly one of 'prompt' or 'prompt_token_ids'")
    vocab = model_config.vocab_size
    if req.prompt is not None:
        field, tokens = "prompt", tokenizer.encode(req.prompt, add_bos=True)
    else:
        assert req.prompt_token_ids is not None
        field, tokens = "prompt_token_ids", list(req.prompt_token_ids)
        if not tokens:
            raise LineError(line_id, field, "prompt_token_ids must not be empty")
        for i, t in enumerate(tokens):
            if not 0 <= t < vocab:
                raise LineError(
                    line_id, field, f"prompt_token_ids[{i}] = {t} is outside [0, {vocab})"
                )
    if not tokens:
        raise LineError(line_id, field, "prompt encodes to no tokens")
    max_len = model_config.max_position_embeddings
    if len(tokens) >= max_len:
        raise LineError(
            line_id,
            field,
            f"prompt is {len(tokens)} tokens; it must be shorter than the model's "
            f"max_position_embeddings ({max_len}) to leave room for one generated token",
        )
    if len(tokens) + req.max_tokens > max_len:
        raise LineError(
            line_id,
            "max_tokens",
            f"prompt ({len(tokens)} tokens) + max_tokens ({req.max_tokens}) exceeds the "
            f"model's max_position_embeddings ({max_len}); use max_tokens <= "
            f"{max_len - len(tokens)}",
        )
    params = SamplingParams(
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop_token_ids=tuple(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
    )
    try:
        params.validate(vocab)
    except ValueError as exc:
        # SamplingParams messages start with the field name ("top_p must be in (0, 1] ...").
        first = str(exc).split(" ", 1)[0]
        raise LineError(line_id, first if first in _SAMPLING_FIELDS else None, str(exc)) from None
    return PreparedRequest(line_id, field, tokens, params)


@dataclass(frozen=True)
class BatchSummary:
    num_lines: int
    num_errors: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    seconds: float


class _OrderedWriter:
    """Writes result lines in input order, each as soon as every earlier one is known."""

    def __init__(self, out: IO[str], n: int) -> None:
        self._out = out
        self._results: list[dict[str, Any] | None] = [None] * n
        self._next = 0

    def put(self, index: int, result: dict[str, Any]) -> None:
        assert self._results[index] is None, f"line {index + 1} reported twice"
        self._results[index] = result
        while self._next < len(self._results) and self._results[self._next] is not None:
            self._out.write(json.dumps(self._results[self._next], ensure_ascii=False) + "\n")
            self._next += 1
        self._out.flush()


def run_batch(
    model_dir: str | Path,
    input_path: str | Path,
    output_path: str | Path,
    engine_config: EngineConfig | None = None,
) -> BatchSummary:
    """Run every line of `input_path` through one engine; write `output_path` (see module doc).

    Raises ValueError for a bad model folder or config; bad lines never raise.
    """
    from tqdm import tqdm

    from model_runtime.engine import LLMEngine
    from model_runtime.engine_config import EngineConfig

    t0 = time.monotonic()
    model_config = ModelConfig.from_model_dir(model_dir)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    lines = [
        (n, text)
        for n, text in enumerate(Path(input_path).read_text().splitlines(), start=1)
        if text.strip()
    ]
    engine = LLMEngine.from_model_dir(model_dir, engine_config or EngineConfig())

    pending: dict[str, tuple[int, PreparedRequest]] = {}
    errors = prompt_tokens = completion_tokens = cached_tokens = 0
    with open(output_path, "w", encoding="utf-8") as out:
        writer = _OrderedWriter(out, len(lines))
        for index, (number, text) in enumerate(lines):
            try:
                prepared = prepare_line(text, number, tokenizer, model_config)
                request_id = f"line-{number}"
                try:
                    engine.add_request(request_id, prepared.prompt_token_ids, prepared.params)
                except ValueError as exc:  # e.g. more KV blocks than the cache has
                    raise LineError(prepared.line_id, prepared.prompt_field, str(exc)) from None
                pending[request_id] = (index, prepared)
            except LineError as err:
                errors += 1
                writer.put(index, err.to_json())
        with tqdm(total=len(pending), unit="req", disable=not sys.stderr.isatty()) as bar:
            while engine.has_unfinished():
                for output in engine.step():
                    if not output.finished:
                        continue
                    index, prepared = pending.pop(output.request_id)
                    usage = {
                        "prompt_tokens": len(output.prompt_token_ids),
                        "completion_tokens": len(output.output_token_ids),
                        "cached_tokens": output.num_cached_tokens,
                    }
                    prompt_tokens += usage["prompt_tokens"]
                    completion_tokens += usage["completion_tokens"]
                    cached_tokens += usage["cached_tokens"]
                    writer.put(
                        index,
                        {
                            "id": prepared.line_id,
                            "token_ids": list(output.output_token_ids),
                            "text": tokenizer.decode(output.output_token_ids),
                            "finish_reason": output.finish_reason,
                            "usage": usage,
                        },
                    )
                    bar.update(1)
    assert not pending, f"engine finished with {len(pending)} requests unreported"
    return BatchSummary(
        len(lines), errors, prompt_tokens, completion_tokens, cached_tokens, time.monotonic() - t0
    )


def add_batch_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the `batch` subcommand on the `pdserve` parser."""
    p = subparsers.add_parser(
        "batch",
        help="offline batch inference from a JSONL file",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    from model_runtime.engine_config import EngineConfig  # torch-free

    # Unset engine options keep `EngineConfig`'s defaults, named in each help line.
    d = {name: f.default for name, f in EngineConfig.model_fields.items()}
    p.add_argument("--model", required=True, help="HF model folder (config.json, safetensors)")
    p.add_argument("--input", required=True, help="input JSONL, one request per line")
    p.add_argument("--output", required=True, help="output JSONL, one result per input line")
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        help=f"token budget of one engine step (default: {d['max_num_batched_tokens']})",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        help=f"most requests running at once (default: {d['max_num_seqs']}, or "
        "--max-batch-tokens when smaller)",
    )
    p.add_argument(
        "--block-size", type=int, help=f"tokens per KV block (default: {d['block_size']})"
    )
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        help=f"KV blocks (default: as many as {d['kv_cache_memory_mb']:g} MiB hold)",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--no-chunked-prefill", action="store_true", help="disable chunked prefill")
    p.add_argument("--device", help=f"torch device, e.g. cpu or cuda:0 (default: {d['device']})")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help=f"weights and KV dtype; auto = the checkpoint's (default: {d['dtype']})",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "int8"],
        help="how KV blocks are stored: auto = the model dtype, int8 = int8 values with a "
        f"float16 scale per token per KV head (default: {d['kv_cache_dtype']})",
    )
    p.add_argument(
        "--attention-backend",
        choices=["auto", "torch", "cpu", "triton"],
        help="auto = Triton on CUDA; on CPU the compiled decode attention ('cpu') where it "
        f"builds, else torch (default: {d['attention_backend']})",
    )
    p.add_argument(
        "--linear-kernel",
        choices=["auto", "torch", "onednn", "avx2"],
        help="GEMM for weight matmuls; auto = the compiled AVX2 kernel where it is the CPU's "
        "best, else oneDNN prepacked weights where torch has oneDNN, else F.linear "
        f"(default: {d['linear_kernel']})",
    )
    p.set_defaults(func=batch_main)


def batch_main(args: argparse.Namespace) -> int:
    """Run `pdserve batch`; return the process exit code (2 for bad arguments or model)."""
    from model_runtime.engine_config import EngineConfig

    given = {
        "max_num_batched_tokens": args.max_batch_tokens,
        "max_num_seqs": args.max_num_seqs,
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "device": args.device,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "attention_backend": args.attention_backend,
        "linear_kernel": args.linear_kernel,
    }
    fields: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    if args.max_num_seqs is None and args.max_batch_tokens is not None:
        # A small step budget caps the running set too, unless the user set both.
        default_seqs = EngineConfig.model_fields["max_num_seqs"].default
        fields["max_num_seqs"] = min(default_seqs, args.max_batch_tokens)
    if args.no_prefix_caching:
        fields["enable_prefix_caching"] = False
    if args.no_chunked_prefill:
        fields["enable_chunked_prefill"] = False
    if not Path(args.input).is_file():
        print(f"pdserve batch: --input {args.input}: no such file", file=sys.stderr)
        return 2
    try:
        config = EngineConfig(**fields)
        summary = run_batch(args.model, args.input, args.output, config)
    except (ValueError, ValidationError) as exc:
        print(f"pdserve batch: {exc}", file=sys.stderr)
        return 2
    print(
        f"pdserve batch: {summary.num_lines} lines ({summary.num_errors} errors), "
        f"{summary.prompt_tokens} prompt tokens ({summary.cached_tokens} cached), "
        f"{summary.completion_tokens} generated, {summary.seconds:.2f}s -> {args.output}",
        file=sys.stderr,
    )
    return 0
