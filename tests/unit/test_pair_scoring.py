"""Prefill/decode pair scoring with KV transfer cost (`router.pair_scoring`) and its use by the
routing policies: same-node pairs win unless the queues say otherwise, the exposed transfer
time after layer-wise overlap, and on one node the old independent choice. Pure."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.pair_scoring import PairScoringConfig, exposed_transfer_s
from router.policies import make_policy
from router.policy import LeastLoadPolicy, RouteRequest, WorkerView
from router.prefix_policy import PrefixAwarePolicy

# 1 MB of KV per token, 10 layers; 1 GB/s between nodes; a prefill worker computes 1000 tok/s
CFG = PairScoringConfig(
    kv_bytes_per_token=1e6, num_layers=10, cross_node_gbps=1.0, prefill_tokens_per_s=1000.0
)
REQ = RouteRequest("r", num_prompt_tokens=100, max_tokens=20)


def view(addr: str, role: str, node: str, **kw: object) -> WorkerView:
    base = WorkerView(
        worker_id=addr,
        address=addr,
        role=role,  # type: ignore[arg-type]
        healthy=True,
        draining=False,
        free_blocks=100,
        total_blocks=100,
        block_size=16,
        node=node,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def test_exposed_transfer_is_what_the_prefill_does_not_hide() -> None:
    # 100 tokens: 100 MB over 1 GB/s = 0.1 s of link; the prefill computes 0.1 s meanwhile
    assert exposed_transfer_s(100, 0, same=False, config=CFG) == pytest.approx(0.01)  # 1 layer
    # a 50-token prefix hit halves the compute that hides the push: 0.05 s exposed
    assert exposed_transfer_s(100, 50, same=False, config=CFG) == pytest.approx(0.05)
    slow = CFG.model_copy(update={"cross_node_gbps": 0.25})  # 0.4 s of link
    assert exposed_transfer_s(100, 0, same=False, config=slow) == pytest.approx(0.3)
    assert exposed_transfer_s(100, 0, same=True, config=CFG) == 0.0  # shared memory: free
    nvlink = CFG.model_copy(update={"same_node_gbps": 100.0})
    assert exposed_transfer_s(100, 0, same=True, config=nvlink) == pytest.approx(1e-4)
    assert exposed_transfer_s(100, 0, False, CFG.model_copy(update={"kv_bytes_per_token": 0})) == 0


def two_nodes(**load: dict[str, object]) -> tuple[list[WorkerView], list[WorkerView]]:
    """p-a, d-a on node a; p-b, d-b on node b; `load[address]` overrides view fields."""
    pre = [view(f"p-{n}", "prefill", n, **load.get(f"p-{n}", {})) for n in "ab"]
    dec = [view(f"d-{n}", "decode", n, **load.get(f"d-{n}", {})) for n in "ab"]
    return pre, dec


SLOW = CFG.model_copy(update={"cross_node_gbps": 0.25})  # a cross-node move costs 300 tokens


@pytest.mark.parametrize("policy", [LeastLoadPolicy(SLOW), PrefixAwarePolicy(pair=SLOW)])
def test_same_node_pair_wins_unless_the_queues_say_otherwise(policy: object) -> None:
    # p-a is the idle prefill worker; its same-node decode d-a wins over the idler d-b
    pre, dec = two_nodes(**{"p-b": {"waiting_tokens": 100}, "d-b": {"num_running": 1}})
    d = policy.choose(REQ, pre, dec)  # type: ignore[attr-defined]
    assert (d.prefill.address, d.decode.address) == ("p-a", "d-a")
    # d-a is far busier than the decode balance allows: the pair moves to node b whole (p-b's
    # 100 queued tokens cost less than a 300-token move)
    pre, dec = two_nodes(**{"p-b": {"waiting_tokens": 100}, "d-a": {"num_running": 20}})
    d = policy.choose(REQ, pre, dec)  # type: ignore[attr-defined]
    assert (d.prefill.address, d.decode.address) == ("p-b", "d-b")


def test_a_shorter_queue_elsewhere_is_worth_a_move_only_when_it_beats_the_transfer() -> None:
    policy = LeastLoadPolicy(SLOW)
    # only node b has room to decode; p-a's queue is 200 tokens shorter than p-b's, the move
    # costs 300: stay on node b
    pre, dec = two_nodes(**{"p-b": {"waiting_tokens": 200}, "d-a": {"free_blocks": 0}})
    d = policy.choose(REQ, pre, dec)
    assert (d.prefill.address, d.decode.address) == ("p-b", "d-b")
    # 400 tokens shorter: worth the move
    pre, dec = two_nodes(**{"p-b": {"waiting_tokens": 400}, "d-a": {"free_blocks": 0}})
    d = policy.choose(REQ, pre, dec)
    assert (d.prefill.address, d.decode.address) == ("p-a", "d-b")


def test_on_one_node_the_choice_is_the_independent_one() -> None:
    blind = make_policy("least_load")  # default config: every worker unlabelled
    pre = [
        view("p1", "prefill", "", waiting_tokens=300),
        view("p2", "prefill", "", waiting_tokens=10),
    ]
    dec = [
        view("d1", "decode", "", num_running=2),
        view("d2", "decode", "", num_running=0, free_blocks=50),
        view("d3", "decode", "", num_running=0, free_blocks=90),
    ]
    d = blind.choose(REQ, pre, dec)
    assert (d.prefill.address, d.decode.address) == ("p2", "d3")
    paired = LeastLoadPolicy(SLOW).choose(REQ, pre, dec)  # all on node "": nothing to price
    assert (paired.prefill.address, paired.decode.address) == ("p2", "d3")


def test_make_policy_passes_the_pair_config() -> None:
    p = make_policy("prefix_aware", pair=SLOW)
    assert isinstance(p, PrefixAwarePolicy) and p.pair == SLOW
    q = make_policy("least_load", pair=SLOW)
    assert isinstance(q, LeastLoadPolicy) and q.pair == SLOW
