"""Log-prob token texts as vLLM reports them (`proxy.output.logprob_token_strings`),
against a byte-level "tokenizer": token id = byte value, decode = UTF-8 with U+FFFD."""

from __future__ import annotations

import asyncio

from proxy.output import logprob_token_strings


async def _decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def texts(token_ids: list[int], context: list[int] = ()) -> list[str]:
    strings = [bytes([t]).decode("utf-8", errors="replace") for t in token_ids]
    return asyncio.run(logprob_token_strings(_decode, strings, token_ids, list(context)))


def test_a_split_character_goes_to_the_token_that_completes_it():
    assert texts(list("é".encode())) == ["", "é"]  # [0xC3, 0xA9]
    assert texts(list("a☃b".encode())) == ["a", "", "", "☃", "b"]  # 3-byte snowman
    assert texts(list("😀".encode())) == ["", "", "", "😀"]  # 4 bytes: all of the context


def test_context_from_earlier_chunks_counts():
    # A stream: the first byte of "é" went out in an earlier chunk.
    assert texts([0xA9], context=[ord("x"), 0xC3]) == ["é"]


def test_unfinished_or_invalid_bytes_report_empty_text():
    assert texts([0xC3]) == [""]  # no next byte yet
    assert texts([0xFF, ord("a")]) == ["", "a"]  # never valid UTF-8
    assert texts([ord("a"), ord("b")]) == ["a", "b"]  # plain tokens untouched
