"""The decode half of disaggregated serving, in a worker process.

`decode.RemoteDecodeRole` serves `Reserve` (take KV blocks, expect a transfer) and `Decode`
(admit a prefilled request into continuous batching once its KV has landed, stream tokens) for
requests whose prompt a prefill worker ran. The worker's "decode" role
(`worker_main.ROLES["decode"]`) composes it with `colocated_worker.ColocatedRole`, so a decode
worker also prefills the requests the router sends it as `Generate` (conditional
disaggregation, `router.hybrid`). It plugs into the worker host (`worker`: engine thread, gRPC
service, role switch, `python -m worker_main`) and depends on it; it never imports
`prefill_worker` or `colocated_worker`.
"""
