"""Prefill role of a worker process: batch prompts, push their KV to decode workers layer by
layer, answer with the first token. The process around it (engine thread, gRPC service) is
shared with the other roles and lives in `decode_worker`."""
