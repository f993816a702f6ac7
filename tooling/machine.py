"""Measure the machine a benchmark runs on: memory bandwidth and matmul FLOP/s (torch, CPU/GPU).

These are the denominators of MBU (decode) and MFU (prefill). Both are best-of-N measurements
taken in the same run as the workload they normalise.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class MachineInfo:
    cpu_count: int
    torch_threads: int
    platform: str
    torch_version: str
    copy_bandwidth_gbs: float  # STREAM-copy style: (read + write bytes) / time
    read_bandwidth_gbs: float  # reduction over a large tensor: bytes read / time
    matmul_gflops: float  # fp32 GEMM, the faster of the two libraries below
    matmul_gflops_torch_mm: float  # torch.mm (MKL on x86 CPUs)
    matmul_gflops_onednn: float  # oneDNN prepacked GEMM (0.0 where unavailable)

    @property
    def memory_bandwidth_gbs(self) -> float:
        """The larger of the two bandwidth measurements (the stricter denominator for MBU)."""
        return max(self.copy_bandwidth_gbs, self.read_bandwidth_gbs)

    def best_of(self, other: MachineInfo) -> MachineInfo:
        """Field-wise maximum of two measurements of the same machine (e.g. before and after a
        workload): on a shared host either can land in a slow moment."""
        return MachineInfo(
            cpu_count=self.cpu_count,
            torch_threads=self.torch_threads,
            platform=self.platform,
            torch_version=self.torch_version,
            copy_bandwidth_gbs=max(self.copy_bandwidth_gbs, other.copy_bandwidth_gbs),
            read_bandwidth_gbs=max(self.read_bandwidth_gbs, other.read_bandwidth_gbs),
            matmul_gflops=max(self.matmul_gflops, other.matmul_gflops),
            matmul_gflops_torch_mm=max(self.matmul_gflops_torch_mm, other.matmul_gflops_torch_mm),
            matmul_gflops_onednn=max(self.matmul_gflops_onednn, other.matmul_gflops_onednn),
        )

    def to_json(self) -> dict[str, object]:
        return asdict(self) | {"memory_bandwidth_gbs": self.memory_bandwidth_gbs}


def _best(fn: object, repeats: int) -> float:
    assert callable(fn)
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_machine(size_mb: int = 512, gemm_n: int = 2048, repeats: int = 5) -> MachineInfo:
    """Bandwidth over `size_mb` float32 buffers (well beyond caches) and an n^3 fp32 GEMM."""
    n = size_mb * 1024 * 1024 // 4
    src = torch.rand(n)
    dst = torch.empty_like(src)
    t_copy = _best(lambda: dst.copy_(src), repeats)
    t_read = _best(lambda: src.sum(), repeats)
    a = torch.rand(gemm_n, gemm_n)
    b = torch.rand(gemm_n, gemm_n)
    t_mm = _best(lambda: torch.mm(a, b), repeats)
    t_onednn = _onednn_gemm_seconds(a, b, repeats)
    nbytes = n * 4
    return MachineInfo(
        cpu_count=os.cpu_count() or 0,
        torch_threads=torch.get_num_threads(),
        platform=platform.platform(),
        torch_version=torch.__version__,
        copy_bandwidth_gbs=2 * nbytes / t_copy / 1e9,
        read_bandwidth_gbs=nbytes / t_read / 1e9,
        matmul_gflops=2 * gemm_n**3 / min(t_mm, t_onednn) / 1e9,
        matmul_gflops_torch_mm=2 * gemm_n**3 / t_mm / 1e9,
        matmul_gflops_onednn=2 * gemm_n**3 / t_onednn / 1e9 if t_onednn < float("inf") else 0.0,
    )


def _onednn_gemm_seconds(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    """Best time of a @ b through the GEMM the model uses on CPU (`model_runtime.linear`).

    The engine's prepacked oneDNN GEMM can beat torch.mm by 2x or more (MKL's slow path on
    AMD), so a FLOP/s peak measured with torch.mm alone would overstate MFU.
    """
    from model_runtime.linear import onednn_supported

    if not onednn_supported(a.device, a.dtype):
        return float("inf")
    packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), a.shape[0])
    return _best(
        lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), repeats
    )
