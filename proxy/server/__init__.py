"""The OpenAI-compatible HTTP layer.

| module | holds |
|---|---|
| `app` | the FastAPI app, routes, API-key guard, `ddtree-proxy serve` |
| `handlers` | what each route does: serve with DDTree, pass through, refuse |
| `generation` | a planned request through the decoding loop: JSON body or SSE stream |
| `plan` | from a validated request to a `GenerationRequest` (tokenize, limits, tree) |
| `request_models` | request bodies, which fields DDTree serves and which pass through |
| `responses` | response bodies, stream chunks, `usage` (with `usage.ddtree`) |
| `passthrough` | relaying a request to vLLM unchanged |
| `relayed` | a handed-over request's answer: vLLM's events relayed, their token ids counted |
| `errors` | OpenAI-style errors, and the client's view of an upstream failure |
| `admission` | the admission queue (429) and streams that hold their slot |
| `metrics` | Prometheus metrics |
| `ab` | the A/B split over HTTP: arm header, timing each answer, shadow sampling, admin and report routes |
| `settings` | `ServerSettings` (CLI flags and DDTREE_* variables) |

Nothing is imported here: the command line reads `settings` without loading the HTTP
server.
"""
