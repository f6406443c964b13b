"""Serving one OpenAI-style generation request, in engine or proxy mode.

Every generation request is either served by the one decoding loop
(`proxy.decoding.stream_generate`) or, in proxy mode, passed to vLLM unchanged: when
it asks for something DDTree cannot reproduce losslessly (see `proxy.api`), when it
opts out (`"ddtree": {"enabled": false}` or header `x-ddtree: off`), or when it names
another model than the one DDTree verifies against. Errors follow OpenAI's shape; an
upstream failure is a 502 (504 on timeout), or mid-stream an error event then [DONE].
Tokens reach the client only after the target verified them, so a failure can cut a
response short but never emit a wrong or duplicated token.

Hardening (docs/RELIABILITY.md): bodies over `max_body_bytes` get a 413; at most
`max_active` generations run and `max_queue` wait, beyond which a 429 with Retry-After;
each generation has a deadline (`request_timeout`: 504, or mid-stream an error event);
a client that goes away mid-stream cancels its generation at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

import httpx
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Receive, Scope, Send

from proxy.api import REQUEST_MODELS, Endpoint, RequestError, error_body
from proxy.backend.base import TargetError
from proxy.config import ServerSettings
from proxy.decoding import Delta, GenerationStats, stream_generate
from proxy.metrics import ServerMetrics
from proxy.passthrough import relay, sse, upstream_error
from proxy.planning import Plan, opted_out, plan_request
from proxy.responses import usage_body
from proxy.service import Service, build_service

logger = logging.getLogger("ddtree_proxy.serving")

PATHS: dict[Endpoint, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class Serving:
    """Route handlers; `service` is set when the app starts."""

    def __init__(self, settings: ServerSettings, service: Service | None):
        self.settings = settings
        self._service = service
        self._owns_service = False
        self.metrics = ServerMetrics()
        self.admission = Admission(settings.max_active, settings.max_queue, self.metrics)

    async def start(self, transport: httpx.AsyncBaseTransport | None = None) -> None:
        """Build the service unless one was given (so it lives in the server's loop)."""
        if self._service is None:
            self._service = await build_service(self.settings, transport)
            self._owns_service = True
        upstream = self._service.upstream
        if upstream is not None:
            retries = self.metrics.upstream_retries
            upstream.on_retry = lambda kind: retries.labels(kind).inc()

    async def stop(self) -> None:
        if self._owns_service and self._service is not None:
            await self._service.aclose()
            self._service = None

    @property
    def service(self) -> Service:
        if self._service is None:
            raise RequestError("server is starting", status=503, err_type="service_unavailable")
        return self._service

    # ----- generation -------------------------------------------------------------

    async def generate(self, request: Request, endpoint: Endpoint) -> Response:
        deadline = asyncio.get_running_loop().time() + self.settings.request_timeout
        raw = await self._read_body(request)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        service = self.service
        disabled = opted_out(request, body)
        request_model = REQUEST_MODELS[endpoint]
        reason = request_model.passthrough_reason(body)
        model = body.get("model")
        if service.mode == "proxy":
            if reason is None and model is not None and model != service.model_name:
                reason = "model"  # e.g. a LoRA adapter: not the target DDTree verifies
            if disabled or reason is not None:
                return await self.passthrough(
                    request, endpoint, raw, body, reason="opt_out" if disabled else reason
                )
        parsed = request_model.parse(body)
        if service.mode == "engine":
            if parsed.model is not None and parsed.model != service.model_name:
                raise RequestError(
                    f"The model `{parsed.model}` does not exist.",
                    param="model",
                    status=404,
                    err_type="NotFoundError",
                )
            if reason is not None:
                raise RequestError(
                    f"{reason}: DDTree cannot serve this request losslessly, and engine mode "
                    "has no upstream server to pass it to",
                    param=reason,
                )
        release = await self.admission.acquire(deadline)
        try:
            async with asyncio.timeout_at(deadline):
                plan = await plan_request(
                    service, self.settings, request, endpoint, parsed, disabled=disabled
                )
            if plan.stream:
                response = await self._stream(plan, deadline)
                response.on_close = release  # the stream holds its slot until it ends
                release = None
                return response
            return await self._complete(plan, deadline)
        except TargetError as exc:
            raise upstream_error(exc, self.metrics) from None
        except TimeoutError:
            raise self._deadline_error() from None
        finally:
            if release is not None:
                release()

    async def _read_body(self, request: Request) -> bytes:
        """The body, or a 413 as soon as it is known to pass `max_body_bytes`."""
        limit = self.settings.max_body_bytes
        too_large = RequestError(
            f"request body is larger than the limit of {limit} bytes",
            status=413,
            err_type="request_too_large",
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            self.metrics.rejected.labels("body_too_large").inc()
            raise too_large
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                self.metrics.rejected.labels("body_too_large").inc()
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _deadline_error(self) -> RequestError:
        self.metrics.deadline_exceeded.inc()
        return RequestError(
            f"request deadline of {self.settings.request_timeout:g} s exceeded "
            "(server setting request_timeout)",
            status=504,
            err_type="timeout_error",
        )

    async def _rounds(self, plan: Plan, stats: GenerationStats) -> AsyncIterator[Delta]:
        """The decoding loop, recording per-round metrics as it goes."""
        metrics = self.metrics
        detokenize = self.service.detokenizer(plan.skip_special_tokens)
        generation = stream_generate(
            plan.target, self.service.drafter, plan.generation, detokenize, stats
        )
        seen_draft = seen_verify = 0.0
        seen_calls = 0
        last_token: int | None = None
        try:
            async for delta in generation:
                metrics.rounds.inc()
                metrics.acceptance_length.observe(stats.acceptance_lengths[-1])
                draft = stats.draft_s + stats.tree_s
                metrics.draft_seconds.observe(draft - seen_draft)
                metrics.verify_seconds.observe(stats.verify_s - seen_verify)
                metrics.upstream_calls.inc(stats.upstream_calls - seen_calls)
                metrics.generated_tokens.inc(len(delta.token_ids))
                seen_draft, seen_verify, seen_calls = draft, stats.verify_s, stats.upstream_calls
                last_token = delta.token_ids[-1] if delta.token_ids else last_token
                finish = delta.finish_reason
                if finish is not None and not (
                    finish == "stop" and self._cut_by_stop_string(plan, last_token)
                ):
                    # vLLM's incremental detokenizer holds back a trailing U+FFFD (an
                    # unfinished UTF-8 sequence waits for the next token), and at the end
                    # of the output no next token comes: it never shows. A stop string
                    # after it would have shown it, so that case keeps it.
                    delta = dataclasses.replace(delta, text=delta.text.rstrip("\ufffd"))
                yield delta
        finally:
            await generation.aclose()

    @staticmethod
    def _cut_by_stop_string(plan: Plan, last_token: int | None) -> bool:
        """Did a stop string end the output? (A stop token is never part of the text, so
        an output cut at a stop string does not end on one.)"""
        generation = plan.generation
        stop_tokens = set(generation.stop_token_ids)
        if not generation.ignore_eos:
            stop_tokens.update(plan.target.eos_token_ids)
        return bool(generation.stop) and last_token not in stop_tokens

    async def _stop_reason(
        self, plan: Plan, token_ids: list[int], text: str, finish_reason: str
    ) -> int | str | None:
        """vLLM's stop_reason: the stop_token_id or stop string that ended the output."""
        if finish_reason != "stop" or not token_ids:
            return None
        generation = plan.generation
        last = token_ids[-1]
        if last in generation.stop_token_ids:
            return last
        if last in plan.target.eos_token_ids and not generation.ignore_eos:
            return None
        if generation.stop:
            full = await self.service.detokenizer(plan.skip_special_tokens)(token_ids)
            tail = full[len(text) :]
            return next((s for s in generation.stop if tail.startswith(s)), None) or next(
                (s for s in generation.stop if s in tail), None
            )
        return None

    async def _complete(self, plan: Plan, deadline: float) -> Response:
        stats = GenerationStats()
        token_ids: list[int] = []
        logprobs: list[float] = []
        text = ""
        finish_reason = "length"
        async with asyncio.timeout_at(deadline), aclosing(self._rounds(plan, stats)) as rounds:
            async for delta in rounds:
                token_ids.extend(delta.token_ids)
                logprobs.extend(delta.logprobs or [])
                text += delta.text
                finish_reason = delta.finish_reason or finish_reason
            stop_reason = await self._stop_reason(plan, token_ids, text, finish_reason)
            strings = (
                await self.service.tokens.token_strings(token_ids)
                if plan.writer.want_logprobs
                else []
            )
        self.metrics.requests.labels(plan.endpoint, "ddtree").inc()
        usage = usage_body(len(plan.generation.prompt_ids), len(token_ids), stats)
        body = plan.writer.response(
            text,
            plan.generation.prompt_ids,
            token_ids,
            strings,
            logprobs,
            finish_reason,
            stop_reason,
            usage,
        )
        return JSONResponse(body)

    async def _stream(self, plan: Plan, deadline: float) -> "_ClosingStream":
        stats = GenerationStats()
        rounds = self._rounds(plan, stats)
        # The first round runs before the response starts, so a request that fails
        # at once (upstream down, bad prompt) gets a real HTTP error status.
        try:
            async with asyncio.timeout_at(deadline):
                first = await anext(rounds)
        except ValueError as exc:
            await rounds.aclose()
            raise RequestError(str(exc)) from None
        except BaseException:
            await rounds.aclose()
            raise
        self.metrics.requests.labels(plan.endpoint, "ddtree").inc()
        return _ClosingStream(
            self._events(plan, stats, first, rounds, deadline), media_type="text/event-stream"
        )

    async def _events(
        self,
        plan: Plan,
        stats: GenerationStats,
        first: Delta,
        rounds: AsyncIterator[Delta],
        deadline: float,
    ) -> AsyncIterator[bytes]:
        writer = plan.writer
        prompt_ids = plan.generation.prompt_ids
        num_tokens = 0
        sent_prompt_ids = False
        text = ""
        token_ids: list[int] = []
        try:
            opening = writer.first_chunk(prompt_ids)
            if opening is not None:
                yield sse(opening)
            delta: Delta | None = first
            while delta is not None:
                num_tokens += len(delta.token_ids)
                token_ids.extend(delta.token_ids)
                text += delta.text
                finish = delta.finish_reason
                if delta.token_ids or delta.text or finish is not None:
                    strings = (
                        await self.service.tokens.token_strings(delta.token_ids)
                        if writer.want_logprobs
                        else []
                    )
                    stop_reason = (
                        await self._stop_reason(plan, token_ids, text, finish) if finish else None
                    )
                    usage = None
                    if plan.continuous_usage or (finish is not None and not plan.include_usage):
                        usage = usage_body(len(prompt_ids), num_tokens, stats)
                    yield sse(
                        writer.chunk(
                            delta.text,
                            delta.token_ids,
                            strings,
                            delta.logprobs or [],
                            finish,
                            stop_reason,
                            prompt_ids=None if sent_prompt_ids else prompt_ids,
                            usage=usage,
                        )
                    )
                    sent_prompt_ids = True
                async with asyncio.timeout_at(deadline):
                    delta = await anext(rounds, None)
            if plan.include_usage:
                yield sse(writer.usage_chunk(usage_body(len(prompt_ids), num_tokens, stats)))
        except TargetError as exc:
            error = upstream_error(exc, self.metrics)
            yield sse(error.body())
        except TimeoutError:
            yield sse(self._deadline_error().body())
        except asyncio.CancelledError:
            # The client went away (Starlette cancels the stream on http.disconnect):
            # the generation stops here, mid-round, with no further upstream call.
            self.metrics.client_disconnects.inc()
            raise
        except Exception as exc:  # the stream has started: report, then end it cleanly
            logger.exception("generation failed mid-stream")
            yield sse(error_body(f"internal error: {exc}", "internal_error", 500))
        finally:
            await rounds.aclose()
        yield sse("[DONE]")

    # ----- pass-through -----------------------------------------------------------

    async def passthrough(
        self, request: Request, endpoint: Endpoint, raw: bytes, body: dict[str, Any], reason: str
    ) -> Response:
        """Send the request to vLLM unchanged (less our `ddtree` field); relay its answer,
        status and body bytes, streaming included."""
        self.metrics.passthroughs.labels(reason).inc()
        self.metrics.requests.labels(endpoint, "passthrough").inc()
        if "ddtree" in body:
            raw = json.dumps(
                {key: value for key, value in body.items() if key != "ddtree"}
            ).encode()
        upstream = self.service.upstream
        assert upstream is not None
        return await relay(upstream, self.metrics, request, "POST", PATHS[endpoint], raw)

    # ----- other routes -----------------------------------------------------------

    async def models(self, request: Request) -> Response:
        service = self.service
        if service.mode == "proxy":
            assert service.upstream is not None
            return await relay(service.upstream, self.metrics, request, "GET", "/v1/models", None)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": service.model_name,
                        "object": "model",
                        "created": service.created,
                        "owned_by": "ddtree-proxy",
                        "root": service.model_name,
                        "max_model_len": service.max_model_len,
                    }
                ],
            }
        )

    async def health(self) -> Response:
        if self._service is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        healthy, body = await self._service.health()
        return JSONResponse(body, status_code=200 if healthy else 503)

    def metrics_text(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


class _ClosingStream(StreamingResponse):
    """A streaming response that calls `on_close` when it is done with, however it ends
    (finished, failed, client gone, or never started)."""

    on_close: Callable[[], None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()


class Admission:
    """At most `max_active` generations at once and `max_queue` more waiting for a slot;
    beyond that a request is refused at once with 429 and Retry-After, so a burst costs
    a bounded amount of memory instead of an unbounded queue."""

    def __init__(self, max_active: int, max_queue: int, metrics: ServerMetrics):
        self.max_active = max_active
        self.max_queue = max_queue
        self.metrics = metrics
        self._slots = asyncio.Semaphore(max_active)
        self._num_waiting = 0

    async def acquire(self, deadline: float) -> Callable[[], None]:
        """Wait for a slot (until `deadline`: TimeoutError); returns its idempotent release."""
        if self._slots.locked() and self._num_waiting >= self.max_queue:
            self.metrics.rejected.labels("queue_full").inc()
            raise RequestError(
                f"server busy: {self.max_active} requests running and {self._num_waiting} "
                "waiting (server settings max_active, max_queue); retry later",
                status=429,
                err_type="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        self._num_waiting += 1
        self.metrics.queued.inc()
        try:
            async with asyncio.timeout_at(deadline):
                await self._slots.acquire()
        finally:
            self._num_waiting -= 1
            self.metrics.queued.dec()
        self.metrics.active.inc()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._slots.release()
                self.metrics.active.dec()

        return release
