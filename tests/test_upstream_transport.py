"""`VLLMHttp` over its real transport (aiohttp under httpx's API) against real sockets
that fail on demand: every failure becomes the TargetError of its kind, streams yield
what came before a break, and connections are pooled (kept alive) when read to their
end. (The respx tests elsewhere replace the transport; these keep it.)"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
from collections.abc import Awaitable, Callable

import pytest
from conftest import run

from benchmarks.upstream import free_port
from proxy.backend.base import TargetError
from proxy.backend.vllm import RetryPolicy, VLLMHttp

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
NO_WAIT = RetryPolicy(max_retries=1, backoff_s=0.0)


class Server:
    """A TCP server on 127.0.0.1 running `handler` per connection; counts connections and
    keeps each request's head (request line and headers)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.heads: list[list[str]] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(ConnectionError):
            await self.handler(reader, writer)
        writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """One request's body (its head kept in `heads`); None when the client closed."""
        head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
        if not head:
            return None
        lines = head.decode("latin-1").split("\r\n")[:-2]
        self.heads.append(lines)
        length = next(
            (int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:")),
            0,
        )  # fmt: skip
        return await reader.readexactly(length)

    @contextlib.asynccontextmanager
    async def running(self):
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.close()


def answer(body: bytes, *headers: str) -> bytes:
    head = ["HTTP/1.1 200 OK", f"content-length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


EVENT = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


async def _failure(call: Awaitable) -> TargetError:
    with pytest.raises(TargetError) as failure:
        await call
    return failure.value


def test_nothing_listening_is_a_connect_failure_for_calls_and_streams():
    url = f"http://127.0.0.1:{free_port()}"

    async def scenario() -> list[TargetError]:
        http = VLLMHttp(url, retry=NO_WAIT)
        try:
            return [await _failure(http.request_json("GET", "/v1/models")),
                    await _failure(http.open_stream("POST", "/v1/completions", b"{}", {}))]  # fmt: skip
        finally:
            await http.aclose()

    assert [failure.kind for failure in run(scenario())] == ["connect", "connect"]


def test_a_connection_closed_as_it_opens_is_a_retriable_network_failure():
    async def close_at_once(reader, writer) -> None:
        pass

    server = Server(close_at_once)

    async def scenario() -> list[TargetError]:
        async with server.running() as url:
            http = VLLMHttp(url, retry=NO_WAIT)
            try:
                return [await _failure(http.request_json("POST", "/tokenize", {})),
                        await _failure(http.open_stream("POST", "/v1/completions", b"{}", {}))]  # fmt: skip
            finally:
                await http.aclose()

    failures = run(scenario())
    assert [failure.kind for failure in failures] == ["network", "network"]
    assert all(failure.retriable for failure in failures)
    assert server.connections == 3  # the JSON call retried once; a stream is not retried


def test_an_answer_slower_than_the_read_timeout_is_a_timeout():
    async def silent(reader, writer) -> None:
        await server.read_request(reader)
        await asyncio.sleep(5)

    server = Server(silent)

    async def scenario() -> TargetError:
        async with server.running() as url:
            http = VLLMHttp(url, retry=RetryPolicy(max_retries=0), read_timeout=0.2)
            try:
                return await _failure(http.request_json("GET", "/v1/models"))
            finally:
                await http.aclose()

    failure = run(scenario())
    assert failure.kind == "timeout" and failure.retriable


def test_a_stream_cut_mid_body_yields_its_events_then_a_network_failure():
    async def cut(reader, writer) -> None:
        await server.read_request(reader)
        writer.write(STREAM_HEAD + chunk(EVENT) + chunk(EVENT[:20]))
        await writer.drain()

    server = Server(cut)

    async def scenario() -> tuple[int, TargetError]:
        async with server.running() as url:
            http = VLLMHttp(url, retry=NO_WAIT)
            events = 0
            try:
                with pytest.raises(TargetError) as failure:
                    async for _ in http.stream_events("/v1/completions", {"stream": True}):
                        events += 1
                return events, failure.value
            finally:
                await http.aclose()

    events, failure = run(scenario())
    assert events == 1
    assert failure.kind == "network" and failure.retriable


def test_calls_and_streams_read_to_their_end_reuse_one_connection():
    """Keep-alive: three JSON calls on one connection, three streams read to [DONE] on
    another (streams have their own pool)."""

    async def keep_alive(reader, writer) -> None:
        while (body := await server.read_request(reader)) is not None:
            if json.loads(body or b"{}").get("stream"):
                writer.write(STREAM_HEAD + chunk(EVENT) + chunk(b"data: [DONE]\n\n") + chunk(b""))
            else:
                writer.write(answer(b'{"ok": true}', "content-type: application/json"))
            await writer.drain()

    server = Server(keep_alive)

    async def scenario() -> list:
        async with server.running() as url:
            http = VLLMHttp(url)
            got = []
            try:
                for _ in range(3):
                    got.append(await http.request_json("POST", "/tokenize", {}))
                    got.append(
                        [e async for e in http.stream_events("/v1/completions", {"stream": True})]
                    )
            finally:
                await http.aclose()
            return got

    got = run(scenario())
    assert got == [{"ok": True}, [{"choices": [{"index": 0, "text": "a"}]}]] * 3
    assert server.connections == 2


def test_the_request_goes_out_as_httpx_built_it_and_compressed_answers_are_decoded():
    """Headers: the caller's and httpx's, none added by aiohttp (one content-type);
    a gzip answer reaches the caller decoded (httpx decodes, aiohttp passes bytes on)."""

    async def gzipped(reader, writer) -> None:
        await server.read_request(reader)
        writer.write(answer(gzip.compress(b'{"tokens": [1, 2]}'), "content-encoding: gzip"))
        await writer.drain()

    server = Server(gzipped)

    async def scenario() -> dict:
        async with server.running() as url:
            http = VLLMHttp(url, api_key="sk-test")
            try:
                return await http.request_json("POST", "/tokenize", {"prompt": "x"})
            finally:
                await http.aclose()

    assert run(scenario()) == {"tokens": [1, 2]}
    (head,) = server.heads
    assert head[0] == "POST /tokenize HTTP/1.1"
    names = [line.split(":", 1)[0].lower() for line in head[1:]]
    assert names.count("content-type") == 1 and names.count("content-length") == 1
    fields = {line.split(":", 1)[0].lower(): line.split(":", 1)[1].strip() for line in head[1:]}
    assert fields["authorization"] == "Bearer sk-test"
    assert fields["content-type"] == "application/json"
    assert fields["user-agent"].startswith("python-httpx/")


def test_a_stream_closed_before_its_end_closes_its_connection():
    """vLLM aborts a request whose connection closes: the plain path closes a stream it
    no longer reads (a switch to speculation, a client gone) and relies on that."""
    closed = asyncio.Event()

    async def endless(reader, writer) -> None:
        await server.read_request(reader)
        writer.write(STREAM_HEAD)
        try:  # until the client's end closes (a write may then fail first)
            while not reader.at_eof():
                writer.write(chunk(EVENT))
                await writer.drain()
                await asyncio.sleep(0.01)
        finally:
            closed.set()

    server = Server(endless)

    async def scenario() -> bool:
        async with server.running() as url:
            http = VLLMHttp(url)
            try:
                events = http.stream_events("/v1/completions", {"stream": True})
                await anext(events)
                await events.aclose()
                await asyncio.wait_for(closed.wait(), timeout=5)
                return closed.is_set()
            finally:
                await http.aclose()

    assert run(scenario())
