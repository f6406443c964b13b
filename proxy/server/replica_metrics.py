"""/metrics of several upstream replicas (`proxy.backend.replicas.ReplicaSet`), read at
scrape time: each replica's state, requests, calls, failures, ejections, vLLM's
prefix-cache hit ratio as last read from its own /metrics, and the adaptive policy's
estimates for it (one set per replica)."""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from proxy.adaptive.policy import Policy
from proxy.backend.replicas import ReplicaSet


class ReplicasCollector:
    def __init__(self, replicas: ReplicaSet, policy: Policy):
        self._replicas = replicas
        self._policy = policy

    def collect(self) -> Iterator[Metric]:
        replicas = self._replicas.replicas
        labels = ["replica"]
        up = GaugeMetricFamily(
            "ddtree_replica_up", "1 while the replica is admitted, 0 while ejected", labels=labels
        )
        in_flight = GaugeMetricFamily(
            "ddtree_replica_in_flight", "Requests pinned to the replica now", labels=labels
        )
        requests = CounterMetricFamily(
            "ddtree_replica_requests",
            "Requests pinned to the replica (a request moved by a failover counts on both)",
            labels=labels,
        )
        calls = CounterMetricFamily(
            "ddtree_replica_calls",
            "Calls made to the replica, by path (verification and plain generation: "
            "/v1/completions)",
            labels=["replica", "path"],
        )
        errors = CounterMetricFamily(
            "ddtree_replica_errors",
            "Failed calls (after their retries) and failed health checks of the replica",
            labels=labels,
        )
        ejections = CounterMetricFamily(
            "ddtree_replica_ejections", "Times the replica was ejected", labels=labels
        )
        readmissions = CounterMetricFamily(
            "ddtree_replica_readmissions",
            "Times an ejected replica passed its health check and was re-admitted",
            labels=labels,
        )
        hit_ratio = GaugeMetricFamily(
            "ddtree_replica_prefix_cache_hit_ratio",
            "vLLM's prefix-cache hits over queries (tokens) on the replica since it started, "
            "as last read from its /metrics",
            labels=labels,
        )
        estimates = GaugeMetricFamily(
            "ddtree_replica_policy_estimate",
            "The adaptive policy's estimates for requests on the replica (seconds; the "
            "names of ddtree_policy_estimate)",
            labels=["replica", "name"],
        )
        decisions = CounterMetricFamily(
            "ddtree_replica_policy_decisions",
            "Adaptive policy decisions for requests on the replica, by decision and reason "
            "(as ddtree_policy_decisions)",
            labels=["replica", "decision", "reason"],
        )
        for replica in replicas:
            status = replica.status()
            url = replica.url
            up.add_metric([url], float(replica.admitted))
            in_flight.add_metric([url], replica.in_flight)
            requests.add_metric([url], replica.requests)
            for path, count in sorted(status["calls"].items()):
                calls.add_metric([url, path], count)
            errors.add_metric([url], replica.errors)
            ejections.add_metric([url], replica.ejections)
            readmissions.add_metric([url], replica.readmissions)
            if status["prefix_cache_hit_ratio"] is not None:
                hit_ratio.add_metric([url], status["prefix_cache_hit_ratio"])
            policy = self._policy.replicas.get(url)
            if policy is not None:
                snapshot = policy.snapshot()
                for name, value in snapshot.items():
                    if isinstance(value, float):
                        estimates.add_metric([url, name], value)
                for (kind, reason), count in sorted(snapshot["decisions"].items()):
                    decisions.add_metric([url, kind, reason], count)
        yield from (up, in_flight, requests, calls, errors, ejections, readmissions, hit_ratio,
                    estimates, decisions)  # fmt: skip
