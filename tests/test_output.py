"""The output processor against full decodes of the same tokens: incremental text, stop
strings, stop tokens and reasons, and the linear cost of incremental detokenization.
Real tokenizer (the shipped byte-level BPE), random and real token streams."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from conftest import run
from transformers import AutoTokenizer

from proxy.output import REPLACEMENT, OutputProcessor

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = AutoTokenizer.from_pretrained(str(REPO_ROOT / "models" / "pycoder" / "target"))
VOCAB = len(TOKENIZER)


def _decode(tokens: list[int]) -> str:
    return TOKENIZER.decode(tokens, skip_special_tokens=True)


class CountingDecode:
    """The tokenizer's decode, counting the calls and the tokens it was asked to decode."""

    def __init__(self):
        self.num_tokens = 0
        self.num_calls = 0

    async def __call__(self, token_ids: list[int]) -> str:
        self.num_tokens += len(token_ids)
        self.num_calls += 1
        return _decode(token_ids)


def _feed(processor: OutputProcessor, tokens: list[int], rng: random.Random):
    """Hand `tokens` over in random round sizes; returns the deltas."""

    async def body():
        deltas, start = [], 0
        while processor.finish_reason is None and start < len(tokens):
            size = rng.randint(1, 8)
            deltas.append(await processor.add(tokens[start : start + size]))
            start += size
        return deltas

    return run(body())


def _random_tokens(rng: random.Random, n: int) -> list[int]:
    # Mostly ordinary tokens, some single bytes (unfinished UTF-8 sequences) and specials.
    return [rng.randrange(VOCAB) for _ in range(n)]


@pytest.mark.parametrize("seed", range(12))
def test_incremental_text_equals_the_full_decode(seed):
    rng = random.Random(seed)
    tokens = _random_tokens(rng, 300)
    processor = OutputProcessor(CountingDecode(), max_tokens=len(tokens))
    deltas = _feed(processor, tokens, rng)
    emitted = ""
    for delta in deltas:
        emitted += delta.text
        # Nothing is ever taken back: the text so far is a prefix of the final text.
        assert _decode(tokens).startswith(emitted)
    assert [t for d in deltas for t in d.token_ids] == tokens
    assert emitted == _decode(tokens).rstrip(REPLACEMENT)
    assert deltas[-1].finish_reason == "length" and deltas[-1].stop_reason is None


@pytest.mark.parametrize("seed", range(6))
def test_characters_split_across_rounds_come_out_whole(seed):
    text = "# naïve café — 日本語のテキスト 🎉🎉 ünïcödé\nprint('ok ✓')\n" * 4
    tokens = TOKENIZER(text, add_special_tokens=False)["input_ids"]
    assert len(tokens) > len(text) // 2  # multi-byte characters span several tokens
    processor = OutputProcessor(CountingDecode(), max_tokens=len(tokens))
    deltas = _feed(processor, tokens, random.Random(seed))
    assert "".join(d.text for d in deltas) == text
    assert all(REPLACEMENT not in d.text for d in deltas)


