"""Proxy mode's pass-through: requests DDTree does not serve go to vLLM as they are,
and vLLM's answer (status, body bytes, streaming) comes back as it is."""

from __future__ import annotations

from typing import AsyncIterator

import httpx
from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from proxy.backend.base import TargetError
from proxy.backend.vllm import VLLMHttp
from proxy.server.errors import error_body, upstream_error
from proxy.server.metrics import ServerMetrics
from proxy.server.responses import sse


async def relay(
    upstream: VLLMHttp,
    metrics: ServerMetrics,
    request: Request,
    method: str,
    path: str,
    content: bytes | None,
) -> Response:
    """Send one request to vLLM as the client sent it; relay its status, headers that
    describe the body, and the body bytes as they arrive."""
    headers = {"accept-encoding": request.headers.get("accept-encoding", "identity")}
    for name in ("content-type", "accept", "x-request-id"):
        if name in request.headers:
            headers[name] = request.headers[name]
    try:
        response = await upstream.open_stream(method, path, content, headers)
    except TargetError as exc:
        raise upstream_error(exc, metrics) from exc
    relayed = {
        name: response.headers[name]
        for name in ("content-type", "content-encoding", "x-request-id")
        if name in response.headers
    }
    return StreamingResponse(
        _relay_body(response, metrics), status_code=response.status_code, headers=relayed
    )


async def _relay_body(response: httpx.Response, metrics: ServerMetrics) -> AsyncIterator[bytes]:
    try:
        async for chunk in response.aiter_raw():
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
