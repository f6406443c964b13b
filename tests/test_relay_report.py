"""benchmarks.relay's report logic: medians over repetitions, ratios within each
repetition (the configurations of one repetition run back to back), the Markdown."""

from __future__ import annotations

import pytest

from benchmarks.relay import CONFIGS, markdown, summarize, summarize_bench_serve


def _run(tokens_per_s: float, steps: float = 100, calls: float = 0, cpu: float = 0.5) -> dict:
    return {"tokens_per_s": tokens_per_s, "engine_steps": steps, "aux_calls": calls,
            "proxy_cpu_ms_per_token": cpu}  # fmt: skip


def test_ratios_are_medians_of_within_repetition_ratios():
    # Repetition 2 is slow for every configuration (a busy machine): the within-rep
    # ratios stay 0.5 and 0.9, where ratios of medians would not.
    runs = {
        "direct": [_run(100), _run(10), _run(110)],
        "passthrough": [_run(90), _run(9), _run(99)],
        "default": [_run(81), _run(8.1), _run(89.1, steps=300, calls=4, cpu=1.25)],
    }
    rows = {row["config"]: row for row in summarize({"clients": 4, "client": "stream", "prompts": "random"}, runs)}
    assert set(rows) == set(CONFIGS)
    assert rows["direct"]["tokens_per_s"] == 100 and rows["direct"]["vs_direct"] == 1
    assert rows["default"]["vs_passthrough"] == pytest.approx(0.9)
    assert rows["default"]["vs_direct"] == pytest.approx(0.81)
    assert rows["default"]["tokens_per_s"] == pytest.approx(81)
    assert rows["default"]["rep_engine_steps"] == [100, 100, 300]
    assert rows["default"]["rep_aux_calls"] == [0, 0, 4]
    assert rows["default"]["client"] == "stream" and rows["default"]["prompts"] == "random"
    table = markdown(list(rows.values()), [])
    # Every repetition's ratio is the same, so the intervals have no width.
    assert rows["default"]["vs_passthrough_interval"] == pytest.approx((0.9, 0.9))
    assert (
        "| 4 | stream | random | default | 81.0 | 0.81 [0.81, 0.81] | 0.90 [0.90, 0.90] | 100-300 "
        "| 0-4 | 0.50-1.25 |"
    ) in table
    assert "vllm bench serve" not in table


def test_bench_serve_rows():
    def result(throughput: float, itl: float) -> dict:
        return {"output_throughput": throughput, "mean_itl_ms": itl}

    runs = {
        "direct": [result(500, 7.0), result(250, 14.0), result(520, 6.8)],
        "default": [result(480, 7.7), result(240, 15.4), result(468, 7.48)],
    }
    rows = {row["config"]: row for row in summarize_bench_serve(runs)}
    assert rows["default"]["throughput_vs_direct"] == pytest.approx(0.96)
    assert rows["default"]["itl_vs_direct"] == pytest.approx(1.1)
    assert rows["direct"]["output_tokens_per_s"] == 500
    table = markdown([], list(rows.values()))
    # Per repetition: throughput 0.96, 0.96, 0.90; ITL 1.1, 1.1, 1.1.
    low, high = rows["default"]["throughput_vs_direct_interval"]
    assert low == pytest.approx(0.9) and high == pytest.approx(0.96)
    assert "| default | 468.0 | 7.70 | 0.96 [0.90, 0.96] | 1.10 [1.10, 1.10] |" in table
