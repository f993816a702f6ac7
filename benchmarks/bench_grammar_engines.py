"""Compare grammar engines for structured output: llguidance, xgrammar, outlines-core.

Standalone; needs the three engines installed (`pip install 'pdserve[grammar-bench]'`) and a
model folder's tokenizer (default: SmolLM2-135M-Instruct from `pdserve pull`). Measures, on
that tokenizer:

- tokenizer-info setup (once per model);
- compile time of every schema of `tooling.json_schemas.SCHEMAS` (cold: a fresh compiler);
- next-token mask time along a token walk per schema (batch 1: one matcher per call; batch
  16: sixteen matchers of different schemas, each engine's batch API), the walk being the
  same tokens for every engine (drawn once with llguidance, `_walk`);
- which JSON-schema features each enforces: `tooling.json_schemas.FEATURES` probes, each an
  instance the engine must accept and one it must refuse ("yes"), or a compile error
  ("error"), or both accepted ("ignored": the keyword is silently dropped).

    python benchmarks/bench_grammar_engines.py [--model-dir DIR] [--out runs/grammar-engines]

Writes `results.json` and prints a table; the numbers in docs/structured-output.md come from
it (single-threaded engines except where the engine's batch API brings its own threads).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tooling.json_schemas import FEATURES, SCHEMAS
from tooling.models.gguf_convert import _byte_alphabet

SEPARATORS = (", ", ": ")


def token_bytes(tokenizer_json: dict[str, Any]) -> list[bytes]:
    """Every token's bytes for a byte-level BPE `tokenizer.json` (special tokens as text)."""
    table = {c: b for b, c in _byte_alphabet().items()}
    vocab: dict[str, int] = tokenizer_json["model"]["vocab"]
    out = [b""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        out[i] = bytes(table[c] for c in text) if all(c in table for c in text) else text.encode()
    for added in tokenizer_json.get("added_tokens", []):
        out[added["id"]] = added["content"].encode()
    return out


class Engine(Protocol):
    """What the comparison needs of an engine (one adapter per engine below)."""

    name: str

    def setup(self, model_dir: Path, eos: int) -> None: ...
    def compile(self, schema: dict[str, Any]) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def consume(self, m: Any, token: int) -> bool: ...
    def accepting(self, m: Any) -> bool: ...
    def fill(self, m: Any, mask: np.ndarray, row: int) -> None: ...
    def fill_batch(self, ms: list[Any], mask: np.ndarray) -> None: ...


class LLGuidance:
    name = "llguidance"

    def setup(self, model_dir: Path, eos: int) -> None:
        import llguidance

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), eos_token=eos)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict[str, Any]) -> Any:
        g = self.llg.LLMatcher.grammar_from_json_schema(
            schema,
            overrides={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        )
        m = self.llg.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def consume(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token))

    def accepting(self, m: Any) -> bool:
        return bool(m.is_accepting()) and not m.is_error()

    def fill(self, m: Any, mask: np.ndarray, row: int) -> None:
        v = mask[row]
        m.unsafe_compute_mask_ptr(v.ctypes.data, v.nbytes)

    def fill_batch(self, ms: list[Any], mask: np.ndarray) -> None:
        self.executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(ms)], mask.ctypes.data, mask.shape[1] * 4, len(ms)
        )


class XGrammar:
    name = "xgrammar"

    def setup(self, model_dir: Path, eos: int) -> None:
        import torch
        import xgrammar

        self.xgr, self.torch = xgrammar, torch
        vocab = token_bytes(json.loads((model_dir / "tokenizer.json").read_text()))
        # RAW: each entry is the token's own bytes (byte-level BPE already undone)
        self.info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, stop_token_ids=[eos])

    def compile(self, schema: dict[str, Any]) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=SEPARATORS
        )

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def consume(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))

    def accepting(self, m: Any) -> bool:
        return bool(m.accept_token(self.info.stop_token_ids[0]))

    def fill(self, m: Any, mask: np.ndarray, row: int) -> None:
        m.fill_next_token_bitmask(self.torch.from_numpy(mask), row)

    def fill_batch(self, ms: list[Any], mask: np.ndarray) -> None:
        if not hasattr(self, "batch"):
            self.batch = self.xgr.BatchGrammarMatcher(max_threads=8)
        self.batch.batch_fill_next_token_bitmask(ms, self.torch.from_numpy(mask))


