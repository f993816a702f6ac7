"""How fast the planner's simulator runs: one fixed split of a representative at-scale scenario
on the H100 profile, wall time and microseconds per simulated token, and the attainment it
predicts (so two simulators can be compared side by side on the same scenario).

    PYTHONPATH=. python -m benchmarks.sim_speed chat1000 [--step-by-step]

Scenarios: `chat1000` (1000 chat@8192 requests at 104 req/s on 2:6), `stat16` (`stationary`
at 16 workers cut to 20 s, 3:13), `shift8` (`shifting` at 8 workers, each phase cut to 20 s,
6:2). To time another simulator (e.g. the re-implementation before issue 31), run this file
with PYTHONPATH pointing at that tree (`git archive 8c7a822^ | tar -x -C /tmp/old`;
`--step-by-step` needs a tree with `Sim(fast=...)`). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from dataclasses import replace

from tooling.planner.profiles import load_profile
from tooling.planner.scale import CONTEXT, ScaleSetup, base_spec
from tooling.planner.sim import Sim, SimRequest, attainment
from tooling.planner.sim_types import ClusterSpec
from tooling.planner.workload import requests, shifting, to_sim

PROFILE = "deploy/profiles/h100-llama3-8b.json"


def scenario(name: str) -> tuple[list[SimRequest], ClusterSpec]:
    prof = load_profile(PROFILE)
    if name == "chat1000":
        return to_sim(requests("chat", 1000, 13.0 * 8, 8192, seed=0)), replace(
            base_spec(prof, 8), prefill=2, decode=6
        )
    workers, builtin, split = {
        "stat16": (16, "stationary", (3, 13)),
        "shift8": (8, "shifting", (6, 2)),
    }[name]
    phases = [(w, r, 20.0) for w, r, _ in ScaleSetup(prof, workers, builtin).phases()]
    spec = replace(base_spec(prof, workers), prefill=split[0], decode=split[1])
    return to_sim(shifting(phases, CONTEXT, 0)), spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scenario", choices=["chat1000", "stat16", "shift8"])
    ap.add_argument("--step-by-step", action="store_true", help="Sim(fast=False)")
    args = ap.parse_args()
    reqs, spec = scenario(args.scenario)
    cost = load_profile(PROFILE).cost(1)
    t0 = time.perf_counter()
    if args.step_by_step:
        if "fast" not in inspect.signature(Sim).parameters:
            raise SystemExit("this simulator has no step-by-step switch")
        sim = Sim(reqs, spec, cost, fast=False)
    else:
        sim = Sim(reqs, spec, cost)
    outs = sim.run()
    wall = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "scenario": args.scenario,
                "step_by_step": args.step_by_step,
                "requests": len(reqs),
                "tokens": sim.tokens,
                "wall_s": round(wall, 2),
                "us_per_token": round(wall / max(1, sim.tokens) * 1e6, 2),
                "attainment": attainment(outs, 1.5, 0.05),
            }
        )
    )


if __name__ == "__main__":
    main()
