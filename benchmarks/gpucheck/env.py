"""Step 1, environment: GPU, driver, library versions, and two measured ceilings — device
copy bandwidth (bytes read + written per second) and bf16 matmul TFLOP/s. Dry run: the same
on the CPU at small sizes."""

from __future__ import annotations

import importlib.metadata as md
import platform
import subprocess

import torch

from benchmarks.gpucheck.common import Ctx, StepReport, timed

PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "grpcio",
    "protobuf",
    "pydantic",
    "grpcio-health-checking",
    "cryptography",
    "safetensors",
    "tokenizers",
    "numpy",
)


def run(ctx: Ctx) -> StepReport:
    rep = StepReport()
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    rep.metric("python", platform.python_version())
    rep.metric("versions", versions)
    rep.metric("torch_cuda", torch.version.cuda)
    dev = ctx.device
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        rep.metric("gpu", props.name)
        rep.metric("gpu_memory_gib", round(props.total_memory / 2**30, 1))
        rep.metric("sm_count", props.multi_processor_count)
        rep.metric("capability", f"{props.major}.{props.minor}")
        try:
            nccl = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
            rep.metric("nccl", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl)
        except (RuntimeError, AttributeError) as exc:
            rep.note(f"NCCL version unavailable: {exc}")
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
            rep.metric("driver", out.stdout.strip())
        except (OSError, subprocess.TimeoutExpired) as exc:
            rep.note(f"nvidia-smi: {exc}")
    else:
        rep.skip("GPU properties", "dry run (CPU)")
    rep.check("device usable", _device_ok(dev), str(dev))
    n = (2 << 30) if dev.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    s = timed(lambda: dst.copy_(src), dev, iters=10 if dev.type == "cuda" else 3)
    rep.metric("copy_GBps", round(2 * n / s / 1e9, 1))  # read + write
    src = dst = torch.empty(0, device=dev)  # free the 2 x n bytes before the matmul
    m = 8192 if dev.type == "cuda" else 512
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(m, m, device=dev, dtype=dtype)
    b = torch.randn(m, m, device=dev, dtype=dtype)
    s = timed(lambda: a @ b, dev, iters=10 if dev.type == "cuda" else 3, warmup=3)
    rep.metric(f"matmul_{str(dtype).removeprefix('torch.')}_TFLOPs", round(2 * m**3 / s / 1e12, 1))
    return rep


def _device_ok(dev: torch.device) -> bool:
    x = torch.arange(1024, device=dev, dtype=torch.float32)
    return float((x * 2).sum()) == float(1023 * 1024)
