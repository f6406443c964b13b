"""Load against real processes: concurrent streaming httpx clients for a bounded time
through a real `ddtree-proxy serve` process in front of the session's REAL vLLM, using
scripts/load_test.py: 64 clients for 60 s, as the hardening issue asks (also the
script's default). Zero errors, every output lossless, memory flat; the report (p50/p99
latency, throughput, RSS) is printed and written next to the test's temporary files.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from dataclasses import asdict

import pytest

from benchmarks.upstream import REPO_ROOT

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

CLIENTS = 64
DURATION_S = 60.0


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "load_test", REPO_ROOT / "scripts" / "load_test.py"
    )
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_concurrent_streams_are_lossless_and_memory_stays_flat(vllm_server, tmp_path):
    load_test = _load_script()
    with load_test.start_proxy(vllm_server.url, ["--budget", "8"], tmp_path / "proxy.log") as proxy:
        report = asyncio.run(
            load_test.run_load(
                proxy.url, proxy.pid, vllm_server.url, vllm_server.model, CLIENTS,
                DURATION_S, max_tokens=16, num_prompts=40,
            )
        )  # fmt: skip
    (tmp_path / "load_report.json").write_text(json.dumps(asdict(report), indent=2))
    print("\n[load]\n" + report.markdown())
    assert report.errors == 0, report.error_samples
    assert report.mismatches == 0
    assert report.requests >= CLIENTS  # every client finished at least one request
    assert report.latency_p99_s < DURATION_S * 2
    # Flat: the last quarter's resident memory within 15% (and 60 MB) of the first's.
    growth = report.rss_mb_last - report.rss_mb_first
    assert growth < max(0.15 * report.rss_mb_first, 60), asdict(report)
