"""The decode role, and the colocated role, of a worker process.

`decode.DecodeRole` serves `Reserve` (take KV blocks, expect a transfer) and `Decode`
(admit a prefilled request into continuous batching once its KV has landed, stream tokens).
`colocated.ColocatedRole` serves `Generate` (prefill and decode on this one worker, with
chunked prefill: the baseline every disaggregated run is compared against). `hybrid.
HybridDecodeRole` is the worker's "decode" role: both of them on one engine, so a decode worker
also prefills the requests the router sends it as `Generate` (conditional disaggregation,
`router.hybrid`). All plug into the worker host (`worker`: engine thread, gRPC service, role
switch, `python -m worker_main`) and depend on it; they never import `prefill_worker`.
"""
