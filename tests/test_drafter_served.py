"""The served drafter's pieces that need no server: its options, how a vLLM completion
answer becomes a draft (literal answers in vLLM 0.32's shape), and what a round does
when a drafter fails (engine mode, a real random-weight target)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from proxy.backend.base import TargetError
from proxy.decoding import GenerationRequest, TreeSettings, generate
from proxy.drafter import DraftError, parse_drafter_spec
from proxy.drafter.base import InProcessDrafter
from proxy.drafter.served import ServedOptions
from proxy.drafter.vllm_client import parse_greedy_draft
from proxy.runtime import load_engine


def test_options_parse():
    assert parse_drafter_spec("vllm:http://d:8001,top_k=64") == ("vllm", "http://d:8001,top_k=64")
    options = ServedOptions.parse("http://d:8001/,model=ar,top_k=64,overlap=1,timeout=0.5")
    assert options == ServedOptions("http://d:8001", "ar", 64, 1, 0.5)
    assert ServedOptions.parse("https://d") == ServedOptions("https://d")


@pytest.mark.parametrize(
    "spec, message",
    [
        (None, "needs the draft server's URL"),
        ("d:8001", "must start with http"),
        ("http://d,top_k", "KEY=VALUE"),
        ("http://d,depth=3", "valid options"),
        ("http://d,top_k=x", "bad vllm drafter option"),
        ("http://d,top_k=0", "top_k >= 1"),
        ("http://d,overlap=2", "overlap 0 or 1"),
    ],
)
def test_options_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        ServedOptions.parse(spec)


def _answer(token_ids: list[int], top_logprobs: list[dict[str, float]]) -> dict:
    return {"choices": [{"index": 0, "token_ids": token_ids,
                         "logprobs": {"top_logprobs": top_logprobs}}]}  # fmt: skip


def test_parse_sorts_pads_and_maps_vllm_minus_inf():
    # vLLM lists the sampled token first, then the top-k; -inf comes as -9999.0.
    answer = _answer(
        [7, 3],
        [
            {"token_id:7": -0.1, "token_id:9": -3.0, "token_id:2": -2.5},
            {"token_id:3": -0.01, "token_id:5": -9999.0},
        ],
    )
    got = parse_greedy_draft(answer, max_tokens=2, top_k=3)
    assert got.greedy.tolist() == [7, 3]
    assert got.token_ids.tolist() == [[7, 2, 9], [3, 5, 0]]
    np.testing.assert_array_equal(got.log_probs, [[-0.1, -2.5, -3.0], [-0.01, -np.inf, -np.inf]])


@pytest.mark.parametrize(
    "answer",
    [
        _answer([7], [{"token_id:7": -0.1}]),  # one position for max_tokens=2
        _answer([7, 8], [{"7": -0.1}, {"token_id:8": -0.2}]),  # not token_id:N keys
        {"choices": []},
        {"error": "x"},
    ],
)
def test_parse_refuses_answers_that_do_not_fit(answer):
    with pytest.raises(TargetError):
        parse_greedy_draft(answer, max_tokens=2, top_k=2)


class _DownSession:
    """A session whose draft server is never reachable."""

    draft_calls = 0

    async def propose(self, committed, depth, top_k):
        self.draft_calls += 1
        raise DraftError("draft server down", "connect")

    def advance(self, committed, target_features) -> None:
        return None


class _DownDrafter(InProcessDrafter):
    name = "down"
    max_depth = None
    target_layer_ids = None

    def start(self, prompt_ids, prompt_features):
        return _DownSession()


def test_rounds_go_on_without_a_draft_when_the_drafter_fails(target_dirs):
    """DraftError is the drafter's fault: each round verifies the root alone (plain
    decoding), the output equals decoding without a drafter, and the stats say so."""
    runtime = load_engine(target_dirs["t2x64"], None)
    prompt = [3, 14, 15, 92, 65]

    def run_with(drafter, kind):
        request = GenerationRequest(prompt, max_tokens=12, ignore_eos=True,
                                    tree=TreeSettings(kind=kind))  # fmt: skip
        return asyncio.run(generate(runtime.target, drafter, request, runtime.detokenizer()))

    plain = run_with(None, "none")
    failed = run_with(_DownDrafter(), "ddtree")
    assert failed.token_ids == plain.token_ids
    stats = failed.stats
    assert stats.rounds == 12 and stats.draft_failures == 11  # the last round drafts nothing
    assert stats.draft_calls == 11 and stats.mean_acceptance_length == 1.0
