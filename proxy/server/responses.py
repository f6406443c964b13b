"""OpenAI-compatible response bodies and stream chunks (the shapes vLLM sends), plus
`usage` with DDTree's own statistics under `usage.ddtree`."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from proxy.ab.measure import speculative_decoding
from proxy.decoding import GenerationStats
from proxy.server.request_models import Endpoint


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <compact JSON or [DONE]>`."""
    data = (
        payload
        if isinstance(payload, str)
        else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {data}\n\n".encode()


def ddtree_usage(stats: GenerationStats) -> dict[str, Any]:
    return {
        "rounds": stats.rounds,
        "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
        "upstream_calls": stats.upstream_calls,
        "verify_prompt_tokens": stats.verify_prompt_tokens,
        "plain_tokens": stats.plain_tokens,
        "plain_calls": stats.plain_calls,
        "switches_to_plain": stats.switches_to_plain,
        "switches_to_speculation": stats.switches_to_speculation,
        "draft_calls": stats.draft_calls,
        "draft_failures": stats.draft_failures,
        "speculative_decoding": speculative_decoding(stats),
    }


def usage_body(
    num_prompt_tokens: int, num_completion_tokens: int, stats: GenerationStats | None
) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }
    if stats is not None:
        usage["ddtree"] = ddtree_usage(stats)
    return usage


def _finite(logprob: float) -> float:
    # JSON has no -inf; vLLM reports such log-probs as -9999.0 too.
    return logprob if math.isfinite(logprob) else -9999.0


@dataclass(frozen=True)
class Choice:
    """What one choice carries: the output so far (a body) or one round's part (a chunk)."""

    text: str
    token_ids: list[int]
    token_strings: list[str]  # each token's own text, for logprobs (empty if not asked)
    logprobs: list[float]
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class ResponseWriter:
    """Builds the response body, or the stream chunks, of one served request."""

    endpoint: Endpoint
    model: str
    request_id: str
    return_token_ids: bool
    want_logprobs: bool
    created: int = 0
    id: str = field(init=False)
    _text_offset: int = field(init=False, default=0)  # completions logprobs: next token's start

    def __post_init__(self) -> None:
        self.created = self.created or int(time.time())
        prefix = "cmpl-" if self.endpoint == "completions" else "chatcmpl-"
        self.id = prefix + self.request_id

    @staticmethod
    def new_request_id() -> str:
        return uuid.uuid4().hex

    def _logprobs(self, token_strings: list[str], logprobs: list[float]) -> dict | None:
        if not self.want_logprobs:
            return None
        if self.endpoint == "chat":
            return {
                "content": [
                    {
                        "token": token,
                        "logprob": _finite(logprob),
                        "bytes": list(token.encode("utf-8")),
                        "top_logprobs": [],
                    }
                    for token, logprob in zip(token_strings, logprobs, strict=True)
                ]
            }
        offsets = []
        for token in token_strings:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {
            "text_offset": offsets,
            "token_logprobs": [_finite(lp) for lp in logprobs],
            "tokens": token_strings,
            "top_logprobs": [
                {token: _finite(lp)} for token, lp in zip(token_strings, logprobs, strict=True)
            ],
        }

    def _choice(self, out: Choice, stream: bool) -> dict[str, Any]:
        text = out.text
        choice: dict[str, Any] = {"index": 0}
        if self.endpoint == "completions":
            choice["text"] = text
        elif stream:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        choice["logprobs"] = self._logprobs(out.token_strings, out.logprobs)
        choice["finish_reason"] = out.finish_reason
        choice["stop_reason"] = out.stop_reason
        if self.return_token_ids:
            choice["token_ids"] = out.token_ids
        return choice

    def response(
        self, out: Choice, prompt_ids: list[int], usage: dict[str, Any]
    ) -> dict[str, Any]:
        choice = self._choice(out, stream=False)
        body: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion" if self.endpoint == "completions" else "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }
        if self.return_token_ids:
            if self.endpoint == "completions":
                choice["prompt_token_ids"] = prompt_ids
            else:
                body["prompt_token_ids"] = prompt_ids
        return body

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion"
            if self.endpoint == "completions"
            else "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def first_chunk(self, prompt_ids: list[int]) -> dict[str, Any] | None:
        """Chat streams open with the assistant role (and the prompt ids if asked)."""
        if self.endpoint != "chat":
            return None
        chunk = self._chunk(
            [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
        if self.return_token_ids:
            chunk["prompt_token_ids"] = prompt_ids
        return chunk

    def chunk(
        self,
        out: Choice,
        prompt_ids: list[int] | None = None,
        usage: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice = self._choice(out, stream=True)
        if prompt_ids is not None and self.return_token_ids and self.endpoint == "completions":
            choice["prompt_token_ids"] = prompt_ids
        chunk = self._chunk([choice])
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage
        return chunk
