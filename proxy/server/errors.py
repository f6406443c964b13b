"""Client-visible errors in OpenAI's shape (`{"error": {message, type, param, code}}`),
and the client's view of a failed upstream call."""

from __future__ import annotations

from typing import Any

from proxy.backend.base import TargetError
from proxy.server.metrics import ServerMetrics


class RequestError(Exception):
    """A client-visible error, rendered as an OpenAI-style error body."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        err_type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.err_type = err_type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.status, self.param)


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def upstream_error(exc: TargetError, metrics: ServerMetrics) -> RequestError:
    """504 on timeout, else 502 -- except that vLLM refusing what the client sent (a 4xx
    other than 401/403/429, e.g. a token id it does not know) stays that 4xx: it is the
    request's fault, not the upstream's."""
    status = exc.status
    if exc.kind == "http" and status is not None and 400 <= status < 500:
        if status not in (401, 403, 429):
            metrics.upstream_errors.labels("refused").inc()
            return RequestError(f"upstream refused the request: {exc}", status=status)
    metrics.upstream_errors.labels(exc.kind).inc()
    return RequestError(
        f"upstream error ({exc.kind}): {exc}",
        status=504 if exc.kind == "timeout" else 502,
        err_type="upstream_error",
    )
