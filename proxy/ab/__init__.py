"""A/B evaluation: does DDTree pay on this deployment and this traffic?

| module | holds |
|---|---|
| `settings` | `ABSettings`: the split, the guardrail, the report window, the shadow |
| `split` | which arm a request goes to (a client key's hash, or chance) |
| `measure` | what a client feels, per request and arm: records and Prometheus metrics |
| `report` | per-arm figures with bootstrap intervals, the ratio, the verdict |
| `shadow` | replaying directly answered outputs through other drafters and budgets |

The HTTP side (arm header, admin and report routes) is `proxy.server.ab`.
"""
