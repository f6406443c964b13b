"""Serving a planned generation request: the one decoding loop
(`proxy.decoding.stream_generate`) turned into an OpenAI response body or an SSE
stream, with per-round metrics.

Tokens reach the client only after the target verified them, so a failure can cut a
response short but never emit a wrong or duplicated token. The first round runs
before a stream's response starts, so a request that fails at once gets a real HTTP
error status; later failures become an error event followed by [DONE].
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import AsyncIterator, Callable

from fastapi import Response
from fastapi.responses import JSONResponse

from proxy.ab.measure import RequestTiming
from proxy.backend.base import TargetError
from proxy.decoding import GenerationStats, stream_generate
from proxy.output import Delta, logprob_token_strings
from proxy.runtime import Runtime
from proxy.server.admission import ClosingStream
from proxy.server.errors import RequestError, error_body, upstream_error
from proxy.server.metrics import ServerMetrics
from proxy.server.plan import Plan
from proxy.server.responses import Choice, sse, usage_body

logger = logging.getLogger("ddtree_proxy.server")


class Responder:
    def __init__(
        self,
        runtime: Runtime,
        metrics: ServerMetrics,
        deadline_error: Callable[[], RequestError],
        timing: RequestTiming | None = None,
    ):
        self.runtime = runtime
        self.metrics = metrics
        self.deadline_error = deadline_error
        self.timing = timing  # the A/B record of what the client sees (`proxy.ab.measure`)

    async def _rounds(self, plan: Plan, stats: GenerationStats) -> AsyncIterator[Delta]:
        """The decoding loop, recording each round in `stats` and the metrics."""
        runtime, metrics = self.runtime, self.metrics
        generation = stream_generate(
            runtime.target,
            runtime.drafter,
            plan.generation,
            runtime.detokenizer(plan.skip_special_tokens),
            runtime.policy,
        )
        try:
            async for delta in generation:
                done = delta.round
                assert done is not None
                stats.add(done)
                metrics.observe(done, len(delta.token_ids))
                if self.timing is not None:
                    self.timing.round(done)
                    self.timing.finish_reason = delta.finish_reason
                    if plan.stream:  # a JSON answer's tokens go out at its end
                        self.timing.tokens(len(delta.token_ids))
                yield delta
        finally:
            await generation.aclose()

    async def _token_strings(
        self, plan: Plan, token_ids: list[int], context_ids: list[int]
    ) -> list[str]:
        """Each token's text for logprobs; in proxy mode as vLLM reports it
        (`logprob_token_strings`)."""
        tokens = self.runtime.tokens
        strings = await tokens.token_strings(token_ids)
        if not plan.mirror_vllm:
            return strings

        async def decode(ids: list[int]) -> str:
            return await tokens.decode(ids, False)  # vLLM's tokenizer.decode default

        return await logprob_token_strings(decode, strings, token_ids, context_ids)

    async def complete(self, plan: Plan, deadline: float) -> Response:
        stats = GenerationStats()
        token_ids: list[int] = []
        logprobs: list[float] = []
        text = ""
        finish_reason, stop_reason = "length", None
        async with asyncio.timeout_at(deadline), aclosing(self._rounds(plan, stats)) as rounds:
            async for delta in rounds:
                token_ids.extend(delta.token_ids)
                logprobs.extend(delta.logprobs or [])
                text += delta.text
                if delta.finish_reason is not None:
                    finish_reason, stop_reason = delta.finish_reason, delta.stop_reason
            strings = (
                await self._token_strings(plan, token_ids, []) if plan.writer.want_logprobs else []
            )
        self.metrics.requests.labels(plan.endpoint, "ddtree").inc()
        usage = usage_body(len(plan.generation.prompt_ids), len(token_ids), stats)
        out = Choice(text, token_ids, strings, logprobs, finish_reason, stop_reason)
        body = plan.writer.response(out, plan.generation.prompt_ids, usage)
        if self.timing is not None:
            self.timing.tokens(len(token_ids))
        return JSONResponse(body)

    async def stream(self, plan: Plan, deadline: float) -> ClosingStream:
        stats = GenerationStats()
        rounds = self._rounds(plan, stats)
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
        return ClosingStream(
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
        try:
            opening = writer.first_chunk(prompt_ids)
            if opening is not None:
                yield sse(opening)
            delta: Delta | None = first
            emitted: list[int] = []  # tokens sent so far (context for logprob texts)
            while delta is not None:
                num_tokens += len(delta.token_ids)
                finish = delta.finish_reason
                if delta.token_ids or delta.text or finish is not None:
                    strings = (
                        await self._token_strings(plan, delta.token_ids, emitted)
                        if writer.want_logprobs
                        else []
                    )
                    usage = None
                    if plan.continuous_usage or (
                        finish is not None and not plan.mirror_vllm and not plan.include_usage
                    ):
                        usage = usage_body(len(prompt_ids), num_tokens, stats)
                    out = Choice(
                        delta.text,
                        delta.token_ids,
                        strings,
                        delta.logprobs or [],
                        finish,
                        delta.stop_reason,
                    )
                    first_ids = None if sent_prompt_ids else prompt_ids
                    yield sse(writer.chunk(out, prompt_ids=first_ids, usage=usage))
                    sent_prompt_ids = True
                    emitted.extend(delta.token_ids)
                async with asyncio.timeout_at(deadline):
                    delta = await anext(rounds, None)
            if plan.include_usage:
                yield sse(writer.usage_chunk(usage_body(len(prompt_ids), num_tokens, stats)))
        except TargetError as exc:
            yield sse(upstream_error(exc, self.metrics).body())
        except TimeoutError:
            yield sse(self.deadline_error().body())
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
