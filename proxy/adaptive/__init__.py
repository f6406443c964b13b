"""Adaptive speculation: per step of a request, verify some of the drafted tree's nodes
or let the target generate on its own, whichever is expected to give more tokens per
second (docs/POLICY.md).

* `estimates` -- what is measured while serving (call costs, plain generation's cost,
  the drafter's calibration), every estimate fading with one half-life.
* `policy` -- the rule: `Policy` (shared by a runtime's requests) and its per-request
  `RequestPolicy.decide` / `record`.
"""
