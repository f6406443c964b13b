"""A fault-injecting HTTP/1.1 reverse proxy of our own, on loopback, for the reliability
tests: it sits between the proxy and a REAL vLLM and, for a chosen fraction of the
calls to chosen paths, misbehaves instead of relaying vLLM's answer.

Faults (FAULTS):
* ``reset``    -- closes the connection with a TCP RST before answering;
* ``delay``    -- answers nothing for `delay_s` (longer than the client's read timeout),
                  then closes;
* ``http500`` / ``http503`` -- an OpenAI-style error body with that status;
* ``truncate`` -- vLLM's real answer cut in half, sent with a matching Content-Length
                  (a well-formed HTTP response carrying malformed JSON); a stream's
                  answer is cut after the last whole event of its first half (a stream
                  whose connection closed early: no [DONE]);
* ``stall``    -- (asked for by name, not in FAULTS' mix) the first half of vLLM's real
                  answer, cut as ``truncate`` cuts it but sent with the whole answer's
                  Content-Length, then nothing for `delay_s`, then the connection closes
                  (an upstream that stops mid-answer);
* ``lose_usage`` -- (by name too) a stream's answer up to its usage event (the one
                  whose choices are empty), which is cut off with the rest: every token
                  and the finish reason arrive, then the connection closes.

Every other call is forwarded to the upstream and its answer relayed whole (bodies
are buffered: a stream reaches the caller in one piece, its events unchanged). The shim
counts calls per path, faults per kind, and records the Authorization header of each
forwarded call and, with `record=True`, each relayed call's path, body and answer.
Run it with `with FaultShim(upstream_url, rate=0.1) as shim: ... shim.url ...`; it
serves from a daemon thread with its own event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field

import httpx

FAULTS = ("reset", "delay", "http500", "http503", "truncate")
STALL = "stall"
LOSE_USAGE = "lose_usage"
_REASONS = {200: "OK", 500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass
class ShimStats:
    calls: Counter = field(default_factory=Counter)  # path -> requests received
    faults: Counter = field(default_factory=Counter)  # fault kind -> injected
    # fault kind -> injected into a streaming call (its body asks for "stream": true)
    stream_faults: Counter = field(default_factory=Counter)
    auth_headers: list[str | None] = field(default_factory=list)  # per forwarded call
    # (path, request body, vLLM's answer) per relayed call, with record=True
    relayed: list[tuple[str, bytes, bytes]] = field(default_factory=list)


class FaultShim:
    def __init__(
        self,
        upstream_url: str,
        *,
        rate: float = 0.0,
        faults: tuple[str, ...] = FAULTS,
        paths: tuple[str, ...] = ("/v1/completions", "/tokenize", "/detokenize"),
        delay_s: float = 3.0,
        seed: int = 0,
        only_streams: bool = False,
        record: bool = False,
        match: bytes | None = None,
    ) -> None:
        """`rate`: the share of calls to `paths` that get one of `faults` (drawn with
        `seed`); `only_streams`: only calls whose body asks for a stream; `match`: only
        calls whose body holds these bytes; `record`: keep every relayed call in
        `stats.relayed`."""
        unknown = set(faults) - {*FAULTS, STALL, LOSE_USAGE}
        if unknown:
            valid = (*FAULTS, STALL, LOSE_USAGE)
            raise ValueError(f"Unknown faults: {sorted(unknown)}; valid: {valid}")
        self.upstream_url = upstream_url.rstrip("/")
        self.rate = rate
        self.faults = faults
        self.paths = paths
        self.delay_s = delay_s
        self.only_streams = only_streams
        self.record = record
        self.match = match
        self.stats = ShimStats()
        self._rng = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._client: httpx.AsyncClient | None = None
        self._handlers: set[asyncio.Task] = set()

    # ----- lifecycle ---------------------------------------------------------------

    def __enter__(self) -> FaultShim:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *exc_info: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._sock.close()

    async def _start(self) -> None:
        # Expire pooled connections well before vLLM's 5 s keep-alive, so the shim
        # itself never trips over a connection vLLM closed (only injected faults count).
        limits = httpx.Limits(max_keepalive_connections=64, keepalive_expiry=1.0)
        self._client = httpx.AsyncClient(base_url=self.upstream_url, timeout=300, limits=limits)
        self._server = await asyncio.start_server(self._connection, sock=self._sock)

    async def _stop(self) -> None:
        assert self._server is not None and self._client is not None
        self._server.close()
        for task in list(self._handlers):  # idle keep-alive connections, stalled faults
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._client.aclose()

    def set_rate(self, rate: float) -> None:
        self.rate = rate  # a float store: safe across threads

    # ----- serving -----------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    break
                method, path, headers, body = request
                keep_open = await self._answer(writer, method, path, headers, body)
                if not keep_open:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._handlers.discard(task)
            if not writer.is_closing():
                writer.close()

    async def _answer(
        self,
        writer: asyncio.StreamWriter,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
    ) -> bool:
        """Answer one request; False when the connection must end."""
        route = path.split("?", 1)[0]
        self.stats.calls[route] += 1
        fault = None
        streaming = _streaming(body)
        eligible = route in self.paths and (streaming or not self.only_streams)
        eligible = eligible and (self.match is None or self.match in body)
        if eligible and self._rng.random() < self.rate:
            fault = self._rng.choice(self.faults)
            self.stats.faults[fault] += 1
            if streaming:
                self.stats.stream_faults[fault] += 1
        if fault == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return False
        if fault == "delay":
            await asyncio.sleep(self.delay_s)
            return False
        if fault in ("http500", "http503"):
            status = int(fault[4:])
            error = {"error": {"message": f"injected {status}", "type": "shim", "code": status}}
            await _write_response(writer, status, json.dumps(error).encode(), "application/json")
            return True
        assert self._client is not None
        self.stats.auth_headers.append(headers.get("authorization"))
        forward = {k: v for k, v in headers.items() if k not in ("host", "content-length")}
        response = await self._client.request(method, path, content=body, headers=forward)
        content = response.content
        length = len(content)
        if fault in ("truncate", STALL):
            cut = len(content) // 2
            if streaming and b"\n\n" in content[:cut]:
                cut = content.rfind(b"\n\n", 0, cut) + 2
            content = content[:cut]
        if fault == LOSE_USAGE:
            events = content.split(b"\n\n")
            kept = list(itertools.takewhile(lambda event: b'"choices":[]' not in event, events))
            assert len(kept) < len(events), f"{LOSE_USAGE}: the answer has no usage event"
            content = b"".join(event + b"\n\n" for event in kept)
        if self.record and fault is None:
            self.stats.relayed.append((route, body, content))
        content_type = response.headers.get("content-type", "application/json")
        if fault == STALL:
            await _write_response(writer, response.status_code, content, content_type, length)
            await asyncio.sleep(self.delay_s)
            return False
        await _write_response(writer, response.status_code, content, content_type)
        return True


def _streaming(body: bytes) -> bool:
    try:
        return json.loads(body).get("stream") is True
    except (ValueError, AttributeError):  # not JSON, or not an object
        return False


async def _read_request(
    reader: asyncio.StreamReader,
) -> tuple[str, str, dict[str, str], bytes] | None:
    """One HTTP/1.1 request with a Content-Length body; None at a clean end of stream."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    lines = head.decode("latin-1").split("\r\n")
    method, path, _version = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = await reader.readexactly(length) if length else b""
    return method, path, headers, body


async def _write_response(
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes,
    content_type: str,
    length: int | None = None,
) -> None:
    """`body` after a head announcing `length` bytes (default: the body's)."""
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n"
        f"content-type: {content_type}\r\n"
        f"content-length: {len(body) if length is None else length}\r\n\r\n"
    )
    writer.write(head.encode("latin-1") + body)
    await writer.drain()
