"""The route handlers: what each HTTP request does.

A generation request is either served by the one decoding loop (through
`proxy.server.generation.Responder`) or, where the runtime has an upstream (proxy
mode), passed to vLLM unchanged: when it asks for something DDTree cannot reproduce
losslessly (see `proxy.server.request_models`) or leaves such a server default in force
(`proxy.generation_defaults`), when it opts out (`"ddtree": {"enabled": false}` or
header `x-ddtree: off`), or when it names another model than the one DDTree verifies
against. Without an upstream (engine mode) such requests are refused with a 400 naming
the field. Every other route vLLM serves is relayed as it is (`relay_route`). Errors
follow OpenAI's shape; an upstream failure is a 502 (504 on timeout).

Hardening (docs/RELIABILITY.md): bodies over `max_body_bytes` get a 413 (after the
body has been drained, so the client receives it); at most
`max_active` generations run and `max_queue` wait, beyond which a 429 with Retry-After;
each generation has a deadline (`request_timeout`: 504, or mid-stream an error event);
a client that goes away mid-stream cancels its generation at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator

import httpx
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.ab.measure import RequestTiming
from proxy.backend.base import TargetError
from proxy.runtime import Runtime, build_runtime
from proxy.server.ab import AB, ARM_HEADER
from proxy.server.admission import Admission
from proxy.server.errors import RequestError, upstream_error
from proxy.server.generation import Responder
from proxy.server.metrics import (
    DrafterCollector,
    PolicyCollector,
    ServerMetrics,
    UpstreamCallsCollector,
)
from proxy.server.passthrough import relay
from proxy.server.plan import PATHS, opted_out, plan_request
from proxy.server.replica_metrics import ReplicasCollector
from proxy.server.request_models import (
    REQUEST_MODELS,
    Endpoint,
    out_of_range_integer,
)
from proxy.server.responses import sse
from proxy.server.settings import ServerSettings
from proxy.server.streams import EventStream

DRAIN_FACTOR = 16  # an oversized body is read (and dropped) up to this many times the limit
DRAIN_TIMEOUT_S = 30.0  # ... and for at most this long


class Handlers:
    """Route handlers; `runtime` is set when the app starts."""

    def __init__(self, settings: ServerSettings, runtime: Runtime | None):
        self.settings = settings
        self._runtime = runtime
        self._owns_runtime = False
        self.metrics = ServerMetrics()
        self.admission = Admission(settings.max_active, settings.max_queue, self.metrics)
        self.ab = AB(settings)

    async def start(self, transport: httpx.AsyncBaseTransport | None = None) -> None:
        """Build the runtime unless one was given (so it lives in the server's loop)."""
        if self._runtime is None:
            self._runtime = await build_runtime(self.settings, transport)
            self._owns_runtime = True
        self.metrics.registry.register(PolicyCollector(self._runtime.policy))
        drafter = self._runtime.drafter
        if drafter is not None and drafter.counters() is not None:
            # A served drafter counts its own calls and failures.
            self.metrics.registry.register(DrafterCollector(drafter.counters))
        if self._runtime.mode == "proxy":
            upstream = self._runtime.upstream
            retries = self.metrics.upstream_retries
            upstream.on_retry = lambda kind: retries.labels(kind).inc()
            self.metrics.registry.register(UpstreamCallsCollector(upstream.num_calls))
        if self._runtime.replicas is not None:
            collector = ReplicasCollector(self._runtime.replicas, self._runtime.policy)
            self.metrics.registry.register(collector)
        await self.ab.start(self._runtime, self.metrics.registry)

    async def stop(self) -> None:
        await self.ab.stop()
        if self._owns_runtime and self._runtime is not None:
            await self._runtime.aclose()
            self._runtime = None

    @property
    def runtime(self) -> Runtime:
        if self._runtime is None:
            raise RequestError("server is starting", status=503, err_type="service_unavailable")
        return self._runtime

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
        too_large = out_of_range_integer(body, raw)
        if too_large is not None:
            raise RequestError(
                f"{too_large}: the integer is outside the 64-bit range", param=too_large
            )
        runtime = self.runtime
        disabled = opted_out(request, body)
        compared = True  # engine mode: no split
        request_model = REQUEST_MODELS[endpoint]
        reason = request_model.passthrough_reason(body)
        model = body.get("model")
        if runtime.mode == "proxy":
            if reason is None and model is not None and model != runtime.model_name:
                reason = "model"  # e.g. a LoRA adapter: not the target DDTree verifies
            if reason is None:
                # A default penalty over output tokens that the request leaves in force.
                reason = runtime.generation_defaults.passthrough_reason(body)
            if reason is not None:  # outside the A/B experiment: DDTree cannot serve it
                response = await self.passthrough(
                    request, endpoint, raw, body, reason="opt_out" if disabled else reason
                )
                response.headers[ARM_HEADER] = "passthrough"
                return response
            arm, compared = self.ab.arm(request, body, disabled)
            if arm == "direct":
                label = "opt_out" if disabled else "ab_split"

                async def relay_body(sent: dict[str, Any]) -> Response:
                    same = sent is body
                    return await self.passthrough(
                        request, endpoint, raw if same else None, sent, reason=label
                    )

                return await self.ab.direct(
                    relay_body, body, endpoint, RequestTiming("direct", compared=compared),
                    runtime,
                )
        timing = RequestTiming("ddtree", compared=compared)
        parsed = request_model.parse(body, refuse_unknown=runtime.mode == "engine")
        if parsed.model is not None and parsed.model != runtime.model_name:
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
        responder = Responder(runtime, self.metrics, self._deadline_error, timing)
        release = await self.admission.acquire(deadline)
        try:
            async with asyncio.timeout_at(deadline):
                plan = await plan_request(
                    runtime, self.settings, request, endpoint, parsed, disabled=disabled,
                    client_body=body if runtime.mode == "proxy" else None,
                )  # fmt: skip
            if plan.stream:
                # The first round (and with it vLLM's verdict on the client's parameters)
                # completes before the response starts.
                response = await responder.stream(plan, deadline)
                # The stream holds its slot until it ends.
                response.on_close.append(lambda complete, release=release: release())
                release = None
                return self.ab.watch(response, timing)
            return self.ab.watch(await responder.complete(plan, deadline), timing)
        except TargetError as exc:
            refusal = upstream_error(exc, self.metrics)
        except RequestError as exc:
            refusal = exc
        except TimeoutError:
            raise self._deadline_error() from None
        finally:
            if release is not None:
                release()
        if parsed.stream and refusal.in_stream:
            return _refused_stream(refusal)
        raise refusal

    async def _read_body(self, request: Request) -> bytes:
        """The body, or a 413 once it is known to pass `max_body_bytes`.

        The rest of an oversized body is read and dropped (up to DRAIN_FACTOR times the
        limit, for at most DRAIN_TIMEOUT_S) before the 413 goes out with
        `Connection: close`: a server that closes a socket with unread data makes the
        kernel reset the connection, and a client still sending its body would see that
        reset instead of the 413."""
        limit = self.settings.max_body_bytes
        too_large = RequestError(
            f"request body is larger than the limit of {limit} bytes",
            status=413,
            err_type="request_too_large",
            headers={"Connection": "close"},
        )
        declared = request.headers.get("content-length", "")
        chunks: list[bytes] = []
        size = 0
        stream = request.stream()
        if not (declared.isdigit() and int(declared) > limit):
            async for chunk in stream:
                size += len(chunk)
                if size > limit:
                    break
                chunks.append(chunk)
            else:
                return b"".join(chunks)
        self.metrics.rejected.labels("body_too_large").inc()
        # Bounded work: past DRAIN_FACTOR x limit or DRAIN_TIMEOUT_S the client gets the
        # close as it comes.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                async for chunk in stream:
                    size += len(chunk)
                    if size > DRAIN_FACTOR * limit:
                        break
        raise too_large

    def _deadline_error(self) -> RequestError:
        self.metrics.deadline_exceeded.inc()
        return RequestError(
            f"request deadline of {self.settings.request_timeout:g} s exceeded "
            "(server setting request_timeout)",
            status=504,
            err_type="timeout_error",
        )

    # ----- pass-through -----------------------------------------------------------

    async def passthrough(
        self,
        request: Request,
        endpoint: Endpoint,
        raw: bytes | None,
        body: dict[str, Any],
        reason: str,
    ) -> Response:
        """Send the request to vLLM unchanged (less our `ddtree` field; `raw` None: the
        body was changed); relay its answer, status and body bytes, streaming included."""
        self.metrics.passthroughs.labels(reason).inc()
        self.metrics.requests.labels(endpoint, "passthrough").inc()
        if raw is None or "ddtree" in body:
            raw = json.dumps(
                {key: value for key, value in body.items() if key != "ddtree"}
            ).encode()
        upstream = self.runtime.upstream
        return await relay(upstream, self.metrics, request, "POST", PATHS[endpoint], raw)

    # ----- other routes -----------------------------------------------------------

    async def relay_route(self, request: Request) -> Response:
        """Any other route (proxy mode): to vLLM as it is -- method, path, query,
        headers, body -- and its answer back as it is, streaming included; under the
        proxy's body limit, its API key guarding what vLLM's would (`app`)."""
        runtime = self.runtime
        if runtime.mode == "engine":
            raise RequestError("Not Found", status=404, err_type="NotFoundError")
        raw = await self._read_body(request)
        self.metrics.relayed.labels(request.method).inc()
        return await relay(
            runtime.upstream, self.metrics, request, request.method, request.url.path, raw or None
        )

    async def models(self, request: Request) -> Response:
        runtime = self.runtime
        if runtime.mode == "proxy":
            return await relay(runtime.upstream, self.metrics, request, "GET", "/v1/models", None)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": runtime.model_name,
                        "object": "model",
                        "created": runtime.created,
                        "owned_by": "ddtree-proxy",
                        "root": runtime.model_name,
                        "max_model_len": runtime.max_model_len,
                    }
                ],
            }
        )

    async def health(self) -> Response:
        if self._runtime is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        healthy, body = await self._runtime.health()
        return JSONResponse(body, status_code=200 if healthy else 503)

    def metrics_text(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _refused_stream(refusal: RequestError) -> EventStream:
    """A refusal the way vLLM sends it for a streaming request that fails a check of its
    engine (`RequestError.in_stream`): status 200, one error event, [DONE]. The proxy
    knows the verdict before its first byte; it only renders it as vLLM does."""

    async def events() -> AsyncIterator[bytes]:
        yield sse(refusal.body())
        yield sse("[DONE]")

    return EventStream(events(), media_type="text/event-stream")