@pytest.mark.parametrize("seed", range(12))
def test_stop_strings_cut_where_a_full_decode_finds_them(seed):
    rng = random.Random(100 + seed)
    tokens = _random_tokens(rng, 200)
    full = _decode(tokens)
    start = rng.randrange(20, len(full) - 4)
    stop = full[start : start + rng.randint(1, 4)]
    # The reference: the fewest tokens whose text holds the stop string, cut before it.
    keep = next(n for n in range(1, len(tokens) + 1) if stop in _decode(tokens[:n]))
    processor = OutputProcessor(
        CountingDecode(), max_tokens=len(tokens), stop=("\x00never", stop)
    )
    deltas = _feed(processor, tokens, rng)
    text = "".join(d.text for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == tokens[:keep]
    assert text == full[: full.find(stop)]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
    assert all(stop not in d.text for d in deltas)


def test_stop_tokens_and_their_reasons():
    rng = random.Random(7)
    tokens = [t for t in _random_tokens(rng, 60) if t not in (5, 6)]
    with_stop = tokens[:20] + [5] + tokens[20:]
    by_id = OutputProcessor(CountingDecode(), max_tokens=100, stop_token_ids=(5,))
    deltas = _feed(by_id, with_stop, rng)
    assert [t for d in deltas for t in d.token_ids] == with_stop[:21]  # the stop token counts
    assert "".join(d.text for d in deltas) == _decode(tokens[:20]).rstrip(REPLACEMENT)
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == 5
    # EOS: finish "stop", no stop_reason (as vLLM); ignore_eos runs through it.
    eos = OutputProcessor(CountingDecode(), max_tokens=100, eos_token_ids=(6,))
    deltas = _feed(eos, tokens[:10] + [6] + tokens[10:], rng)
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason is None
    ignoring = OutputProcessor(
        CountingDecode(), max_tokens=30, eos_token_ids=(6,), ignore_eos=True
    )
    deltas = _feed(ignoring, tokens[:10] + [6] + tokens[10:], rng)
    assert sum(len(d.token_ids) for d in deltas) == 30 and deltas[-1].finish_reason == "length"


def test_logprobs_are_trimmed_with_their_tokens():
    processor = OutputProcessor(CountingDecode(), max_tokens=3, logprobs=True)
    delta = run(processor.add([40, 41, 42, 43, 44], [-0.1, -0.2, -0.3, -0.4, -0.5]))
    assert delta.token_ids == [40, 41, 42] and delta.logprobs == [-0.1, -0.2, -0.3]


def test_incremental_detokenization_is_linear_in_output_length():
    source = (REPO_ROOT / "proxy" / "output.py").read_text() * 3
    tokens = TOKENIZER(source, add_special_tokens=False)["input_ids"]
    assert len(tokens) > 3000
    decode = CountingDecode()
    processor = OutputProcessor(decode, max_tokens=len(tokens), stop=("\x00never",))
    deltas = _feed(processor, tokens, random.Random(0))
    assert "".join(d.text for d in deltas) == source
    # A full decode per round would touch ~len(tokens) ** 2 / 9 tokens (~375 per token
    # here); the window touches a few dozen per round.
    assert decode.num_tokens < 20 * len(tokens), decode.num_tokens / len(tokens)


@pytest.mark.parametrize("seed", range(4))
def test_a_decode_by_a_server_is_one_call_per_round(seed):
    """`window_tokens=None` (text decoded by vLLM's /detokenize, an HTTP call each): one
    decode per round, never a second one to re-anchor the window; same text."""
    rng = random.Random(200 + seed)
    text = "# naïve café — 日本語 🎉\ndef f(x):\n    return x + 1\n" * 8
    tokens = TOKENIZER(text, add_special_tokens=False)["input_ids"] + _random_tokens(rng, 100)
    decode = CountingDecode()
    processor = OutputProcessor(decode, max_tokens=len(tokens), window_tokens=None)
    deltas = _feed(processor, tokens, rng)
    assert "".join(d.text for d in deltas) == _decode(tokens).rstrip(REPLACEMENT)
    assert decode.num_calls == len(deltas)
    windowed = CountingDecode()
    _feed(OutputProcessor(windowed, max_tokens=len(tokens)), tokens, random.Random(200 + seed))
    assert windowed.num_calls > len(deltas)  # the default re-anchors: extra calls


def _resume_stats():
    from proxy.round import RoundStats

    return RoundStats(0, 0, 0.0, 0.0, 0.0, 0, 0, kind="plain")


@pytest.mark.parametrize("seed", range(8))
def test_resume_goes_on_from_the_text_another_writer_sent(seed):
    """A relayed answer that broke: its first k tokens went out as another processor
    (vLLM's, held back alike) wrote them; a processor resumed from them and fed the
    rest writes what one processor writes for all the tokens."""
    rng = random.Random(seed)
    tokens = _random_tokens(rng, 200)
    stop = ("ab", "\n\n") if seed % 2 else ()
    whole = OutputProcessor(CountingDecode(), max_tokens=len(tokens), stop=stop)
    expected = "".join(delta.text for delta in _feed(whole, tokens, random.Random(seed)))
    cut = rng.randrange(1, whole.num_tokens)  # before the output ends
    sender = OutputProcessor(CountingDecode(), max_tokens=len(tokens), stop=stop)
    sent = "".join(delta.text for delta in _feed(sender, tokens[:cut], rng))
    assert sender.finish_reason is None
    resumed = OutputProcessor(CountingDecode(), max_tokens=len(tokens), stop=stop)
    first = run(resumed.resume(tokens[:cut], sent, _resume_stats()))
    assert first.relayed and first.token_ids == tokens[:cut]
    rest = _feed(resumed, tokens[cut:], rng)
    assert sent + first.text + "".join(delta.text for delta in rest) == expected
    assert resumed.finish_reason == whole.finish_reason


def test_resume_refuses_text_it_cannot_go_on_from():
    from proxy.backend.base import TargetError

    tokens = TOKENIZER("def add(a, b):\n    return a + b\n")["input_ids"]
    text = _decode(tokens)
    processor = OutputProcessor(CountingDecode(), max_tokens=100)
    with pytest.raises(TargetError, match="cannot go on from"):
        run(processor.resume(tokens, "x" + text, _resume_stats()))
    # Tokens that end the output (a stop token) where the relayed stream had not ended.
    eos = OutputProcessor(CountingDecode(), max_tokens=100, eos_token_ids=(tokens[2],))
    with pytest.raises(TargetError, match="cannot go on from"):
        run(eos.resume(tokens, "", _resume_stats()))
