"""Proxy mode's pass-through: requests DDTree does not serve go to vLLM as they are,
and vLLM's answer (status, body bytes, streaming) comes back as it is. Also the
mapping of upstream failures to client-visible errors."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

import httpx
from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from proxy.api import RequestError, error_body
from proxy.backend.base import TargetError
from proxy.backend.vllm import VLLMHttp
from proxy.metrics import ServerMetrics


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <compact JSON or [DONE]>`."""
    data = (
        payload
        if isinstance(payload, str)
        else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {data}\n\n".encode()


def upstream_error(exc: TargetError, metrics: ServerMetrics) -> RequestError:
    """The client's view of a failed upstream call: 504 on timeout, else 502 -- except
    that vLLM refusing what the client sent (a 4xx other than 401/403/429, e.g. a token
    id it does not know) stays that 4xx: it is the request's fault, not the upstream's."""
    status = getattr(exc, "status", None)
    if isinstance(status, int) and 400 <= status < 500 and status not in (401, 403, 429):
        metrics.upstream_errors.labels("refused").inc()
        return RequestError(f"upstream refused the request: {exc}", status=status)
    cause = exc.__cause__
    if isinstance(cause, httpx.TimeoutException):
        kind, status = "timeout", 504
    elif isinstance(cause, httpx.ConnectError):
        kind, status = "connect", 502
    elif isinstance(cause, httpx.HTTPError):
        kind, status = "network", 502
    elif "returned HTTP" in str(exc):
        kind, status = "http", 502
    else:
        kind, status = "malformed", 502
    metrics.upstream_errors.labels(kind).inc()
    return RequestError(f"upstream error ({kind}): {exc}", status=status, err_type="upstream_error")


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
    client = upstream.client
    upstream_request = client.build_request(method, path, content=content, headers=headers)
    try:
        response = await client.send(upstream_request, stream=True)
    except httpx.HTTPError as exc:
        error = TargetError(f"vLLM {method} {path} failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc  # upstream_error tells a timeout (504) by the cause
        raise upstream_error(error, metrics) from exc
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
