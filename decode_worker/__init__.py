"""Decode role of a worker process, plus the pieces every worker process shares.

A worker process is one model + KV cache owned by one engine thread (`engine_thread`) and a
grpc.aio `Worker` service on an asyncio loop (`service`); they meet through thread-safe sinks
(`sinks`). The role decides which RPCs are served: `decode.DecodeRole` (Reserve + Decode),
`colocated.ColocatedRole` (Generate) and `prefill_worker.prefill.PrefillRole` (Prefill). The
shared pieces live here because the decode worker is the streaming one; a process can switch
between all three roles without reloading weights.
"""
