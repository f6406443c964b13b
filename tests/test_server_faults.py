"""Proxy mode when the upstream misbehaves: a respx-mocked vLLM (the only mocked
upstream in the suite) that fails with 5xx, timeouts, refused connections or
malformed JSON, before or in the middle of a response.

The client must get an OpenAI-style 502 / 504, or -- once a stream has started -- an
error event followed by [DONE]; the tokens it did get must be a prefix of the true
output (never a wrong or duplicated token); nothing may hang.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from typing import Callable

import httpx
import pytest
import respx
from background_server import BackgroundServer
from metrics import Metrics
from tokenizers import Tokenizer

from proxy.backend.base import TargetError
from proxy.decoding import TreeSettings
from proxy.runtime import build_runtime
from proxy.server.app import create_app
from proxy.server.settings import ServerSettings

pytestmark = pytest.mark.timeout(120)

UPSTREAM = "http://upstream.test:8000"
MODEL = "mock-model"
PROMPT_IDS = [10, 11, 12, 13, 10, 11]


def next_token(prompt: list[int]) -> int:
    """The mock target's deterministic greedy choice; never EOS (id 0)."""
    return 4 + (prompt[-1] * 7 + len(prompt)) % 250


def reference(prompt: list[int], num_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(num_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


class MockUpstream:
    """A vLLM stand-in whose /v1/completions fails from call number `fail_at` on."""

    def __init__(self) -> None:
        self.fail_at: int | None = None
        self.failure = "http500"
        self.calls = 0
        # Answers requests that must be passed through (n > 1); None: not expected.
        self.passthrough: Callable[[httpx.Request], httpx.Response] | None = None
        self.router = respx.Router(base_url=UPSTREAM, assert_all_called=False)
        self.router.get("/v1/models").respond(
            200,
            json={
                "object": "list",
                "data": [{"id": MODEL, "object": "model", "max_model_len": 2048}],
            },
        )
        self.router.post("/v1/completions").mock(side_effect=self._completions)
        self.health = self.router.get("/health")
        self.health.respond(200)
        self.tokenize = self.router.post("/tokenize")
        self.tokenize.respond(
            200, json={"tokens": [1, 20, 21, 2], "count": 4, "max_model_len": 2048}
        )
        self.transport = httpx.MockTransport(self.router.async_handler)

    def _completions(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("n", 1) != 1:
            assert self.passthrough is not None, "unexpected pass-through request"
            return self.passthrough(request)
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            return self._fail(request)
        choices = [
            {"index": idx, "text": "", "token_ids": [next_token(prompt)], "finish_reason": "length"}
            for idx, prompt in enumerate(body["prompt"])
        ]
        return httpx.Response(
            200, json={"id": "cmpl-mock", "object": "text_completion", "choices": choices}
        )

    def _fail(self, request: httpx.Request) -> httpx.Response:
        if self.failure == "http500":
            return httpx.Response(500, json={"error": {"message": "engine dead", "code": 500}})
        if self.failure == "timeout":
            raise httpx.ReadTimeout("read timed out", request=request)
        if self.failure == "connect":
            raise httpx.ConnectError("connection refused", request=request)
        if self.failure == "reset":
            raise httpx.ReadError("connection reset by peer", request=request)
        if self.failure == "malformed":
            return httpx.Response(200, content=b"{this is not json")
        assert self.failure == "shape"
        return httpx.Response(200, json={"choices": [{"index": 0}]})

    def reset(self, fail_at: int | None = None, failure: str = "http500") -> None:
        self.calls, self.fail_at, self.failure = 0, fail_at, failure


EXPECTED = {  # failure -> (HTTP status, upstream_errors kind)
    "http500": (502, "http"),
    "timeout": (504, "timeout"),
    "connect": (502, "connect"),
    "reset": (502, "network"),
    "malformed": (502, "malformed"),
    "shape": (502, "malformed"),
}


@pytest.fixture(scope="module")
def upstream() -> MockUpstream:
    return MockUpstream()


@pytest.fixture(scope="module")
def server(upstream, target_dirs):
    # The start-up check of the local tokenizer against the server's
    # (`proxy.runtime.check_tokenizer`): the mock decodes as the model's tokenizer does.
    tokenizer = Tokenizer.from_file(str(target_dirs["t2x64"] / "tokenizer.json"))
    upstream.router.post("/detokenize").mock(
        side_effect=lambda request: httpx.Response(
            200,
            json={"prompt": tokenizer.decode(json.loads(request.content)["tokens"], False)},
        )
    )
    settings = ServerSettings(
        target_url=UPSTREAM,
        tokenizer=str(target_dirs["t2x64"]),  # EOS ids and local (de)tokenization
        drafter="ngram",
        # The mock answers verification calls only (no plain streams): a fixed budget.
        tree=TreeSettings(budget=4, depth=3, policy="fixed"),
        read_timeout=5,
    )
    with BackgroundServer(create_app(settings, transport=upstream.transport)) as background:
        yield background


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def _body(stream: bool = False, **extra) -> dict:
    return {"prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0, "stream": stream,
            "return_token_ids": True, **extra}  # fmt: skip


def _events(response: httpx.Response) -> list[dict | str]:
    events = []
    for line in response.iter_lines():
        if line:
            assert line.startswith("data: "), line
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _metric(http: httpx.Client, key: str) -> float:
    return Metrics(http.get("/metrics").text).get(key, 0.0)


def test_healthy_upstream_gives_the_reference(upstream, http):
    upstream.reset()
    whole = http.post("/v1/completions", json=_body())
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["token_ids"] == reference(PROMPT_IDS, 12)
    stats = whole.json()["usage"]["ddtree"]
    assert stats["upstream_calls"] == stats["rounds"] == upstream.calls  # one call per round
    with http.stream("POST", "/v1/completions", json=_body(stream=True)) as response:
        events = _events(response)
    assert events[-1] == "[DONE]"
    assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == reference(
        PROMPT_IDS, 12
    )


@pytest.mark.parametrize("failure", list(EXPECTED))
@pytest.mark.parametrize("stream", [False, True])
def test_failure_before_output_is_an_http_error(upstream, http, failure, stream):
    status, kind = EXPECTED[failure]
    label = f'ddtree_upstream_errors_total{{kind="{kind}"}}'
    before = _metric(http, label)
    upstream.reset(fail_at=1, failure=failure)
    response = http.post("/v1/completions", json=_body(stream=stream))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"] == "upstream_error"
    assert kind in error["message"]
    assert _metric(http, label) == before + 1


@pytest.mark.parametrize("failure", list(EXPECTED))
def test_failure_mid_stream_ends_with_error_then_done(upstream, http, failure):
    upstream.reset(fail_at=4, failure=failure)
    with http.stream("POST", "/v1/completions", json=_body(stream=True)) as response:
        assert response.status_code == 200
        events = _events(response)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == EXPECTED[failure][0] and error["type"] == "upstream_error"
    chunks = events[:-2]
    assert all("error" not in chunk for chunk in chunks)
    streamed = [t for chunk in chunks for t in chunk["choices"][0]["token_ids"]]
    # Three rounds succeeded: at least three tokens, all of them right, none twice.
    assert len(streamed) >= 3
    assert streamed == reference(PROMPT_IDS, len(streamed))
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks)


def test_chat_tokenize_failure_is_502(upstream, http):
    upstream.reset()
    upstream.tokenize.respond(500, text="template exploded")
    try:
        response = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
    finally:
        upstream.tokenize.respond(
            200, json={"tokens": [1, 20, 21, 2], "count": 4, "max_model_len": 2048}
        )
    assert response.status_code == 502 and "/tokenize" in response.json()["error"]["message"]
    ok = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
              "return_token_ids": True},
    )  # fmt: skip
    assert ok.status_code == 200
    assert ok.json()["choices"][0]["token_ids"] == reference([1, 20, 21, 2], 3)


