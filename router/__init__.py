"""pdserve router: the cluster's front door (public `Inference` gRPC API and OpenAI HTTP API).

Runs in the router process only. It validates and tokenizes requests, admits them into a bounded
queue, picks workers with a routing policy, runs the prefill -> decode hand-off (or a colocated
worker's `Generate`) and streams tokens back. It must never import torch: only the torch-free
parts of `model_runtime` (config, tokenizer, hashing, sampling params) are used here.

Module map:

- `config`      `RouterConfig` (pydantic, frozen)
- `validation`  `GenerateRequest` -> `ValidatedRequest` or `RequestValidationError`
- `policy`      `RoutingPolicy` seam, `WorkerView`, round-robin and least-load policies
- `prefix_policy` the prefix-cache-aware policy (cached tokens vs queued work, balance
                threshold, pending credit) and its weights
- `prefix_index` block hash -> workers holding it: seam, in-memory and Redis indexes, circuit
                breaker, timeouts and counters (`guard`)
- `indexer`     one task per prefill/colocated worker applying its KV events to the index
- `kv_source`   the workers' `StreamKVEvents` / `GetKVSnapshot` RPCs as an event source
- `registry`    `WorkerRegistry` seam (membership + last status) and its in-memory version
- `pool`        channels/stubs to workers, the status poller, router-side in-flight counts
- `admission`   bounded FIFO admission (max_inflight running, max_queued waiting)
- `textstream`  text deltas with stop-string matching
- `errors`      `RouterError` (a request's final status) and worker-error mapping
- `lifecycle`   the one request path both edges call: admit -> validate -> flow -> status,
                cleanup aborts, outcome hooks
- `flow`        one request's legs: routing, retries before the first token, migration to
                another worker after a mid-stream failure, cleanup aborts
- `leg`         `Leg`: one attempt's worker calls (Reserve/Prefill/Decode or colocated
                Generate), holders and timings, and how their failures are classified
                (retryable, migratable, final)
- `client_stream` what the client sees: tokens -> text deltas (+ logprobs), the final info
- `ratio`       prefill:decode ratio controller (config, metric windows, pure `decide`, the
                hybrid threshold's control, the driver task, the `SetRole` actuator); fed by
                `server`'s outcome hook
- `auth`        the public API's TLS port, bearer-token interceptor and token-file watcher,
                and the HTTP front's rules
- `server`      the `Inference` gRPC servicer (a thin edge over `lifecycle`)
- `http`        the OpenAI-compatible HTTP edge (aiohttp on the same loop)
- `app`         wires everything (`start_router`, and the
                ratio controller when `config.ratio.mode` is not 'fixed')
"""
