"""A handed-over request's answer on its way to the client (`proxy.server.relayed`):
token ids read and nulled without parsing, events relayed whole however the bytes
arrive, and what an answer that broke leaves to go on from."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from conftest import run

from proxy.server.relayed import RelayedAnswer, split_token_ids


def _event(choices: list[dict], **extra) -> bytes:
    data = {"id": "cmpl-1", "object": "text_completion", "created": 7, "choices": choices,
            **extra}  # fmt: skip
    return b"data: " + json.dumps(data, separators=(",", ":")).encode()


def test_token_ids_are_read_and_nulled_without_touching_other_bytes():
    raw = (
        b'data: {"id":"c","choices":[{"index":0,"text":"say \\"token_ids\\":[7] -1.5e-05",'
        b'"logprobs":{"token_logprobs":[-0.000012345]},"token_ids":[202, 5]}],'
        b'"prompt_token_ids":[1,2,3]}'
    )
    stripped, ids = split_token_ids(raw)
    assert ids == [202, 5]  # the text's look-alike and the prompt's are not output ids
    assert stripped == raw.replace(b"[202, 5]", b"null").replace(b"[1,2,3]", b"null")
    assert split_token_ids(raw, keep=True) == (raw, [202, 5])
    nulls = b'data: {"choices":[{"token_ids":null}],"prompt_token_ids":null}'
    assert split_token_ids(nulls) == (nulls, [])
    assert split_token_ids(b'{"token_ids":[]}') == (b'{"token_ids":null}', [])


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]):
        self.chunks = chunks
        self.read_to_end = False

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        self.read_to_end = True


def _relay(chunks: list[bytes], keep_ids: bool = False) -> tuple[RelayedAnswer, bytes]:
    counts: list[int] = []
    body = _Chunks(chunks)
    response = httpx.Response(200, stream=body)
    answer = RelayedAnswer(response, handed_at=0.0, keep_ids=keep_ids, on_tokens=counts.append)

    async def read() -> bytes:
        return b"".join([piece async for piece in answer.relay(deadline=float("inf"))])

    sent = run(read())
    assert sum(counts) == len(answer.tokens)
    # The body is read to its end, [DONE] or not (a connection is pooled only then).
    assert body.read_to_end
    return answer, sent


def test_events_go_out_whole_however_the_bytes_arrive():
    events = [
        _event([{"index": 0, "text": "de", "finish_reason": None, "token_ids": [5, 6]}]),
        _event([{"index": 0, "text": "f", "finish_reason": "length", "token_ids": [7]}]),
        _event([], usage={"completion_tokens": 3}),
        b"data: [DONE]",
    ]
    stream = b"".join(event + b"\n\n" for event in events)
    content = b"".join(event + b"\n\n" for event in events[:2])  # usage and [DONE] held
    for size in (1, 7, 64, len(stream)):
        chunks = [stream[at : at + size] for at in range(0, len(stream), size)]
        answer, sent = _relay(chunks)
        assert sent == content.replace(b"[5,6]", b"null").replace(b"[7]", b"null")
        assert answer.tokens == [5, 6, 7] and answer.done
        assert answer.usage == json.loads(events[2][len(b"data: ") :])
        outcome = answer.outcome()
        assert outcome.complete and outcome.finish_reason == "length"
        assert outcome.tokens == [5, 6, 7] and outcome.first is not None
        assert outcome.first[0] == 2
    assert _relay([stream], keep_ids=True)[1] == content


@pytest.mark.parametrize("chat", [False, True])
def test_an_answer_that_breaks_leaves_its_tokens_and_text(chat):
    def piece(text: str, ids: list[int]) -> dict:
        if chat:
            return {"index": 0, "delta": {"content": text}, "finish_reason": None, "token_ids": ids}
        return {"index": 0, "text": text, "finish_reason": None, "token_ids": ids}

    opening = [{"index": 0, "delta": {"role": "assistant", "content": ""}}] if chat else []
    events = [_event(opening)] if chat else []
    events += [_event([piece("def", [5])]), _event([piece(" f", [6, 7])])]
    cut = b"".join(event + b"\n\n" for event in events) + events[0][:10]  # then it closes
    answer, sent = _relay([cut])
    outcome = answer.outcome()
    assert not outcome.complete and outcome.finish_reason is None
    assert outcome.tokens == [5, 6, 7] and outcome.text == "def f"
    assert sent.count(b"\n\n") == len(events)  # the partial event was not sent
    assert answer.names() == ("cmpl-1", 7)  # what goes on from them keeps their names


class _Stalling(httpx.AsyncByteStream):
    """One chunk, then nothing until closed; a read that waits then fails, as aiohttp's
    does when its response is released."""

    def __init__(self, chunk: bytes):
        self.chunk = chunk
        self.closed = asyncio.Event()

    async def __aiter__(self):
        yield self.chunk
        await self.closed.wait()
        raise httpx.ReadError("the answer was closed")

    async def aclose(self) -> None:
        self.closed.set()


def test_an_answer_that_stalls_ends_at_the_deadline():
    first = _event([{"index": 0, "text": "x", "finish_reason": None, "token_ids": [5]}])
    stream = _Stalling(first + b"\n\n")
    answer = RelayedAnswer(httpx.Response(200, stream=stream), handed_at=0.0, keep_ids=True)
    sent: list[bytes] = []

    async def read() -> None:
        deadline = asyncio.get_running_loop().time() + 0.2
        async with asyncio.timeout(30):  # a hang is a failure, not a wait
            async for piece in answer.relay(deadline):
                sent.append(piece)
        await answer.aclose()

    with pytest.raises(TimeoutError):
        run(read())
    assert stream.closed.is_set()  # closed at the deadline: vLLM aborts the request
    assert sent == [first + b"\n\n"] and answer.tokens == [5]


def test_an_answer_that_ends_in_an_error_event_is_not_gone_on_from():
    error = b'data: {"error":{"message":"engine died","code":500}}'
    first = _event([{"index": 0, "text": "x", "token_ids": [5]}])
    answer, _ = _relay([first + b"\n\n" + error + b"\n\n"])  # closed without [DONE]
    with pytest.raises(ValueError, match="not an answer"):
        answer.outcome()
    # With [DONE] after it, the answer is vLLM's whole (the client has its error event),
    # with no finish reason: the loop records the stretch as failed, not as a measurement.
    answer, _ = _relay([first + b"\n\n" + error + b"\n\n" + b"data: [DONE]\n\n"])
    outcome = answer.outcome()
    assert outcome.complete and outcome.finish_reason is None