def test_passthrough_failures(upstream, http):
    async def body_stream(*parts: bytes, error: Exception | None = None):
        for part in parts:
            yield part
        if error is not None:
            raise error

    # Streamed bodies, as from a real socket (respx pre-reads plain byte contents).
    def overloaded(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            503,
            content=body_stream(b'{"error": ', b'"overloaded"}'),
            headers={"content-type": "application/json"},
        )

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("read timed out", request=request)

    def breaks_mid_stream(request: httpx.Request) -> httpx.Response:
        first = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
        return httpx.Response(
            200,
            content=body_stream(first, error=httpx.ReadError("connection reset")),
            headers={"content-type": "text/event-stream"},
        )

    try:
        upstream.passthrough = overloaded
        relayed = http.post("/v1/completions", json=_body(n=2))
        assert relayed.status_code == 503 and relayed.content == b'{"error": "overloaded"}'
        upstream.passthrough = refused
        response = http.post("/v1/completions", json=_body(n=2))
        assert response.status_code == 502 and response.json()["error"]["type"] == "upstream_error"
        upstream.passthrough = slow
        assert http.post("/v1/completions", json=_body(n=2)).status_code == 504
        upstream.passthrough = breaks_mid_stream
        with http.stream("POST", "/v1/completions", json=_body(stream=True, n=2)) as response:
            assert response.status_code == 200
            events = _events(response)
        assert events[0] == {"choices": [{"index": 0, "text": "a"}]}
        assert "error" in events[1] and events[2] == "[DONE]"
    finally:
        upstream.passthrough = None