class OutlinesCore:
    name = "outlines-core"

    def setup(self, model_dir: Path, eos: int) -> None:
        import outlines_core

        self.oc = outlines_core
        vocab = token_bytes(json.loads((model_dir / "tokenizer.json").read_text()))
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            if i != eos and b:
                by_bytes.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, by_bytes)

    def compile(self, schema: dict[str, Any]) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), r"[ ]?")
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def consume(self, m: Any, token: int) -> bool:
        try:
            m.advance(token, return_tokens=False)
        except (ValueError, RuntimeError, TypeError):
            return False
        return True

    def accepting(self, m: Any) -> bool:
        return bool(m.is_finished())

    def fill(self, m: Any, mask: np.ndarray, row: int) -> None:
        v = mask[row]
        m.write_mask_into(v.ctypes.data, v.size, 4)

    def fill_batch(self, ms: list[Any], mask: np.ndarray) -> None:
        for i, m in enumerate(ms):
            self.fill(m, mask, i)


ENGINES: tuple[type[Engine], ...] = (LLGuidance, XGrammar, OutlinesCore)


def _walk(
    engine: LLGuidance,
    schema: dict[str, Any],
    encode: Callable[[str], list[int]],
    rng: random.Random,
    limit: int = 200,
) -> list[int]:
    """A token path the schema accepts, drawn with llguidance: random allowed tokens, with a
    bias to tokens that close strings and containers so most walks end within `limit`."""
    m = engine.compile(schema)
    closing = {t for s in ('"', "}", "]", '"}', '"]', "0", "1", "true") for t in encode(s)}
    mask = np.zeros((1, (engine.tok.vocab_size + 31) // 32), dtype=np.int32)
    out: list[int] = []
    while len(out) < limit and not m.is_stopped():
        engine.fill(m, mask, 0)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: engine.tok.vocab_size]
        allowed = np.flatnonzero(bits)
        prefer = [t for t in allowed if t in closing]
        tok = int(rng.choice(prefer) if prefer and rng.random() < 0.5 else rng.choice(allowed))
        if tok in engine.tok.eos_tokens:
            break
        out.append(tok)
        m.consume_token(tok)
    return out


def _accepts(engine: Engine, m: Any, tokens: list[int]) -> bool:
    return all(engine.consume(m, t) for t in tokens) and engine.accepting(m)


def measure(model_dir: Path, engines: list[Engine], eos: int) -> dict[str, Any]:
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def encode(s: str) -> list[int]:
        return list(tk.encode(s, add_special_tokens=False).ids)

    results: dict[str, Any] = {"model_dir": str(model_dir), "engines": {}}
    llg = LLGuidance()
    llg.setup(model_dir, eos)
    rng = random.Random(0)
    walks = {s.name: _walk(llg, s.schema, encode, rng) for s in SCHEMAS}
    words = (llg.tok.vocab_size + 31) // 32
    for engine in engines:
        r: dict[str, Any] = {}
        t0 = time.perf_counter()
        engine.setup(model_dir, eos)
        r["setup_s"] = time.perf_counter() - t0
        compiled: dict[str, Any] = {}
        compile_ms: dict[str, float] = {}
        first_ms: dict[str, float] = {}
        errors: dict[str, str] = {}
        for s in SCHEMAS:
            t0 = time.perf_counter()
            try:
                compiled[s.name] = engine.compile(s.schema)
            except Exception as exc:
                errors[s.name] = f"{type(exc).__name__}: {str(exc)[:160]}"
                continue
            compile_ms[s.name] = (time.perf_counter() - t0) * 1e3
            # what a request's first token waits for: compile + its first mask (llguidance
            # builds lexer states lazily, so part of its compile work lands here)
            mask1 = np.zeros((1, words), dtype=np.int32)
            engine.fill(engine.matcher(compiled[s.name]), mask1, 0)
            first_ms[s.name] = (time.perf_counter() - t0) * 1e3
        r["compile_errors"] = errors
        r["compile_ms"] = compile_ms
        r["compile_ms_median"] = statistics.median(compile_ms.values()) if compile_ms else None
        r["compile_ms_max"] = max(compile_ms.values()) if compile_ms else None
        r["first_mask_ms_median"] = statistics.median(first_ms.values()) if first_ms else None
        r["first_mask_ms_max"] = max(first_ms.values()) if first_ms else None
        # batch 1: one mask per step along each schema's walk
        mask = np.zeros((16, words), dtype=np.int32)
        per_token: list[float] = []
        rejected: list[str] = []
        for name, walk in walks.items():
            if name not in compiled:
                continue
            m = engine.matcher(compiled[name])
            for tok in walk:
                t0 = time.perf_counter()
                engine.fill(m, mask, 0)
                per_token.append(time.perf_counter() - t0)
                if not engine.consume(m, tok):
                    rejected.append(name)
                    break
        r["mask_us_b1_median"] = statistics.median(per_token) * 1e6
        r["mask_us_b1_p99"] = float(np.percentile(per_token, 99)) * 1e6
        r["mask_us_b1_mean"] = statistics.fmean(per_token) * 1e6
        r["walks_rejected"] = rejected
        # batch 16: 16 schemas side by side, one batch fill per step
        names = [n for n in walks if n in compiled and n not in rejected][:16]
        ms = [engine.matcher(compiled[n]) for n in names]
        steps = min(len(walks[n]) for n in names)
        per_step: list[float] = []
        for k in range(steps):
            t0 = time.perf_counter()
            engine.fill_batch(ms, mask[: len(ms)])
            per_step.append(time.perf_counter() - t0)
            for n, m in zip(names, ms, strict=True):
                engine.consume(m, walks[n][k])
        r["mask_us_b16_median"] = statistics.median(per_step) * 1e6 if per_step else None
        r["b16_rows"], r["b16_steps"] = len(ms), steps
        # features
        feats: dict[str, str] = {}
        for f in FEATURES:
            try:
                c = engine.compile(f.schema)
            except Exception:
                feats[f.name] = "error"
                continue
            valid, invalid = (
                _accepts(engine, engine.matcher(c), encode(text)) for text in (f.valid, f.invalid)
            )
            feats[f.name] = "rejects valid" if not valid else "ignored" if invalid else "yes"
        r["features"] = feats
        r["features_enforced"] = sum(v == "yes" for v in feats.values())
        results["engines"][engine.name] = r
    results["schemas"] = len(SCHEMAS)
    results["walk_tokens"] = sum(len(w) for w in walks.values())
    return results


def main() -> None:
    from tooling.models.pull import default_out

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model-dir", type=Path, default=default_out("smollm2-135m-instruct", "float32")
    )
    ap.add_argument("--out", type=Path, default="runs/grammar-engines")
    ap.add_argument("--engines", default="llguidance,xgrammar,outlines-core")
    args = ap.parse_args()
    config = json.loads((args.model_dir / "config.json").read_text())
    eos = config["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    wanted = args.engines.split(",")
    engines = [e() for e in ENGINES if e.name in wanted]
    res = measure(args.model_dir, engines, eos)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(res, indent=2))
    for name, r in res["engines"].items():
        print(
            f"{name:14s} setup {r['setup_s']:.2f}s  compile median {r['compile_ms_median']:.1f}"
            f" ms max {r['compile_ms_max']:.1f} ms ({len(r['compile_errors'])} errors)  compile+"
            f"first mask median {r['first_mask_ms_median']:.1f} ms max "
            f"{r['first_mask_ms_max']:.1f} ms  mask"
            f" b1 median {r['mask_us_b1_median']:.0f} us mean {r['mask_us_b1_mean']:.0f} us"
            f" p99 {r['mask_us_b1_p99']:.0f} us  b16"
            f" {r['mask_us_b16_median']:.0f} us  features {r['features_enforced']}/"
            f"{len(FEATURES)}  rejected walks {r['walks_rejected']}"
        )
    print(f"wrote {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
