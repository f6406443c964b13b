"""The benchmark's quick mode, run as users run it (`python -m benchmarks.run --quick`),
and the report it writes checked against its schema.

Engine mode runs on the shipped family when it is present, else on a random-weight
target with a random DFlash drafter; proxy mode reuses the session's vLLM server.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import respx
from conftest import make_test_model

from benchmarks import cost_model
from benchmarks.report import Report, validate_report
from benchmarks.run import DEFAULT_DFLASH_DIR, DEFAULT_TARGET_DIR

REPO_ROOT = Path(__file__).resolve().parents[1]
QUICK_LIMIT_S = 180


@pytest.fixture(scope="module")
def engine_family(tmp_path_factory) -> tuple[Path, Path]:
    """(target dir, DFlash dir): the shipped family, or random weights without it."""
    if (DEFAULT_TARGET_DIR / "config.json").is_file() and (
        DEFAULT_DFLASH_DIR / "config.json"
    ).is_file():
        return DEFAULT_TARGET_DIR, DEFAULT_DFLASH_DIR
    from transformers import AutoConfig, AutoTokenizer

    from proxy.drafter.dflash_model import DFlashConfig, DFlashDraftModel, save_checkpoint
    from training.modelgen import MASK_TOKEN

    root = tmp_path_factory.mktemp("bench-family")
    target = make_test_model(root / "target")
    mask_id = AutoTokenizer.from_pretrained(target).convert_tokens_to_ids(MASK_TOKEN)
    config = DFlashConfig.for_target(
        AutoConfig.from_pretrained(target), mask_token_id=mask_id, block_size=8
    )
    dflash = save_checkpoint(DFlashDraftModel.random(config, seed=3, std=0.2), root / "dflash")
    return target, dflash


def run_benchmark(out: Path, *args: str) -> Report:
    """Run the command in a fresh interpreter, within the CI time limit."""
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(out), *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=QUICK_LIMIT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert time.monotonic() - started < QUICK_LIMIT_S
    assert "benchmark" in result.stderr  # the progress bar
    return validate_report(out / "latest.json")


def check_files(out: Path, report: Report) -> None:
    raw = json.loads((out / "latest.json").read_text())
    assert set(raw) == {"metadata", "rows", "cost_model"}
    assert isinstance(raw["rows"], list) and raw["rows"]
    for name in ("tau_vs_budget.png", "speedup_vs_budget.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (out / "latest.md").read_text()
    assert "| mode | tree | drafter |" in markdown and "![tau_vs_budget.png]" in markdown
    assert markdown.count("\n| engine |") + markdown.count("\n| proxy |") >= len(report.rows)
    # The per-round log behind the cost model covers every speculative row.
    rounds = cost_model.load_rounds(out / "latest_rounds.npz")
    for row in report.rows:
        if row.mode == "vllm-direct":
            continue
        log = rounds[row.id]
        assert log["acceptance"].shape == (row.rounds,)
        assert np.isclose(log["acceptance"].mean(), row.tau)


def engine_args(family: tuple[Path, Path]) -> tuple[str, ...]:
    return ("--no-proxy", "--target-dir", str(family[0]), "--dflash-dir", str(family[1]))


@pytest.fixture(scope="module")
def engine_report(engine_family, tmp_path_factory) -> tuple[Path, Report]:
    out = tmp_path_factory.mktemp("engine-report")
    return out, run_benchmark(out, *engine_args(engine_family))


def test_quick_engine_report_schema_and_rerun(engine_family, engine_report, tmp_path):
    out, report = engine_report
    check_files(out, report)

    meta = report.metadata
    assert meta.quick and len(meta.prompts) == 2 and meta.budgets == [16]
    assert all(task.startswith("HumanEval/") for task in meta.prompts)
    assert meta.vllm is None and len(meta.load_before) == 3
    rows = {row.id: row for row in report.rows}
    assert list(rows) == ["engine/none/target", "engine/chain/dflash", "engine/ddtree/dflash/b16"]
    baseline = rows["engine/none/target"]
    assert baseline.tau == 1.0 and baseline.speedup_vs_baseline == 1.0
    assert baseline.rounds == baseline.generated_tokens == 2 * meta.max_tokens
    for row in report.rows:
        assert row.mode == "engine" and row.baseline == "engine/none/target"
        assert row.mismatched_prompts == 0 and row.mismatched_tokens == 0  # lossless
        assert row.output_digest == baseline.output_digest
        assert row.upstream_calls_per_round is None and row.prefix_cache_hit_rate is None
        assert row.generated_tokens == 2 * meta.max_tokens
        assert row.tokens_per_s == pytest.approx(row.generated_tokens / row.wall_s)
        # Engine projections exist for the attention-only scenario only.
        assert row.model_extra["gpu_qwen36_cpuhost_tokens_per_s"] is None
        assert row.model_extra["gpu_dense27b_fasthost_tokens_per_s"] > 0
    ddtree = rows["engine/ddtree/dflash/b16"]
    assert ddtree.budget == 16 and 1 <= ddtree.nodes_per_round <= 16
    assert ddtree.depth == meta.models["dflash"]["block_size"] - 1

    # T=0 is deterministic: a rerun reproduces tau and every output token.
    rerun = run_benchmark(tmp_path, *engine_args(engine_family))
    assert [(r.id, r.tau, r.rounds, r.output_digest) for r in rerun.rows] == [
        (r.id, r.tau, r.rounds, r.output_digest) for r in report.rows
    ]

    # The cost model re-projects a saved report from its files alone.
    cost_model.main([str(out / "latest.json"), "--decode-step-ms", "20"])


def test_validate_rejects_a_lossy_engine_row(engine_report):
    out, _ = engine_report
    raw = json.loads((out / "latest.json").read_text())
    raw["rows"][-1]["mismatched_prompts"] = 1
    with pytest.raises(ValueError, match="reproduce its baseline"):
        Report.model_validate(raw)
    raw["rows"][-1]["mismatched_prompts"] = 0
    del raw["rows"][0]["tau"]
    with pytest.raises(ValueError, match="tau"):
        Report.model_validate(raw)


@pytest.mark.vllm
def test_quick_proxy_report_against_real_vllm(vllm_server, tmp_path):
    out = tmp_path / "proxy"
    report = run_benchmark(
        out, "--no-engine", "--target-dir", str(vllm_server.model_dir),
        "--vllm-url", vllm_server.url, "--proxy-drafters", "ngram",
    )  # fmt: skip
    check_files(out, report)
    rows = {row.id: row for row in report.rows}
    assert list(rows) == [
        "vllm-direct",
        "proxy/chain/ngram/nodes",
        "proxy/chain/ngram/paths",
        "proxy/ddtree/ngram/nodes/b16",
        "proxy/ddtree/ngram/paths/b16",
    ]
    direct = rows["vllm-direct"]
    assert direct.mode == "vllm-direct" and direct.tree == "none" and direct.tau == 1.0
    assert report.metadata.vllm["block_size"] == 32
    # Every configuration starts from an empty prefix cache, as in a full run; without
    # that, earlier tests' requests would make vLLM's recompute counts order-dependent.
    assert report.metadata.vllm["prefix_cache_reset"] is True
    for row in report.rows[1:]:
        assert row.mode == "proxy" and row.baseline == "vllm-direct"
        assert row.speedup_vs_baseline == pytest.approx(direct.wall_s / row.wall_s)
        assert row.upstream_calls_per_round == 1.0  # greedy: one batched call per round
        assert row.mismatched_prompts == 0 and row.mismatched_tokens == 0  # lossless
        assert row.output_digest == direct.output_digest
        assert row.target_tokens_per_round >= row.recomputed_tokens_per_round > 0
        assert row.model_extra["gpu_qwen36_fasthost_tokens_per_s"] > 0
        if row.strategy == "nodes":
            # Node prompts read the shared context from vLLM's prefix cache...
            assert row.prefix_cache_hit_rate > 0.5
            assert row.prompts_per_round == pytest.approx(row.nodes_per_round + 1)
            # ...and the cost model's recompute estimate is close to vLLM's own count.
            assert (
                0.8 <= row.recomputed_tokens_est_per_round / row.recomputed_tokens_per_round <= 1.5
            )
        else:
            # `paths` asks for prompt_logprobs, and vLLM skips reading its prefix cache
            # for any request that does (skip_reading_prefix_cache in SamplingParams).
            assert row.prefix_cache_hit_rate is None
            assert row.recomputed_tokens_per_round == pytest.approx(row.target_tokens_per_round)
    # Same trees, same (lossless) outputs: tau does not depend on the verification strategy.
    for tree in ("chain/ngram", "ddtree/ngram"):
        suffix = "/b16" if tree.startswith("ddtree") else ""
        nodes, paths = rows[f"proxy/{tree}/nodes{suffix}"], rows[f"proxy/{tree}/paths{suffix}"]
        assert nodes.tau == paths.tau
    assert report.cost_model["host_fit"]["num_rounds"] == sum(
        row.rounds for row in report.rows if row.strategy == "nodes"
    )


@pytest.mark.vllm
def test_engine_steps_tell_a_batch_from_requests_one_at_a_time(vllm_server):
    """`benchmarks.adaptive.engine_steps` counts vLLM's scheduler steps: a lone request
    of 8 tokens takes 8 (its prefill yields the first), and 4 such prompts in one call,
    batched, about as many as one (8-9: their prefills may take two steps) -- not 4 x 8,
    what the report's slow cells show."""
    from benchmarks.adaptive import engine_steps

    prompts = [[11 + i, 12, 13, 14, 15, 16] for i in range(4)]
    before = engine_steps(vllm_server.url)
    vllm_server.complete_greedy(prompts[:1], max_tokens=8)
    lone = engine_steps(vllm_server.url) - before
    vllm_server.complete_greedy(prompts, max_tokens=8)
    batched = engine_steps(vllm_server.url) - before - lone
    assert lone == 8
    assert 8 <= batched < 2 * 8


