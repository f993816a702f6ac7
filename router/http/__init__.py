"""The OpenAI-compatible HTTP front of the router. Runs in the router process, on its loop.

Every request takes the router's one request path (`router.lifecycle.RequestLifecycle`), the
same as the gRPC `Generate`: this package only speaks OpenAI's shapes on top of it.

- `protocol`      pydantic request/response schemas (strict, closed: unknown fields -> 400)
- `translate`     OpenAI request -> `GenerateRequest` (defaults, refusals, chat rendering)
- `chat_template` the model folder's Jinja2 chat template, rendered as Hugging Face does
- `responses`     `GenerateResponse` stream -> completion / chat objects and SSE chunks
- `errors`        OpenAI error objects, the HTTP status of each gRPC status
- `handlers`      the aiohttp handlers (completions, chat, models, health, metrics)
- `server`        the app, its middlewares (authentication hooks in here) and its server
"""
