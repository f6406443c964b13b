"""The proxy's own defences, against the session's REAL vLLM: access control, bad
input, the admission queue, client disconnects, and a schemathesis run over the
proxy's OpenAPI schema. Upstream calls are counted by a fault-free shim
(tests/fault_shim.py) between the proxy and vLLM, and by the proxy's /metrics.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import schemathesis
from background_server import BackgroundServer
from conftest import MAX_MODEL_LEN
from fault_shim import FaultShim
from hypothesis import HealthCheck, given, settings
from metrics import scrape
from schemathesis.checks import not_a_server_error

from proxy.cli import build_parser, settings_from_args
from proxy.decoding import TreeSettings
from proxy.server.app import create_app
from proxy.server.request_models import DDTreeOptions
from proxy.server.settings import ServerSettings

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

CLIENT_KEY = "client-key"
UPSTREAM_KEY = "upstream-key"
AUTH = {"Authorization": f"Bearer {CLIENT_KEY}"}
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def shim(vllm_server):
    with FaultShim(vllm_server.url) as running:
        yield running


@pytest.fixture(scope="module")
def guarded(shim):
    """A proxy with a client API key and an upstream key, through the counting shim."""
    settings = ServerSettings(
        target_url=shim.url, drafter="ngram", tree=TreeSettings(budget=8), api_key=CLIENT_KEY,
        upstream_api_key=UPSTREAM_KEY, max_body_bytes=MAX_BODY, log_level="warning",
    )  # fmt: skip
    with BackgroundServer(create_app(settings)) as server:
        yield server.url


# ----- (d) access control ------------------------------------------------------------


def test_bad_keys_get_401_and_never_reach_vllm(vllm_server, shim, guarded):
    body = {"model": vllm_server.model, "prompt": "def f(x):", "max_tokens": 4}
    calls_before = sum(shim.stats.calls.values())
    for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": CLIENT_KEY},
                    {"Authorization": f"Basic {CLIENT_KEY}"}]:  # fmt: skip
        for path, payload in [
            ("/v1/completions", body),
            ("/v1/completions", body | {"n": 2}),  # would be a pass-through
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ]:
            response = httpx.post(guarded + path, json=payload, headers=headers, timeout=60)
            assert response.status_code == 401, (headers, path, response.text)
            assert response.json()["error"]["type"] == "authentication_error"
        assert httpx.get(guarded + "/v1/models", headers=headers).status_code == 401
    assert sum(shim.stats.calls.values()) == calls_before  # nothing reached vLLM
    # The right key works, and vLLM sees the proxy's upstream key, never the client's.
    ok = httpx.post(guarded + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert ok.status_code == 200, ok.text
    relayed = httpx.post(
        guarded + "/v1/completions", json=body | {"n": 2}, headers=AUTH, timeout=60
    )
    assert relayed.status_code == 200 and len(relayed.json()["choices"]) == 2
    assert sum(shim.stats.calls.values()) > calls_before
    assert set(shim.stats.auth_headers) == {f"Bearer {UPSTREAM_KEY}"}


def test_no_request_field_names_a_file_to_load(vllm_server, shim, guarded):
    """The only per-request knobs are the tree shape; paths in `ddtree` are refused,
    top-level names vLLM does not know are ignored as vLLM ignores them (the answer is
    the one without them: nothing was loaded), and another `model` is handed to vLLM as
    a name it does not serve."""
    assert set(DDTreeOptions.model_fields) == {
        "enabled",
        "kind",
        "budget",
        "depth",
        "strategy",
        "policy",
    }
    base = {"model": vllm_server.model, "prompt": "x", "max_tokens": 2}
    calls_before = shim.stats.calls["/v1/completions"]
    for body, param in [
        (base | {"ddtree": {"drafter": "autoregressive:/tmp"}}, "ddtree.drafter"),
        (base | {"ddtree": {"model": "/etc/passwd"}}, "ddtree.model"),
    ]:
        response = httpx.post(guarded + "/v1/completions", json=body, headers=AUTH, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert shim.stats.calls["/v1/completions"] == calls_before
    plain = base | {"temperature": 0, "return_token_ids": True}
    want = httpx.post(guarded + "/v1/completions", json=plain, headers=AUTH, timeout=60)
    assert want.status_code == 200, want.text
    for name in ("tokenizer", "drafter", "target"):
        response = httpx.post(
            guarded + "/v1/completions", json=plain | {name: "/etc"}, headers=AUTH, timeout=60
        )
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"]
    # Another model name goes to vLLM as a name; vLLM refuses it, nothing is loaded here.
    other = httpx.post(
        guarded + "/v1/completions", json=base | {"model": str(vllm_server.model_dir.parent)},
        headers=AUTH, timeout=60,
    )  # fmt: skip
    assert other.status_code == 404 and "does not exist" in other.json()["error"]["message"]


def test_binds_loopback_unless_told_otherwise():
    assert ServerSettings().host == "127.0.0.1"
    args = build_parser().parse_args(["serve", "--target-url", "http://127.0.0.1:9"])
    assert settings_from_args(ServerSettings, args).host == "127.0.0.1"
    args = build_parser().parse_args(["serve", "--target-url", "http://x:1", "--host", "0.0.0.0"])
    assert settings_from_args(ServerSettings, args).host == "0.0.0.0"


# ----- (e) bad input -------------------------------------------------------------------


def _bad_inputs(model: str) -> list[tuple[str, object, int, str | None]]:
    """(endpoint, body, status, param) -- param None: the error has no single field."""
    chat = "/v1/chat/completions"
    completions = "/v1/completions"
    msgs = [{"role": "user", "content": "hi"}]
    return [
        (completions, b"{not json", 400, None),
        (completions, b"[1, 2]", 400, None),
        (completions, {"model": model, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        (completions, {"model": model, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        (completions, {"model": model, "prompt": 5}, 400, "prompt"),
        (completions, {"model": model, "prompt": "x", "stream": "maybe"}, 400, "stream"),
        (chat, {"model": model, "messages": "hi"}, 400, "messages"),
        (chat, {"model": model, "messages": [{"role": 1, "content": "x"}]}, 400, "messages.0.role"),
        (completions, {"model": model, "prompt": ""}, 400, "prompt"),
        (completions, {"model": model, "prompt": []}, 400, "prompt"),
        (completions, {"model": model, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        (completions, {"model": model, "prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
        (completions, {"model": model, "prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
        (chat, {"model": model, "messages": msgs, "max_completion_tokens": 4096}, 400,
         "max_completion_tokens"),
        (completions, {"model": model, "prompt": [5] * MAX_MODEL_LEN}, 400, "prompt"),
        (completions, {"model": model, "prompt": [5] * (MAX_MODEL_LEN + 100)}, 400, "prompt"),
        (completions, {"model": model, "prompt": [5, 10**6]}, 400, "prompt"),
        (completions, {"model": "no-such-model", "prompt": "x"}, 404, None),
        (completions, {"model": model, "prompt": "x", "ddtree": {"drafter": "eagle"}}, 400,
         "ddtree.drafter"),
        (completions, {"model": model, "prompt": "x", "ddtree": {"budget": 0}}, 400,
         "ddtree.budget"),
        (completions, {"model": model, "prompt": "x", "ddtree": {"budget": 10**6}}, 400,
         "ddtree.budget"),
        (completions, {"model": model, "prompt": "x", "ddtree": {"depth": 0}}, 400,
         "ddtree.depth"),
        (completions, {"model": model, "prompt": "x", "ddtree": {"kind": "forest"}}, 400,
         "ddtree.kind"),
        # Past a 64-bit integer (vLLM 0.32 answers such a top_k with an empty 500), on
        # DDTree's path and on the way to vLLM alike (the schemathesis body of a CI run).
        (completions, {"model": model, "prompt": "x", "top_k": 2**63}, 400, "top_k"),
        (completions, {"model": model, "prompt": "x", "top_k": 10767392493253293060020695016757264384,
                       "ddtree": {"enabled": False}}, 400, "top_k"),
        (completions, {"model": model, "prompt": "x", "ddtree": {"depth": -(2**63) - 1}}, 400,
         "ddtree.depth"),
        (chat, {"model": model, "messages": msgs, "logit_bias": {"5": 2**64}}, 400,
         "logit_bias.5"),
        (completions, {"model": model, "prompt": "x" * (MAX_BODY + 1)}, 413, None),
    ]  # fmt: skip


def test_bad_input_gets_a_4xx_naming_the_field(vllm_server, shim, guarded):
    calls_before = shim.stats.calls["/v1/completions"]
    for endpoint, body, status, param in _bad_inputs(vllm_server.model):
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        response = httpx.post(guarded + endpoint, headers=AUTH, timeout=60, **kwargs)
        assert response.status_code == status, (
            body if len(str(body)) < 300 else "big",
            response.text,
        )
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], error
        assert error["code"] == status and isinstance(error["type"], str), error
        if param is not None:
            assert error["param"] == param, (body, error)
            assert param.split(".")[-1] in error["message"], error
    # Only the unknown model went upstream (vLLM answers for its own model names).
    assert shim.stats.calls["/v1/completions"] == calls_before + 1


def test_oversized_chunked_body_is_413(guarded):
    """Without a Content-Length the limit is enforced while reading."""

    def chunks():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    response = httpx.post(guarded + "/v1/completions", content=chunks(), headers=AUTH, timeout=60)
    assert response.status_code == 413, response.text
    assert "limit" in response.json()["error"]["message"]
    assert scrape(guarded, AUTH)['ddtree_rejected_total{reason="body_too_large"}'] >= 1


def test_schemathesis_finds_no_server_error(vllm_server, guarded):
    """Schema-driven fuzzing of /v1/completions and /v1/chat/completions (the proxy's own
    OpenAPI schema): no input may produce a 5xx. Outputs are capped at 4 tokens so the
    run stays short; everything else is as generated."""
    schema = schemathesis.openapi.from_url(guarded + "/openapi.json")
    operations = schema.include(path_regex="^/v1/(chat/)?completions$")
    statuses: list[int] = []
    num_operations = 0
    for result in operations.get_all_operations():
        operation = result.ok()
        num_operations += 1

        @given(case=operation.as_strategy())
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
        def check(case):
            if isinstance(case.body, dict):
                # Absent or large, the output would run to the context limit.
                for field in ("max_tokens", "max_completion_tokens"):
                    value = case.body.get(field)
                    if value is None or (isinstance(value, int) and value > 4):
                        case.body[field] = 4
                if case.body.get("model") is not None:
                    case.body["model"] = vllm_server.model  # other names are vLLM's to judge
            response = case.call(headers=AUTH, timeout=60)
            statuses.append(response.status_code)
            case.validate_response(response, checks=[not_a_server_error])

        check()
    assert num_operations == 2
    assert statuses and max(statuses) < 500
    print(f"\n[schemathesis] {len(statuses)} calls, statuses {sorted(set(statuses))}")


# ----- (f, part) admission queue and (c) client disconnect ----------------------------


@pytest.fixture(scope="module")
def narrow(vllm_server):
    """A proxy that serves one generation at a time and queues one more."""
    settings = ServerSettings(
        target_url=vllm_server.url, drafter="ngram", max_active=1, max_queue=1,
        # fixed: these tests need a generation that runs rounds for seconds (the adaptive
        # policy may serve one plainly, and then a client waiting for round 5 never left)
        tree=TreeSettings(budget=4, policy="fixed"), log_level="warning",
    )  # fmt: skip
    with BackgroundServer(create_app(settings)) as server:
        yield server.url


def _long_body(model: str, **extra) -> dict:
    return {"model": model, "prompt": [5, 17, 201, 42, 9], "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip


async def _wait_metric(url: str, name: str, value: float, timeout_s: float = 30) -> None:
    start = time.monotonic()
    while scrape(url).get(name) != value:
        assert time.monotonic() - start < timeout_s, f"{name} never became {value}"
        await asyncio.sleep(0.05)


def test_queue_beyond_its_depth_is_429_and_a_dropped_stream_frees_its_slot(vllm_server, narrow):
    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=narrow, timeout=120) as client:
            body = _long_body(vllm_server.model, stream=True)
            async with client.stream("POST", "/v1/completions", json=body) as stream:
                assert stream.status_code == 200
                lines = stream.aiter_lines()
                await anext(lines)  # the stream runs: the one slot is taken
                queued = asyncio.create_task(
                    client.post("/v1/completions", json=_long_body(vllm_server.model) | {"max_tokens": 4})
                )  # fmt: skip
                await _wait_metric(narrow, "ddtree_queued_requests", 1.0)
                refused = await client.post("/v1/completions", json=_long_body(vllm_server.model))
            # The stream's client left: its slot goes to the queued request.
            return refused, await queued

    refused, served = asyncio.run(scenario())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_exceeded"
    assert served.status_code == 200 and len(served.json()["choices"][0]["token_ids"]) == 4
    metrics = scrape(narrow)
    assert metrics["ddtree_active_requests"] == 0 and metrics["ddtree_queued_requests"] == 0
    assert metrics['ddtree_rejected_total{reason="queue_full"}'] == 1


def test_client_disconnect_stops_the_generation(vllm_server, narrow):
    """A client that drops mid-stream: its loop stops, no further upstream calls (the
    proxy's metrics and vLLM's own prompt-token counter both stand still)."""
    before = scrape(narrow)
    body = _long_body(
        vllm_server.model, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )  # fmt: skip
    client_rounds = 0
    with httpx.stream("POST", narrow + "/v1/completions", json=body, timeout=120) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                client_rounds = json.loads(line[6:])["usage"]["ddtree"]["rounds"]
                if client_rounds >= 5:
                    break  # leaving the block closes the connection mid-stream
    at_close = scrape(narrow)  # a few ms after the socket closed
    time.sleep(0.5)
    settled = scrape(narrow)
    vllm_settled = scrape(vllm_server.url).total("vllm:prompt_tokens_total")
    time.sleep(2.0)  # an undisturbed generation would make dozens of calls meanwhile
    after = scrape(narrow)
    assert (
        after["ddtree_client_disconnects_total"]
        == before.get("ddtree_client_disconnects_total", 0) + 1
    )
    assert after["ddtree_upstream_calls_total"] == settled["ddtree_upstream_calls_total"]
    assert after["ddtree_rounds_total"] == settled["ddtree_rounds_total"]
    assert scrape(vllm_server.url).total("vllm:prompt_tokens_total") == vllm_settled
    assert after["ddtree_active_requests"] == 0
    # The round in flight when the disconnect was seen is cancelled, not finished.
    rounds_after_close = settled["ddtree_rounds_total"] - at_close["ddtree_rounds_total"]
    assert rounds_after_close <= 1
    print(
        f"\n[disconnect] rounds after the client closed: {rounds_after_close:.0f}; rounds the "
        f"proxy ran before the close (buffered, unread): "
        f"{at_close['ddtree_rounds_total'] - before['ddtree_rounds_total'] - client_rounds:.0f}"
    )
