"""The prefill role of a worker process: batch prompts under a token budget (chunked prefill,
local prefix reuse), push each layer's KV to the decode worker as soon as that layer is done,
answer with the first token.

`prefill.PrefillRole` plugs into the worker host (`worker`: engine thread, gRPC service, role
switch, `python -m worker_main`) and depends on it; it never imports `decode_worker`.
"""
