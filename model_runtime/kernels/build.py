"""Build and load the compiled CPU kernels (C sources shipped in this package). Runs in worker
processes (and tests), once per process per kernel.

`load_library(source, isa)` compiles a C file on first use with the system C compiler
(`cc -O3 -fopenmp` and the ISA's flags, about a second) into a per-user cache
(`$PDSERVE_KERNEL_CACHE`, default `~/.cache/pdserve/kernels`), named by a hash of source, flags
and compiler, written atomically (several workers may start at once and race to build the same
file; the loser's identical file replaces the winner's), and loads it with ctypes.

Threads: a kernel given more than one thread runs an OpenMP parallel loop on the OpenMP runtime
torch has already loaded. torch's wheels ship their libgomp as `libgomp.so.1`, the soname the
kernel links against, so the dynamic loader hands the kernel the runtime already in the process:
one thread pool, sized by the `nthreads` the caller passes (`torch.get_num_threads()`).

Instruction sets (`ISA_FLAGS`), chosen at run time: "avx2" (AVX2 + FMA) on every x86 CPU
torch's capability probe calls AVX2 or AVX512, and "avx512" (adding AVX-512 F/BW/VL/DQ, which
the sources use under `#ifdef __AVX512F__`) where it says AVX512. `default_isa()` is the widest
the CPU has, or `$PDSERVE_KERNEL_ISA` when set (tests and A/B runs); each ISA is its own
build. Elsewhere, or without a compiler, `load_library` returns (None, reason).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
ISA_FLAGS = {
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
}
_COMPILE_TIMEOUT_S = 120.0


def cpu_has_avx2() -> bool:
    """torch's own CPU-capability probe says AVX2 or better (AVX-512 hosts have AVX2/FMA)."""
    return str(torch.backends.cpu.get_cpu_capability()) in ("AVX2", "AVX512")


def cpu_isas() -> tuple[str, ...]:
    """The `ISA_FLAGS` builds this CPU runs, narrowest first (empty below AVX2)."""
    capability = str(torch.backends.cpu.get_cpu_capability())
    if capability == "AVX512":
        return ("avx2", "avx512")
    return ("avx2",) if capability == "AVX2" else ()


def default_isa() -> str:
    """`$PDSERVE_KERNEL_ISA` if set (a ValueError if this CPU cannot run it), else the widest
    of `cpu_isas()` ('' where there is none)."""
    forced = os.environ.get("PDSERVE_KERNEL_ISA")
    if forced:
        if forced not in cpu_isas():
            raise ValueError(
                f"PDSERVE_KERNEL_ISA={forced!r}: this CPU runs {list(cpu_isas())}"
                f" (of {sorted(ISA_FLAGS)})"
            )
        return forced
    isas = cpu_isas()
    return isas[-1] if isas else ""


def cache_dir() -> Path:
    env = os.environ.get("PDSERVE_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pdserve" / "kernels"


def compile_cached(source: Path, compiler: str, isa: str = "avx2") -> Path:
    """Compile `source` into the cache unless an identical build is there; return the .so.
    The key covers the source, the C sources and headers beside it (a source may include
    another), the flags and the compiler."""
    headers = sorted(p for p in source.parent.glob("*.[ch]") if p != source)
    key_material = b"".join(p.read_bytes() for p in (source, *headers))
    flags = (*FLAGS, *ISA_FLAGS[isa])
    key_material += " ".join((compiler, *flags)).encode()
    key = hashlib.sha256(key_material).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}_{isa}_{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [compiler, *flags, str(source), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=_COMPILE_TIMEOUT_S,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({proc.returncode}): {proc.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_library(source: Path, isa: str | None = None) -> tuple[ctypes.CDLL | None, str]:
    """(the compiled and loaded `source` for `isa` (default: `default_isa()`), '') or (None,
    why it cannot run here)."""
    isa = default_isa() if isa is None else isa
    if not cpu_has_avx2():
        return None, f"CPU capability is {torch.backends.cpu.get_cpu_capability()}, not AVX2"
    if isa not in cpu_isas():
        return None, f"this CPU runs {list(cpu_isas())}, not {isa!r}"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, f"no C compiler (cc/gcc) on PATH to build {source.name}"
    try:
        return ctypes.CDLL(str(compile_cached(source, compiler, isa))), ""
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        return None, f"building/loading {source.name} ({isa}) failed: {exc}"
