"""A byte-for-byte TCP relay on loopback that counts the connections made through it:
put it between the proxy and a real vLLM to see whether the proxy's HTTP clients reuse
their connections (vLLM's chunked streams pass through unchanged, unlike the buffering
relay in fault_shim.py), and that can hold the upstream's bytes back (`hold`, `release`):
requests then stay in flight for as long as a test needs. Run it with `with
TcpRelay(upstream_url) as relay: ... relay.url ... relay.connections`; it serves from a
daemon thread with its own loop."""

from __future__ import annotations

import asyncio
import threading
from urllib.parse import urlsplit


class TcpRelay:
    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"upstream URL needs a host and a port: {upstream_url!r}")
        self._upstream = (parts.hostname, parts.port)
        self.connections = 0  # accepted so far
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._open: asyncio.Event | None = None  # set: the upstream's bytes pass

    def __enter__(self) -> TcpRelay:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc_info: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def hold(self) -> None:
        """From now on the upstream's bytes wait in the relay (requests still go up)."""
        self._call(lambda: self._open.clear())

    def release(self) -> None:
        """Pass on what waits, and what comes."""
        self._call(lambda: self._open.set())

    def _call(self, action) -> None:
        async def run() -> None:
            action()

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=10)

    async def _start(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer, self._open))


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, gate: asyncio.Event | None = None
) -> None:
    """Copy until the reader's end (each chunk once `gate` is set), then close the writer
    (the other side sees EOF)."""
    try:
        while chunk := await reader.read(65536):
            if gate is not None:
                await gate.wait()
            writer.write(chunk)
            await writer.drain()
    except ConnectionError:
        pass  # the other side went away; closing below tells its peer
    finally:
        writer.close()
