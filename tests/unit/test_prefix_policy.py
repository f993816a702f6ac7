"""Table tests of the prefix-aware routing policy (`router.prefix_policy`): pure, fake clock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.policies import make_policy
from router.policy import RouteRequest, WorkerView
from router.prefix_index.base import PrefixMatch
from router.prefix_policy import PendingPrefixes, PrefixAwarePolicy, PrefixRoutingConfig

CHAIN = tuple(range(1, 36))  # 35 reusable blocks of 16: a 576-token prompt
REQ = RouteRequest("r", 576, 64, block_hashes=CHAIN, prefix_matches=())


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def view(addr: str, role: str = "prefill", **kw: object) -> WorkerView:
    base = WorkerView(
        worker_id=addr,
        address=addr,
        role=role,  # type: ignore[arg-type]
        healthy=True,
        draining=False,
        free_blocks=1000,
        total_blocks=1000,
        block_size=16,
        epoch=1,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def hits(**blocks: int) -> tuple[PrefixMatch, ...]:
    return tuple(PrefixMatch(w, 1, n) for w, n in blocks.items())


D = [view("d1", "decode")]

# (case, request, prefill views, config overrides, expected prefill, expected cached tokens).
# Weights are 1:1 (a cached token = a queued one) unless a case overrides them.
CASES = [
    (
        "no hits: least load",
        REQ,
        [view("p1", waiting_tokens=100), view("p2")],
        {},
        "p2",
        0,
    ),
    (
        "a hit beats a slightly idler worker",
        replace(REQ, prefix_matches=hits(p1=32)),
        [view("p1", in_flight_tokens=300), view("p2")],
        {},
        "p1",
        512,
    ),
    (
        "more leading blocks win",
        replace(REQ, prefix_matches=hits(p1=8, p2=20)),
        [view("p1"), view("p2")],
        {},
        "p2",
        320,
    ),
    (
        "2:1 weights keep affinity up to twice the saving",
        replace(REQ, prefix_matches=hits(p1=32)),
        [view("p1", in_flight_tokens=1100), view("p2", in_flight_tokens=100)],
        {"cache_weight": 2.0},
        "p1",
        512,
    ),
    (
        "load beyond the saving moves the request",
        replace(REQ, prefix_matches=hits(p1=32)),
        [view("p1", in_flight_tokens=700), view("p2", in_flight_tokens=100)],
        {},
        "p2",
        0,
    ),
    (
        "balance threshold beats a heavy cache weight",
        replace(REQ, prefix_matches=hits(p1=32)),
        [view("p1", in_flight_tokens=5000), view("p2", in_flight_tokens=1000)],
        {"cache_weight": 100.0},
        "p2",
        0,
    ),
    (
        "inside the threshold the heavy cache weight keeps affinity",
        replace(REQ, prefix_matches=hits(p1=32)),
        [view("p1", in_flight_tokens=3000), view("p2", in_flight_tokens=1000)],
        {"cache_weight": 100.0},
        "p1",
        512,
    ),
    (
        "cache weight 0 is pure load",
        replace(REQ, prefix_matches=hits(p1=32)),
        [view("p1", in_flight_tokens=10), view("p2")],
        {"cache_weight": 0.0},
        "p2",
        0,
    ),
    (
        "a ghost (old epoch) counts nothing",
        replace(REQ, prefix_matches=(PrefixMatch("p1", 0, 32),)),
        [view("p1", epoch=2, in_flight_tokens=10), view("p2")],
        {},
        "p2",
        0,
    ),
    (
        "an unusable holder is never chosen",
        replace(REQ, prefix_matches=hits(p1=35, p2=1)),
        [view("p1", draining=True), view("p2", in_flight_tokens=50), view("p3", healthy=False)],
        {},
        "p2",
        16,
    ),
    (
        "index unknown (None): load only",
        replace(REQ, prefix_matches=None),
        [view("p1", in_flight_tokens=10), view("p2")],
        {},
        "p2",
        0,
    ),
    (
        "the whole prompt cached still leaves its last token",
        RouteRequest("r", 64, 8, block_hashes=(1, 2, 3, 4), prefix_matches=hits(p1=4)),
        [view("p1"), view("p2")],
        {},
        "p1",
        63,
    ),
    (
        "other routers' queued prompts count; ours are not double counted",
        replace(REQ, prefix_matches=hits(p1=32)),
        [
            view("p1", waiting_tokens=2000, in_flight_prompt_tokens=1800, in_flight_tokens=200),
            view("p2", waiting_tokens=900),
        ],
        {},
        "p1",
        512,
    ),
    (
        "ties go to the address",
        replace(REQ, prefix_matches=hits(p1=10, p2=10)),
        [view("p2"), view("p1")],
        {},
        "p1",
        160,
    ),
]


@pytest.mark.parametrize(
    "case,request_,prefills,overrides,want,cached", CASES, ids=[c[0] for c in CASES]
)
def test_prefill_choice(
    case: str,
    request_: RouteRequest,
    prefills: list[WorkerView],
    overrides: dict[str, float],
    want: str,
    cached: int,
) -> None:
    config = PrefixRoutingConfig(**{"cache_weight": 1.0, **overrides})
    policy = PrefixAwarePolicy(config, clock=Clock())
    decision = policy.choose(request_, prefills, D)
    assert decision is not None and decision.prefill is not None, case
    assert (decision.prefill.address, decision.cached_tokens) == (want, cached), case
    assert decision.decode is not None and decision.decode.address == "d1"


def test_decode_is_load_and_room_based() -> None:
    decodes = [
        view("d1", "decode", free_blocks=10),  # needs ceil(640/16) = 40 blocks
        view("d2", "decode", num_running=3),
        view("d3", "decode", num_running=1, free_blocks=100),
        view("d4", "decode", num_running=1, free_blocks=200),
    ]
    decision = PrefixAwarePolicy().choose(REQ, [view("p1")], decodes)
    assert decision is not None and decision.decode is not None
    assert decision.decode.address == "d4"


def test_no_capacity_is_none() -> None:
    policy = PrefixAwarePolicy()
    assert policy.choose(REQ, [view("p1", healthy=False)], D) is None
    assert policy.choose(REQ, [view("p1")], [view("d1", "decode", free_blocks=1)]) is None
    assert (
        policy.choose(replace(REQ, colocated=True), [view("c1", "colocated", free_blocks=1)], [])
        is None
    )


def test_colocated_uses_hits_among_workers_with_room() -> None:
    req = replace(REQ, colocated=True, prefix_matches=hits(c1=35, c2=20))
    views = [
        view("c1", "colocated", free_blocks=5),
        view("c2", "colocated"),
        view("c3", "colocated"),
    ]
    decision = PrefixAwarePolicy().choose(req, views, [])
    assert decision is not None and decision.colocated is not None
    assert (decision.colocated.address, decision.cached_tokens) == ("c2", 320)


def test_pending_credit_follows_a_burst_then_spreads() -> None:
    """A burst of one prefix before any block is published: the first request goes to the
    idlest worker, the next ones follow it (pending credit) while its extra load stays below
    the saving, then the overflow spreads; the credit expires after pending_ttl_s."""
    clock = Clock()
    policy = PrefixAwarePolicy(PrefixRoutingConfig(cache_weight=1, pending_ttl_s=2.0), clock=clock)
    load = {"p1": 100, "p2": 0}
    picks = []
    for _ in range(12):
        prefills = [view(a, in_flight_tokens=t) for a, t in load.items()]
        decision = policy.choose(REQ, prefills, D)
        assert decision is not None and decision.prefill is not None
        chosen = decision.prefill.address
        picks.append((chosen, decision.cached_tokens))
        load[chosen] += 576 - decision.cached_tokens  # what the router tracks in flight
    # p2 (idlest) computes the prefix; 6 hits follow (16 tokens each) until p2's load is more
    # than the 560 saved tokens above p1's; p1 then takes one cold, and from there both hold
    # the credit and alternate on load.
    assert picks == [("p2", 0)] + [("p2", 560)] * 6 + [("p1", 0)] + [("p2", 560), ("p1", 560)] * 2
    clock.t = 2.5  # the credit expired and the index still says nothing: load decides again
    decision = policy.choose(REQ, [view("p1", in_flight_tokens=5), view("p2")], D)
    assert decision is not None and decision.prefill is not None
    assert (decision.prefill.address, decision.cached_tokens) == ("p2", 0)


def test_pending_prefixes_table() -> None:
    pending = PendingPrefixes(ttl_s=1.0, max_blocks=3)
    pending.add("w", [1, 2, 3], now=0.0)
    assert pending.leading("w", [1, 2, 3, 4], now=0.5) == 3
    assert pending.leading("w", [2, 3], now=0.5) == 2
    assert pending.leading("x", [1], now=0.5) == 0
    pending.add("w", [1, 9], now=0.8)  # refresh 1, add 9: 4 hashes > 3, the oldest (2) goes
    assert pending.leading("w", [1, 2, 3], now=0.9) == 1
    assert pending.leading("w", [1, 9], now=1.5) == 2  # 3 expired, 1 and 9 not yet
    assert pending.leading("w", [1, 9], now=1.8) == 0


def test_defaults_favour_the_cache_four_to_one() -> None:
    assert PrefixRoutingConfig().cache_weight == 4 * PrefixRoutingConfig().load_weight


def test_registered_and_configurable() -> None:
    cfg = PrefixRoutingConfig(cache_weight=2.0)
    policy = make_policy("prefix_aware", cfg)
    assert isinstance(policy, PrefixAwarePolicy) and policy.config == cfg
    assert make_policy("prefix_aware").name == "prefix_aware"
    with pytest.raises(ValueError):
        PrefixRoutingConfig(balance_rel=0.5)


def test_cold_prefixes_spread_over_idle_workers() -> None:
    """Equal scores and loads: the least recently picked worker wins, so new prefixes on an
    idle cluster fill both caches instead of the first worker's only."""
    policy = PrefixAwarePolicy(clock=Clock())
    prefills = [view("p1"), view("p2")]
    picks = []
    for g in range(4):
        req = replace(REQ, block_hashes=tuple(range(100 * g, 100 * g + 35)))
        decision = policy.choose(req, prefills, D)
        assert decision is not None and decision.prefill is not None
        picks.append(decision.prefill.address)
    assert picks == ["p1", "p2", "p1", "p2"]


