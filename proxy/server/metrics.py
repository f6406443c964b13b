"""Prometheus metrics of one server (its own registry, so several apps can share a process)."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from proxy.adaptive.policy import Policy
from proxy.round import RoundStats

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
_ACCEPTANCE_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 64)


def _counter(registry: CollectorRegistry, name: str, documentation: str, *labels: str) -> Counter:
    return Counter(name, documentation, list(labels), registry=registry)


def _latency(name: str, documentation: str, registry: CollectorRegistry) -> Histogram:
    return Histogram(name, documentation, buckets=_LATENCY_BUCKETS, registry=registry)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = _counter(
            registry,
            "ddtree_requests",
            "Generation requests by endpoint and how they were served (ddtree, passthrough, error)",
            "endpoint",
            "served_by",
        )
        self.passthroughs = _counter(
            registry,
            "ddtree_passthroughs",
            "Requests sent to the upstream unchanged, by the field that required it",
            "reason",
        )
        self.relayed = _counter(
            registry,
            "ddtree_relayed",
            "Requests to vLLM's other routes (not generation), relayed as they are, by method",
            "method",
        )
        self.handed_over = _counter(
            registry,
            "ddtree_handed_over",
            "Streaming requests the policy left to vLLM from their first token, relayed as "
            "vLLM sent them, by outcome: whole; resumed (the answer broke, the loop went on "
            "from its tokens); unopened (no answer came, the loop served the request)",
            "outcome",
        )
        self.rounds = _counter(registry, "ddtree_rounds", "Draft-verify rounds")
        self.generated_tokens = _counter(
            registry, "ddtree_generated_tokens", "Tokens emitted by DDTree-served requests"
        )
        self.acceptance_length = Histogram(
            "ddtree_acceptance_length",
            "Tokens committed per round (accepted draft tokens + 1 bonus token)",
            buckets=_ACCEPTANCE_BUCKETS,
            registry=registry,
        )
        self.draft_seconds = _latency(
            "ddtree_draft_seconds", "Per round: drafting plus tree building", registry
        )
        self.verify_seconds = _latency(
            "ddtree_verify_seconds", "Per round: verifying the tree on the target", registry
        )
        self.upstream_calls = _counter(
            registry, "ddtree_upstream_calls", "Verification calls made to the upstream"
        )
        self.upstream_errors = _counter(
            registry,
            "ddtree_upstream_errors",
            "Upstream failures seen by clients, by kind (timeout, connect, network, http, malformed)",
            "kind",
        )
        self.upstream_retries = _counter(
            registry,
            "ddtree_upstream_retries",
            "Idempotent upstream calls retried, by the failure that caused the retry",
            "kind",
        )
        self.rejected = _counter(
            registry,
            "ddtree_rejected",
            "Requests refused before serving, by reason (queue_full, body_too_large)",
            "reason",
        )
        self.deadline_exceeded = _counter(
            registry,
            "ddtree_deadline_exceeded",
            "Generation requests cut by the per-request deadline",
        )
        self.client_disconnects = _counter(
            registry,
            "ddtree_client_disconnects",
            "Streams whose client went away before the end (generation stopped)",
        )
        self.plain_tokens = _counter(
            registry,
            "ddtree_plain_tokens",
            "Tokens from plain generation: the adaptive policy's fallback to the target alone",
        )
        self.plain_streams = _counter(
            registry, "ddtree_plain_streams", "Plain-generation streams opened upstream"
        )
        self.switches = _counter(
            registry,
            "ddtree_policy_switches",
            "Adaptive policy switches, by direction (to_plain, to_speculation)",
            "direction",
        )
        self._to_plain = self.switches.labels("to_plain")
        self._to_speculation = self.switches.labels("to_speculation")
        self.tree_nodes = Histogram(
            "ddtree_tree_nodes",
            "Per round: tree nodes verified (the adaptive policy's choice, up to the budget)",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=registry,
        )
        self.active = Gauge(
            "ddtree_active_requests", "Generation requests being served", registry=registry
        )
        self.queued = Gauge(
            "ddtree_queued_requests", "Generation requests waiting for a slot", registry=registry
        )

    def observe(self, stats: RoundStats, num_tokens: int) -> None:
        """One step of a generation: a verified round, or a piece of plain generation
        (one per streamed event: only what changed is touched)."""
        self.generated_tokens.inc(num_tokens)
        if stats.switches_to_plain:
            self._to_plain.inc(stats.switches_to_plain)
        if stats.switches_to_speculation:
            self._to_speculation.inc(stats.switches_to_speculation)
        if stats.kind == "plain":
            self.plain_tokens.inc(stats.num_tokens)
            if stats.upstream_calls:
                self.plain_streams.inc(stats.upstream_calls)
            return
        self.upstream_calls.inc(stats.upstream_calls)
        self.rounds.inc()
        self.acceptance_length.observe(stats.num_tokens)
        self.tree_nodes.observe(stats.num_nodes)
        self.draft_seconds.observe(stats.draft_s + stats.tree_s)
        self.verify_seconds.observe(stats.verify_s)

class PolicyCollector:
    """What the adaptive policy (`proxy.adaptive.policy.Policy`) has decided and learnt,
    read at scrape time: decisions by kind and reason, its estimates, the calibration."""

    def __init__(self, policy: Policy):
        self._policy = policy

    def collect(self) -> Iterator[Metric]:
        snapshot = self._policy.snapshot()
        decisions = CounterMetricFamily(
            "ddtree_policy_decisions",
            "Adaptive policy decisions, by decision (speculate, plain) and reason",
            labels=["decision", "reason"],
        )
        for (kind, reason), count in sorted(snapshot["decisions"].items()):
            decisions.add_metric([kind, reason], count)
        yield decisions
        estimates = GaugeMetricFamily(
            "ddtree_policy_estimate",
            "The policy's estimates (seconds): verification call = call_s + "
            "call_per_prompt_s * prompts + call_per_token_s * computed tokens; round_overhead_s "
            "= host time per round outside the call; plain stretch = plain_opening_s + "
            "plain_per_token_s * tokens at the present load (plain_per_load_s more per token "
            "per request in flight more)",
            labels=["name"],
        )
        for name, value in snapshot.items():
            if isinstance(value, float):
                estimates.add_metric([name], value)
        yield estimates
        calibration = GaugeMetricFamily(
            "ddtree_drafter_calibration",
            "The drafter's calibration: observed acceptance of a drafted token whose "
            "conditional draft probability is at most edge_probability (and above the next "
            "bin's), from verified and shadow rounds",
            labels=["edge_probability"],
        )
        for upper, rate, _weight in snapshot["calibration"]:
            calibration.add_metric([f"{upper:.3g}"], rate)
        yield calibration


class DrafterCollector:
    """A served drafter's own totals (`proxy.drafter.base.Drafter.counters`), read
    at scrape time: draft calls, and rounds that went on without a draft by cause."""

    def __init__(self, counters: Callable[[], dict[str, Any]]):
        self._counters = counters

    def collect(self) -> Iterator[Metric]:
        totals = self._counters()
        yield CounterMetricFamily(
            "ddtree_draft_calls", "Calls made to the draft server", value=totals["calls"]
        )
        failures = CounterMetricFamily(
            "ddtree_draft_failures",
            "Rounds that went on without a draft (the request unaffected), by cause: "
            "timeout, connect, network, http, malformed, unavailable (backing off), context",
            labels=["kind"],
        )
        for kind, count in sorted(totals["failures"].items()):
            failures.add_metric([kind], count)
        yield failures


# The upstream's auxiliary routes: tokenization, not generation.
AUX_PATHS = ("/tokenize", "/detokenize")


class UpstreamCallsCollector:
    """Calls to the upstream's auxiliary routes (`VLLMHttp.num_calls`), read at scrape
    time: /tokenize renders chat prompts (one call per chat request); /detokenize stays
    at 0 while the proxy decodes text with a local tokenizer."""

    def __init__(self, num_calls: Mapping[str, int]):
        self._num_calls = num_calls

    def collect(self) -> Iterator[Metric]:
        calls = CounterMetricFamily(
            "ddtree_upstream_aux_calls",
            "Auxiliary calls to the upstream (tokenization), by path: /tokenize for chat "
            "prompts, /detokenize only where no tokenizer file is on the proxy's host",
            labels=["path"],
        )
        for path in AUX_PATHS:
            calls.add_metric([path], self._num_calls.get(path, 0))
        yield calls