@respx.mock
def test_engine_steps_names_a_server_without_the_metric():
    respx.get("http://upstream.test/metrics").respond(200, text="# no vLLM here\nup 1\n")
    from benchmarks.adaptive import engine_steps

    with pytest.raises(RuntimeError, match="has no vllm:iteration_tokens_total_count"):
        engine_steps("http://upstream.test")


@pytest.mark.vllm
def test_vllms_engine_core_runs_at_the_lowest_priority(vllm_server):
    """`scripts/vllm_cpu.sh serve` renices vLLM's engine core, which spin-waits for its
    worker (see lower_engine_core_priority there), to 19; the API server and the worker,
    which do the work, keep the priority they started with. (A server reused through
    DDTREE_TEST_VLLM has no known process group: then every vLLM process here counts.)"""
    import os

    group = [] if vllm_server.pid is None else ["-g", str(vllm_server.pid)]

    def tasks_nice(pattern: str) -> set[int]:
        pids = subprocess.run(["pgrep", *group, "-f", pattern],
                              capture_output=True, text=True).stdout.split()  # fmt: skip
        assert pids, f"no process matching {pattern} ({group or 'any group'})"
        return {os.getpriority(os.PRIO_PROCESS, int(task))
                for pid in pids for task in os.listdir(f"/proc/{pid}/task")}  # fmt: skip

    deadline = time.monotonic() + 30  # the renice follows the engine core's start
    while tasks_nice("^VLLM::EngineCore") != {19} and time.monotonic() < deadline:
        time.sleep(0.5)
    assert tasks_nice("^VLLM::EngineCore") == {19}
    assert tasks_nice("^VLLM::Worker") == {0}
    assert tasks_nice("vllm.entrypoints.openai.api_server") == {0}


def test_upstream_client_benchmark_reads_every_event_through_both_transports(tmp_path):
    """`benchmarks.upstream_client`, small: both transports read every event (a stream
    short of its events would make the per-event figure a lie), and the report is written."""
    from benchmarks import upstream_client

    assert upstream_client.main(["--reps", "1", "--events", "30", "--gap-ms", "0.2",
                                 "--out", str(tmp_path)]) == 0  # fmt: skip
    report = json.loads((tmp_path / "upstream_client.json").read_text())
    assert [row["read"] for row in report["rows"]] == ["parsed", "relayed"]
    for row in report["rows"]:
        assert row["httpx_us"] > 0 and row["aiohttp_us"] > 0
    assert "| parsed |" in (tmp_path / "upstream_client.md").read_text()
