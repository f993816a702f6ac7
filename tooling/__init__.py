"""Product tooling behind `pdserve bench / demo / report / profile / plan`: load generation,
goodput analysis, reports and plots (`goodput/`), the cost model, simulator and planner
(`planner/`), machine measurements (`machine`) and a real `redis-server` process
(`redis_server`). Runs in the CLI's process and in the processes it starts; it never imports
`benchmarks/` or `tests/`, and the serving path (router, workers) never imports it."""
