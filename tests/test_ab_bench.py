"""benchmarks.ab's figures: the interleaved ratio, the report and the shadow compared
with it, the Markdown that says whether each lies within the issue's bounds."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from benchmarks.ab import SERVING_BUDGET, SHADOW_DRAFTER, arm_rounds, compare, markdown
from proxy.ab.measure import ABMetrics, RequestTiming
from proxy.adaptive.policy import Policy
from proxy.round import RoundStats
from proxy.server.metrics import PolicyCollector


def _answer(ratio: list[float] | None, predicted: float | None) -> dict:
    arms = {"ddtree": {"requests": 61}, "direct": {"requests": 59}}
    shadow = [{"drafter": SHADOW_DRAFTER, "budget": SERVING_BUDGET, "requests": 59,
               "rounds": 700, "tau": 3.1, "predicted_ratio": predicted, "speculated_share": 0.5,
               "speculated_nodes": 7.5,
               "cost_source": "ddtree arm's rounds"},
              {"drafter": SHADOW_DRAFTER, "budget": 4, "requests": 59, "rounds": 900,
               "tau": 2.5, "predicted_ratio": None, "cost_source": "-"}]  # fmt: skip
    return {"windows": {"since_start": {"arms": arms, "tokens_per_s_ratio": ratio}},
            "shadow": shadow, "verdict": "DDTree ..."}  # fmt: skip


def test_the_report_is_compared_with_the_interleaved_ratio_of_medians():
    per_request = {"direct": [10.0, 10.0, 20.0, 20.0, 30.0], "ddtree": [15.0, 30.0, 30.0, 45.0, 60.0]}
    cell = compare(per_request, [1.4, 1.6, 1.5], _answer([1.65, 1.4, 1.9], 1.2))
    assert cell["interleaved"]["ratio_of_medians"] == pytest.approx(1.5)
    assert cell["interleaved"]["per_rep_ratio"] == pytest.approx(1.5)
    assert cell["report_vs_interleaved"] == pytest.approx(1.1)
    assert cell["shadow_vs_report"] == pytest.approx(1.2 / 1.65)
    assert cell["split"]["requests"] == {"ddtree": 61, "direct": 59}
    cost = {"clients": {"1": {"plain_tokens_per_s": [100.0, 90.0], "shadow_tokens_per_s":
                              [99.0, 88.0], "shadow_vs_plain": 0.98,
                              "shadow_vs_plain_interval": (0.97, 0.99), "sampled": 50,
                              "replayed": 48, "dropped": 2}},
            "64_clients": {"requests_per_round": 128, "rss_mb": [300.0, 310.0],
                           "dropped_total": [2, 90]}}  # fmt: skip
    arm = {"rounds": 500, "mean_nodes": 7.25, "tau": 3.4, "policy_estimates": {}}
    table = markdown({"shadow_cost": cost,
                      "report_vs_measured": [{"upstream": "gpu-sim", **cell, "ddtree_arm": arm}]})  # fmt: skip
    assert "| 1 | 95.0 | 93.5 | 0.98 [0.97, 0.99] | 48 / 50 (96%) | 2 |" in table
    assert "1.10 (within 10%)" in table and "0.73 (outside 15%)" in table
    assert "300 -> 310 MB" in table and "1 rounds of 128" in table
    assert "| 3.10 / 0.50 / 7.50 | 3.40 / 7.25 |" in table  # the shadow's, the arm's rounds


def test_the_arms_rounds_and_the_policys_estimates_are_read_from_metrics():
    registry = CollectorRegistry()
    metrics = ABMetrics(registry, "m", max_model_len=2048)
    policy = Policy(clock=lambda: 0.0)
    policy.calls.observe(5, 20, 0.05)
    registry.register(PolicyCollector(policy))
    timing = RequestTiming("ddtree", lambda: 0.0)
    for num_tokens, num_nodes in ((3, 8), (1, 8), (2, 4)):  # 3 rounds, 20 nodes, 3 accepted
        timing.round(RoundStats(num_tokens, num_nodes, 0.0, 0.0, 0.01, 1, 9))
        timing.tokens(num_tokens)
    metrics.observe(timing, timing.record())
    direct = RequestTiming("direct", lambda: 0.0)
    direct.tokens(4)
    metrics.observe(direct, direct.record())
    arm = arm_rounds(generate_latest(registry).decode())
    assert (arm["rounds"], arm["mean_nodes"], arm["tau"]) == (3, 20 / 3, 2.0)
    assert arm["policy_estimates"]["call_s"] > 0 and "plain_per_token_s" in arm["policy_estimates"]


def test_no_ratio_in_the_report_compares_nothing():
    cell = compare({"direct": [1.0], "ddtree": [1.0]}, [1.0, 1.0], _answer(None, 1.3))
    assert cell["report_vs_interleaved"] is None and cell["shadow_vs_report"] is None
