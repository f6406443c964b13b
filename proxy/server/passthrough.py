"""Proxy mode's pass-through: requests DDTree does not serve -- and every route of
vLLM's the proxy does not serve itself -- go to vLLM as they are (method, path, query,
headers, body), and vLLM's answer (status, headers, body bytes, streaming) comes back
as it is."""

from __future__ import annotations

from typing import AsyncIterator

import httpx
from fastapi import Request, Response

from proxy.backend.base import TargetError
from proxy.backend.vllm import VLLMHttp
from proxy.server.errors import error_body, upstream_error
from proxy.server.metrics import ServerMetrics
from proxy.server.responses import sse
from proxy.server.streams import EventStream

# Headers of one connection, not of the request (RFC 9110, 7.6.1), and those the HTTP
# client sets itself for the body it sends.
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
     "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length"}
)  # fmt: skip
# Not sent on: the client's credentials are the proxy's (vLLM gets --upstream-api-key),
# x-ddtree is the proxy's own switch.
_NOT_FORWARDED = _HOP_BY_HOP | {"authorization", "x-ddtree"}
# Not sent back: the proxy's own HTTP server writes these.
_NOT_RETURNED = (_HOP_BY_HOP - {"content-length"}) | {"date", "server"}


async def relay(
    upstream: VLLMHttp,
    metrics: ServerMetrics,
    request: Request,
    method: str,
    path: str,
    content: bytes | None,
) -> Response:
    """Send one request to vLLM as the client sent it (`path` with the client's query
    string); relay its status, headers and body bytes as they arrive."""
    headers = {
        name: value for name, value in request.headers.items() if name not in _NOT_FORWARDED
    }
    # No compression the client did not ask for (the body is relayed as it comes).
    headers["accept-encoding"] = request.headers.get("accept-encoding", "identity")
    if request.url.query:
        path = f"{path}?{request.url.query}"
    try:
        response = await upstream.open_stream(method, path, content, headers)
    except TargetError as exc:
        raise upstream_error(exc, metrics) from exc
    relayed = EventStream(_relay_body(response, metrics), status_code=response.status_code)
    relayed.raw_headers = [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in response.headers.multi_items()
        if name.lower() not in _NOT_RETURNED
    ]
    return relayed


async def _relay_body(response: httpx.Response, metrics: ServerMetrics) -> AsyncIterator[bytes]:
    try:
        # The body's chunks as the transport reads them (`aiter_raw` would add a layer
        # per chunk); closed below.
        async for chunk in response.stream:  # type: ignore[union-attr]
            yield chunk
    except httpx.HTTPError as exc:
        # Headers are gone already: an SSE client gets an error event and [DONE].
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            kind = "timeout" if isinstance(exc, httpx.TimeoutException) else "network"
            metrics.upstream_errors.labels(kind).inc()
            yield sse(
                error_body(f"upstream error: {type(exc).__name__}: {exc}", "upstream_error", 502)
            )
            yield sse("[DONE]")
    finally:
        await response.aclose()
