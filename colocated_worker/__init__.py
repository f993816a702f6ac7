"""The colocated role of a worker process: `Generate` runs a request's prefill and decode on
this worker's own engine, with continuous batching and chunked prefill.

`colocated.ColocatedRole` is the baseline every disaggregated run is compared against, and the
local-prefill half of the decode worker's role (`worker_main.ROLES["decode"]`: a decode worker
also prefills the requests the router sends it as `Generate`, `router.hybrid`). It plugs into
the worker host (`worker`: engine thread, gRPC service, role switch, `python -m worker_main`)
and depends on it; it never imports `prefill_worker` or `decode_worker`.
"""
