"""The worker process: one model + paged KV cache, driven by one engine thread, served over gRPC.

Start one with ``python -m worker_main --model DIR --role prefill|decode|colocated``
(`worker_main`, the composition root above this package and the role packages: it holds the
role table `ROLES` and calls `worker.cli.main`); launchers (`deploy.launcher`,
`deploy.ray_launcher`) do that, or build a `WorkerServer` in process (`worker_main.server`).

Layers (imports go downwards only):

- `worker_main`          composition root: the role table, the entry point
- role packages          `prefill_worker` (prefill), `decode_worker` (decode's Reserve +
                         Decode), `colocated_worker` (Generate)
- host core (this package, role-agnostic; never imports a role package):
  - `server`             loads the model, plugs in the roles it is given, starts the engine
                         thread and the grpc.aio server; `cli` parses the command line
  - `roles`              the `RoleHandler` contract every role implements (typed entry points
                         listed in an `Rpc` table), and `RoleContext`
  - `composite`          `compose`: one role made of parts (the "decode" role)
  - `engine_thread`      the single owner of model, KV cache and transport; commands, drain,
                         role switch, status snapshot
  - `service`            the grpc.aio `pdserve.v1.Worker` servicer + health
  - `sinks`              thread-safe hand-off of answers from the engine thread to the loop
  - `kv_events`          block-pool events streamed to the router's prefix indexer
  - `convert`            proto <-> runtime types (tickets, sampling params)
  - `config`             `WorkerConfig` (torch-free); `process` spawns a worker as a child
"""
