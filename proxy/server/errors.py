"""Client-visible errors in OpenAI's shape (`{"error": {message, type, param, code}}`),
and the client's view of a failed upstream call."""

from __future__ import annotations

import re
from typing import Any

from proxy.backend.base import TargetError
from proxy.server.metrics import ServerMetrics

# Checks vLLM runs inside its engine client (InputProcessor: `SamplingParams.verify`,
# `Renderer.validate_token_ids`), after a streaming response has started: vLLM answers
# a streaming request that fails them with 200, one error event and [DONE], and a
# non-streaming one with the error status. Identified by the parameter vLLM names, or
# (token ids of the prompt, which name none) by the message.
ENGINE_CHECKED_PARAMS = frozenset(
    {"stop_token_ids", "logprobs", "prompt_logprobs", "logit_bias", "allowed_token_ids"}
)
_OUT_OF_VOCABULARY = re.compile(r"Token id -?\d+ is out of vocabulary")


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

    @property
    def in_stream(self) -> bool:
        """vLLM reports this refusal inside a started stream (ENGINE_CHECKED_PARAMS)."""
        return self.param in ENGINE_CHECKED_PARAMS or bool(_OUT_OF_VOCABULARY.search(self.message))

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
            if exc.error is not None:
                # vLLM judged the client's own parameters: its verdict, as it gave it.
                return RequestError(
                    exc.error["message"],
                    param=exc.error.get("param"),
                    status=status,
                    err_type=str(exc.error.get("type") or "BadRequestError"),
                )
            return RequestError(f"upstream refused the request: {exc}", status=status)
    metrics.upstream_errors.labels(exc.kind).inc()
    return RequestError(
        f"upstream error ({exc.kind}): {exc}",
        status=504 if exc.kind == "timeout" else 502,
        err_type="upstream_error",
    )