def test_health_reports_the_upstream(upstream, http):
    assert http.get("/health").json()["status"] == "ok"
    upstream.health.side_effect = httpx.ConnectError("connection refused")
    try:
        response = http.get("/health")
    finally:
        upstream.health.side_effect = None
        upstream.health.respond(200)
    assert response.status_code == 503
    assert (
        response.json()["status"] == "unhealthy"
        and "ConnectError" in response.json()["upstream"]["error"]
    )


def test_relayed_routes_keep_the_proxys_key_and_limits(upstream, server, target_dirs):
    """Another route of vLLM's: the client's headers and query go on, its Authorization
    does not (vLLM gets --upstream-api-key); vLLM's headers come back; the proxy's
    --api-key guards what vLLM's own would (/v1...), its body limit holds."""
    seen: list[httpx.Request] = []

    async def streamed(payload: dict):  # as from a socket (respx pre-reads plain bytes)
        yield json.dumps(payload).encode()

    def version(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        headers = {"content-type": "application/json", "x-served-by": "vllm"}
        return httpx.Response(200, content=streamed({"version": "0.32.0"}), headers=headers)

    def embeddings(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        error = {"error": {"message": "no embeddings", "code": 400}}
        return httpx.Response(
            400, content=streamed(error), headers={"content-type": "application/json"}
        )

    upstream.router.get("/version").mock(side_effect=version)
    upstream.router.post("/v1/embeddings").mock(side_effect=embeddings)
    settings = ServerSettings(
        target_url=UPSTREAM, tokenizer=str(target_dirs["t2x64"]), api_key="client-key",
        upstream_api_key="vllm-key", max_body_bytes=2048,
    )  # fmt: skip
    with BackgroundServer(create_app(settings, transport=upstream.transport)) as proxy:
        answer = httpx.get(f"{proxy.url}/version?verbose=1", headers={"x-trace": "t1"})
        assert answer.status_code == 200 and answer.json() == {"version": "0.32.0"}
        assert answer.headers["x-served-by"] == "vllm"
        request = seen.pop()
        assert request.url.query == b"verbose=1" and request.headers["x-trace"] == "t1"
        assert request.headers["authorization"] == "Bearer vllm-key"
        body = {"model": MODEL, "input": "hi"}
        refused = httpx.post(f"{proxy.url}/v1/embeddings", json=body)
        assert refused.status_code == 401 and not seen
        relayed = httpx.post(f"{proxy.url}/v1/embeddings", json=body,
                             headers={"authorization": "Bearer client-key"})  # fmt: skip
        assert relayed.status_code == 400 and relayed.json()["error"]["message"] == "no embeddings"
        assert json.loads(seen.pop().content) == body
        too_large = httpx.post(f"{proxy.url}/version", content=b"x" * 4096)
        assert too_large.status_code == 413 and not seen


def test_the_policy_half_life_setting_reaches_every_replica_policy(upstream, server, target_dirs):
    settings = ServerSettings(target_url=UPSTREAM, tokenizer=str(target_dirs["t2x64"]),
                              drafter="ngram", policy_half_life=120)  # fmt: skip

    async def half_lives() -> tuple[float, float]:
        runtime = await build_runtime(settings, upstream.transport)
        try:
            return runtime.policy.half_life_s, runtime.policy.for_replica("b").half_life_s
        finally:
            await runtime.aclose()

    assert asyncio.run(half_lives()) == (120, 120)


def test_unreachable_upstream_at_start_is_a_clear_error(target_dirs):
    router = respx.Router(base_url=UPSTREAM)
    router.get("/v1/models").mock(side_effect=httpx.ConnectError("connection refused"))
    settings = ServerSettings(target_url=UPSTREAM, tokenizer=str(target_dirs["t2x64"]))
    with pytest.raises(TargetError, match="cannot connect"):
        asyncio.run(build_runtime(settings, httpx.MockTransport(router.async_handler)))


def test_dflash_is_refused_in_proxy_mode():
    settings = ServerSettings(target_url=UPSTREAM, drafter="dflash:/nowhere")
    with pytest.raises(ValueError, match="hidden states"):
        asyncio.run(build_runtime(settings))


def test_cli_serve_reports_a_dead_upstream_in_one_line(target_dirs):
    with socket.socket() as unused:  # bound but never listening: connections are refused
        unused.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{unused.getsockname()[1]}"
        proc = subprocess.run(
            [sys.executable, "-m", "proxy.cli", "serve", "--target-url", url,
             "--tokenizer", str(target_dirs["t2x64"]), "--connect-timeout", "2"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith("ddtree-proxy: error:") and "cannot connect" in proc.stderr
    assert "Traceback" not in proc.stderr
