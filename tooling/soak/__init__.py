"""`pdserve soak`: a seeded chaos soak of a whole cluster (product tooling, soak process).

It starts its own cluster (redis-server, workers through a product launcher, the router in this
process), computes every request's reference output with the colocated engine, sends an
open-loop mixed load over the public gRPC API while it kills, freezes and restarts workers and
Redis and stalls KV transfers, then checks every request and the cluster and writes soak.json,
a Markdown report and a timeline plot. Modules: `config`, `workload` (the seeded plan),
`reference`, `cluster`, `client`, `faults`, `check`, `report`, `run` (`run_soak`).
"""
