"""Goodput benchmark: load generation, SLO attainment and goodput analysis, reports.

Runs in two processes. The *orchestrator* (`pdserve bench`, `pdserve demo`, tests) measures the
machine, starts clusters, calibrates SLOs, plans a rate sweep and writes the report. The *load
generator* (`python -m tooling.goodput.loadgen`) is a separate process that speaks only the
public gRPC API and sends requests at their scheduled times.

Modules, from data to report:

- `records`: the data contracts (`RequestSpec` in, `RequestRecord` and `RunResult` out), JSON;
- `arrivals`: Poisson and gamma-bursty arrival times, seeded;
- `workloads`: the synthetic length distributions (chat, code, summarize, prefix, multiturn);
- `traces`: trace files (CSV / JSONL) and prompt token synthesis from a trace row;
- `loadgen`: the async load generator (its own process) and the helpers that start it;
- `analysis`: SLOs, attainment, goodput, percentiles, tightest SLO scale;
- `sweep`: max goodput from tested rates (the one rule every goodput tool uses, non-monotone
  points named) and the rate search that picks them, repeat by repeat on trace seeds,
  interleaved across configurations;
- `repeats`: max goodput over repeats: bounds, median and range, ratios paired by seed;
- `clusters`: the compared configurations (colocated, colocated-nochunk, disagg, hybrid);
- `bench`: the orchestrator; `report` and `plots`: Markdown, JSON and PNG output.
"""