def test_a_local_prefill_moves_the_pending_credit_to_the_decode_worker() -> None:
    """Hybrid local path: the prompt's blocks land on the decode worker, so the prefill worker
    the policy picked must not keep the credit (a same-prefix request would follow it there
    for nothing); hashes it was credited with before stay."""
    clock = Clock()
    policy = PrefixAwarePolicy(PrefixRoutingConfig(), clock=clock)
    first = policy.choose(replace(REQ, request_id="a"), [view("p1")], D)
    assert first is not None and first.prefill is not None and first.decode is not None
    assert policy.pending.leading("p1", CHAIN, clock.t) == 35
    longer = replace(REQ, request_id="b", block_hashes=(*CHAIN, 99))
    second = policy.choose(longer, [view("p1")], D)
    assert second is not None and second.decode is not None
    policy.prefilled_elsewhere("b", second.decode)
    assert policy.pending.leading("p1", (*CHAIN, 99), clock.t) == 35  # "a"'s credit stays
    assert policy.pending.credited("p1") == 35  # block 99 (only "b"'s) left it
    assert policy.pending.leading("d1", (*CHAIN, 99), clock.t) == 36
    with pytest.raises(AssertionError):  # only right after the choice it corrects
        policy.prefilled_elsewhere("b", second.decode)
