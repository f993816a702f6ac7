"""The routing-policy registry: name -> implementation (router process).

Kept apart from the seam (`router.policy`) so that the interface module imports no
implementation and no module imports another lazily to dodge a loop. `RouterConfig.policy`
and `pdserve up`/`python -m router --policy` accept exactly these names.
"""

from __future__ import annotations

from collections.abc import Callable

from router.pair_scoring import PairScoringConfig
from router.policy import LeastLoadPolicy, RoundRobinPolicy, RoutingPolicy
from router.prefix_policy import PrefixAwarePolicy, PrefixRoutingConfig

POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    RoundRobinPolicy.name: RoundRobinPolicy,
    LeastLoadPolicy.name: LeastLoadPolicy,
    PrefixAwarePolicy.name: PrefixAwarePolicy,
}
"""Policy registry: name -> factory with default weights."""


def make_policy(
    name: str,
    prefix: PrefixRoutingConfig | None = None,
    pair: PairScoringConfig | None = None,
) -> RoutingPolicy:
    """Build the policy registered as `name` (`prefix`: the weights of "prefix_aware";
    `pair`: how "least_load" and "prefix_aware" price a pair's KV move across nodes);
    ValueError lists the known names."""
    if name == PrefixAwarePolicy.name and (prefix is not None or pair is not None):
        return PrefixAwarePolicy(prefix, pair=pair)
    if name == LeastLoadPolicy.name and pair is not None:
        return LeastLoadPolicy(pair)
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}") from None
