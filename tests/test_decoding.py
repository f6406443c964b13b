"""The decoding loop's contract: stop strings, stop tokens, max_tokens, logprobs,
streaming deltas -- on a real tiny target, compared with plain decoding."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import run

from proxy.decoding import GenerationRequest, TreeSettings, generate, stream_generate
from proxy.drafter import load_drafter
from proxy.runtime import Runtime, load_engine, target_info

PROMPT = list(range(40, 72))


@functools.lru_cache(maxsize=None)
def _engine(target_dir: str) -> Runtime:
    return load_engine(target_dir, None)


@pytest.fixture(scope="module")
def setup(target_dirs):
    target_dir = str(target_dirs["t3x96"])
    engine = _engine(target_dir)
    info = target_info(engine.target.model.config, None, engine.target.model)
    drafter = load_drafter(f"autoregressive:{target_dir}", info)
    plain = run(
        generate(
            engine.target,
            None,
            GenerationRequest(PROMPT, max_tokens=40, tree=TreeSettings(kind="none"), ignore_eos=True),
            engine.detokenizer(),
        )
    )
    return engine, drafter, plain


def _req(**kwargs) -> GenerationRequest:
    kwargs.setdefault("tree", TreeSettings(budget=8, depth=5))
    kwargs.setdefault("ignore_eos", True)
    return GenerationRequest(PROMPT, **kwargs)


def _decode(engine, tokens):
    return engine.tokens.tokenizer.decode(tokens, skip_special_tokens=True)


def test_max_tokens_cuts_inside_a_round(setup):
    engine, drafter, plain = setup
    for max_tokens in (1, 2, 7, 13):
        result = run(generate(engine.target, drafter, _req(max_tokens=max_tokens), engine.detokenizer()))
        assert result.token_ids == plain.token_ids[:max_tokens]
        assert result.finish_reason == "length"


def test_stop_string_truncates_text_and_tokens(setup):
    engine, drafter, plain = setup
    text = _decode(engine, plain.token_ids)
    start = next(i for i in range(8, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    stop = text[start : start + 3]
    cut = text.find(stop)
    # The reference: tokens up to the one whose text completes the stop string.
    keep = next(n for n in range(1, 41) if stop in _decode(engine, plain.token_ids[:n]))
    streamed = []

    async def collect():
        async for delta in stream_generate(
            engine.target, drafter, _req(max_tokens=40, stop=("\x00never", stop)), engine.detokenizer()
        ):
            streamed.append(delta)

    run(collect())
    assert "".join(d.text for d in streamed) == text[:cut]
    assert [t for d in streamed for t in d.token_ids] == plain.token_ids[:keep]
    assert streamed[-1].finish_reason == "stop"
    assert all(stop not in d.text for d in streamed)


def test_stop_token_ends_the_output(setup):
    engine, drafter, plain = setup
    position = next(i for i in range(3, 40) if plain.token_ids[i] not in plain.token_ids[:i])
    stop_token = plain.token_ids[position]
    result = run(
        generate(
            engine.target, drafter, _req(max_tokens=40, stop_token_ids=(stop_token,)), engine.detokenizer()
        )
    )
    assert result.token_ids == plain.token_ids[: position + 1]  # the stop token is reported
    assert result.text == _decode(engine, plain.token_ids[:position])  # but not in the text
    assert result.finish_reason == "stop"


def test_logprobs_match_a_plain_forward(setup):
    engine, drafter, plain = setup
    result = run(generate(engine.target, drafter, _req(max_tokens=12, logprobs=True), engine.detokenizer()))
    with torch.inference_mode():
        logits = engine.target.model(torch.tensor([PROMPT + result.token_ids])).logits[0]
    expected = torch.log_softmax(logits.float(), -1)[len(PROMPT) - 1 : -1]
    expected = expected.gather(-1, torch.tensor(result.token_ids)[:, None]).squeeze(-1)
    assert result.logprobs == pytest.approx(expected.tolist(), abs=1e-4)


def test_context_limit_ends_with_length(setup):
    engine, drafter, _ = setup
    limit = engine.target.max_model_len
    prompt = [5] * (limit - 3)
    result = run(
        generate(
            engine.target,
            drafter,
            GenerationRequest(prompt, max_tokens=50, ignore_eos=True, tree=TreeSettings(budget=8, depth=5)),
            engine.detokenizer(),
        )
    )
    assert len(result.token_ids) == 3 and result.finish_reason == "length"
    with pytest.raises(ValueError, match="limit"):
        run(generate(engine.target, drafter, GenerationRequest([5] * limit, max_tokens=5), engine.detokenizer()))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt_ids=[], max_tokens=4), "prompt is empty"),
        (dict(prompt_ids=[1], max_tokens=0), "max_tokens must be >= 1"),
        (dict(prompt_ids=[1], max_tokens=4, stop=("",)), "stop strings must be non-empty"),
    ],
)
def test_bad_requests(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationRequest(**kwargs)
