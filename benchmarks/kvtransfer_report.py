"""The readable side of `benchmarks.bench_kvtransfer`: its result dict as Markdown tables
(bandwidth on each data plane, then streaming against prefill)."""

from __future__ import annotations

from typing import Any


def table(res: dict[str, Any]) -> str:
    lines = [
        "| tokens | MB | transfer ms best (median) | GB/s | raw gloo GB/s "
        "| vs raw: best (median) [paired] | scattered src: vs raw best (median) [paired] "
        "| memcpy GB/s | vs memcpy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for b in res["bandwidth"]:
        lines.append(
            f"| {b['tokens']} | {b['bytes'] / 1e6:.1f} | {b['transfer_s']['min'] * 1e3:.1f} "
            f"({b['transfer_s']['median'] * 1e3:.1f}) | {b['transfer_gbs']:.2f} | "
            f"{b['raw_gloo_gbs']:.2f} | {b['vs_raw_gloo']:.0%} ({b['vs_raw_gloo_median']:.0%}) "
            f"[{b['vs_raw_gloo_paired']:.0%}] | {b['scattered_vs_raw_gloo']:.0%} "
            f"({b['scattered_vs_raw_gloo_median']:.0%}) "
            f"[{b['scattered_vs_raw_gloo_paired']:.0%}] | "
            f"{b['memcpy_gbs']:.2f} | {b['vs_memcpy']:.1%} |"
        )
    lines += [
        "",
        "Shared-memory data plane (same host):",
        "",
        "| tokens | shm ms best (median) | GB/s | vs raw gloo: best [paired] | vs memcpy "
        "| vs hot memcpy | scattered src: ms best, vs memcpy |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in res["bandwidth"]:
        lines.append(
            f"| {b['tokens']} | {b['shm_s']['min'] * 1e3:.2f} ({b['shm_s']['median'] * 1e3:.2f}) "
            f"| {b['shm_gbs']:.2f} | {b['shm_vs_raw_gloo']:.0%} "
            f"[{b['shm_vs_raw_gloo_paired']:.0%}] | {b['shm_vs_memcpy']:.0%} | "
            f"{b['shm_vs_memcpy_hot']:.0%} | {b['shm_scattered_s']['min'] * 1e3:.2f}, "
            f"{b['shm_scattered_vs_memcpy']:.0%} |"
        )
    for title, key in (("gloo bytes", "streaming"), ("shared memory", "streaming_shm")):
        lines += ["", f"Streaming ({title}):", ""]
        lines += _streaming_table(res[key])
    lines += ["", f"targets {res['targets']} -> met {res['meets']}"]
    return "\n".join(lines)


def _streaming_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| tokens | prefill alone ms | prefill + stream ms | transfer ms | exposed ms | hidden "
        "| tail ms | hidden (tail) | TTFT ms | exposed / TTFT | tail / TTFT |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in rows:
        lines.append(
            f"| {s['tokens']} | {s['prefill_alone_s'] * 1e3:.0f} | "
            f"{s['prefill_streaming_s'] * 1e3:.0f} | {s['transfer_s'] * 1e3:.1f} | "
            f"{s['exposed_s'] * 1e3:.1f} | {s['hidden']:.0%} | {s['tail_s'] * 1e3:.1f} | "
            f"{s['hidden_by_tail']:.0%} | {s['ttft_s'] * 1e3:.0f} | "
            f"{s['exposed_share_of_ttft']:.2%} | {s['tail_share_of_ttft']:.2%} |"
        )
    return lines
