"""The proxy's streaming response (`proxy.server.streams.EventStream`) on a scripted ASGI
server: what it writes, and how it ends when the body ends, when the client goes away,
and when the server cancels it."""

from __future__ import annotations

import asyncio

import pytest

from proxy.server.streams import EventStream


class Client:
    """The ASGI side: records what is sent; `receive` answers a disconnect once `leave`
    is set (as uvicorn does when the connection closes, or the response is complete)."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.leave = asyncio.Event()

    async def receive(self) -> dict:
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message["more_body"]:
            self.leave.set()  # uvicorn: receive() answers a disconnect once complete


def _stream(body, log: list[str]) -> EventStream:
    response = EventStream(body, media_type="text/event-stream")
    response.on_close.append(lambda complete: log.append(f"closed, complete {complete}"))
    return response


def test_a_stream_sends_its_chunks_then_ends_and_calls_on_close():
    log: list[str] = []

    async def body():
        for chunk in (b"data: 1\n\n", b"data: 2\n\n"):
            await asyncio.sleep(0)
            yield chunk

    async def scenario() -> Client:
        client = Client()
        await _stream(body(), log)({"type": "http"}, client.receive, client.send)
        await asyncio.sleep(0.01)  # a listener left running would act now
        return client

    client = asyncio.run(scenario())
    assert [m["type"] for m in client.sent] == ["http.response.start"] + ["http.response.body"] * 3
    assert (b"content-type", b"text/event-stream; charset=utf-8") in client.sent[0]["headers"]
    assert [m["body"] for m in client.sent[1:]] == [b"data: 1\n\n", b"data: 2\n\n", b""]
    assert [m["more_body"] for m in client.sent[1:]] == [True, True, False]
    assert log == ["closed, complete True"]


def test_a_client_that_leaves_ends_the_body_where_it_waits():
    """The body is cancelled at its await (its `finally` runs: a relay closes vLLM's
    answer there), the response returns normally, and `on_close` is called."""
    log: list[str] = []

    async def body():
        try:
            for idx in range(1000):
                yield b"data: %d\n\n" % idx
                await asyncio.sleep(0.01)
        finally:
            log.append("body closed")

    async def scenario() -> Client:
        client = Client()

        async def leave_soon() -> None:
            await asyncio.sleep(0.05)
            client.leave.set()

        leaving = asyncio.create_task(leave_soon())
        await _stream(body(), log)({"type": "http"}, client.receive, client.send)
        await leaving
        return client

    client = asyncio.run(scenario())
    assert 2 <= len(client.sent) < 100  # started, then ended early
    assert not any(m.get("more_body") is False for m in client.sent)
    assert log == ["body closed", "closed, complete False"]


def test_a_stream_cancelled_by_the_server_is_cancelled():
    """A cancellation that is not the client's leaving (the server shutting down)
    propagates; the body is closed and `on_close` called all the same."""
    log: list[str] = []

    async def body():
        try:
            while True:
                yield b"data: x\n\n"
                await asyncio.sleep(0.01)
        finally:
            log.append("body closed")

    async def scenario() -> None:
        client = Client()
        task = asyncio.create_task(
            _stream(body(), log)({"type": "http"}, client.receive, client.send)
        )
        await asyncio.sleep(0.05)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(scenario())
    assert log == ["body closed", "closed, complete False"]
