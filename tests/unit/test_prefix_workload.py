"""The prefix-routing benchmark's workload and oracle hit rate (`benchmarks.prefix_workload`)."""

from __future__ import annotations

import argparse

from benchmarks.prefix_workload import BLOCK, oracle_hit_rate, workload


def _args(groups: int, per_group: int, prefix: int, suffix: int) -> argparse.Namespace:
    return argparse.Namespace(
        groups=groups, per_group=per_group, prefix=prefix, suffix=suffix, seed=0
    )


def test_workload_shares_each_groups_prefix_and_is_seeded() -> None:
    reqs = workload(_args(3, 4, 2 * BLOCK, 5))
    assert len(reqs) == 12
    for g in range(3):
        prompts = [ids for group, ids in reqs if group == g]
        assert len(prompts) == 4
        assert all(len(ids) == 2 * BLOCK + 5 for ids in prompts)
        assert len({tuple(ids[: 2 * BLOCK]) for ids in prompts}) == 1  # one shared prefix
        assert len({tuple(ids[2 * BLOCK :]) for ids in prompts}) == 4  # own suffixes
    assert workload(_args(3, 4, 2 * BLOCK, 5)) == reqs


def test_oracle_counts_only_full_blocks_seen_before() -> None:
    shared = list(range(10, 10 + 2 * BLOCK))
    a = (0, shared + [1] * BLOCK)
    b = (0, shared + [2] * BLOCK)
    # b reuses the 2 shared blocks; its own last block (it holds the last token) always runs.
    assert oracle_hit_rate([a, b]) == (2 * BLOCK) / (2 * 3 * BLOCK)
    # The same prompt twice: its last block still runs, so 2 of its 3 blocks are hits.
    assert oracle_hit_rate([a, a]) == (2 * BLOCK) / (2 * 3 * BLOCK)
    # Nothing shared: no hits.
    assert oracle_hit_rate([a, (1, [7] * (3 * BLOCK))]) == 0.0
