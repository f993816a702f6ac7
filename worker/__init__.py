"""The worker process: one model + paged KV cache, driven by one engine thread, served over gRPC.

Start one with ``python -m worker --model DIR --role prefill|decode|colocated`` (`worker.cli`);
launchers (`deploy.launcher`, `deploy.ray_launcher`) do that, or build `WorkerServer` in process.

Layers (imports go downwards only):

- `worker.server`        composition root: loads the model, plugs the roles in (`ROLES`), starts
                         the engine thread and the grpc.aio server; `cli` / `__main__` wrap it
- role packages          `prefill_worker` (prefill), `decode_worker` (decode, colocated)
- host core (this package, role-agnostic):
  - `roles`              the `Role` contract every role implements, and `RoleContext`
  - `engine_thread`      the single owner of model, KV cache and transport; commands, drain,
                         role switch, status snapshot
  - `service`            the grpc.aio `pdserve.v1.Worker` servicer + health
  - `sinks`              thread-safe hand-off of answers from the engine thread to the loop
  - `kv_events`          block-pool events streamed to the router's prefix indexer
  - `convert`            proto <-> runtime types (tickets, sampling params)
  - `config`             `WorkerConfig` (torch-free); `process` spawns a worker as a child
"""
