"""Prometheus metrics of one server (its own registry, so several apps can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "ddtree_requests",
            "Generation requests by endpoint and how they were served (ddtree, passthrough, error)",
            ["endpoint", "served_by"],
            registry=registry,
        )
        self.passthroughs = Counter(
            "ddtree_passthroughs",
            "Requests sent to the upstream unchanged, by the field that required it",
            ["reason"],
            registry=registry,
        )
        self.rounds = Counter("ddtree_rounds", "Draft-verify rounds", registry=registry)
        self.generated_tokens = Counter(
            "ddtree_generated_tokens", "Tokens emitted by DDTree-served requests", registry=registry
        )
        self.acceptance_length = Histogram(
            "ddtree_acceptance_length",
            "Tokens committed per round (accepted draft tokens + 1 bonus token)",
            buckets=_ACCEPTANCE_BUCKETS,
            registry=registry,
        )
        self.draft_seconds = Histogram(
            "ddtree_draft_seconds",
            "Per round: drafting plus tree building",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.verify_seconds = Histogram(
            "ddtree_verify_seconds",
            "Per round: verifying the tree on the target",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.upstream_calls = Counter(
            "ddtree_upstream_calls", "Verification calls made to the upstream", registry=registry
        )
        self.upstream_errors = Counter(
            "ddtree_upstream_errors",
            "Upstream failures seen by clients, by kind (timeout, connect, network, http, malformed)",
            ["kind"],
            registry=registry,
        )
        self.upstream_retries = Counter(
            "ddtree_upstream_retries",
            "Idempotent upstream calls retried, by the failure that caused the retry",
            ["kind"],
            registry=registry,
        )
        self.rejected = Counter(
            "ddtree_rejected",
            "Requests refused before serving, by reason (queue_full, body_too_large)",
            ["reason"],
            registry=registry,
        )
        self.deadline_exceeded = Counter(
            "ddtree_deadline_exceeded",
            "Generation requests cut by the per-request deadline",
            registry=registry,
        )
        self.client_disconnects = Counter(
            "ddtree_client_disconnects",
            "Streams whose client went away before the end (generation stopped)",
            registry=registry,
        )
        self.active = Gauge(
            "ddtree_active_requests", "Generation requests being served", registry=registry
        )
        self.queued = Gauge(
            "ddtree_queued_requests", "Generation requests waiting for a slot", registry=registry
        )
