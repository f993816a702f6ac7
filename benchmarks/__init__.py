"""Benchmarks: engine throughput, KV transfer, router overhead, attention kernels.

Each script writes JSON plus a readable table and states the machine it ran on. Speed is
reported as ratios measured side by side in one run, never as bare times alone.
"""
