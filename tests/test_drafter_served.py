"""The served drafter's pieces that need no server: its options, and how a vLLM
completion answer becomes a draft (literal answers in vLLM 0.32's shape)."""

from __future__ import annotations

import numpy as np
import pytest

from proxy.backend.base import TargetError
from proxy.backend.vllm_draft import parse_greedy_draft
from proxy.drafter import parse_drafter_spec
from proxy.drafter.served import ServedOptions


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
