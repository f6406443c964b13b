"""Serving a planned generation request: the one decoding loop
(`proxy.decoding.stream_generate`) turned into an OpenAI response body or an SSE
stream, with per-round metrics.

Tokens reach the client only after the target verified them, so a failure can cut a
response short but never emit a wrong or duplicated token. The first round runs
before a stream's response starts, so a request that fails at once gets a real HTTP
error status; later failures become an error event followed by [DONE].

A streaming request the policy leaves to vLLM from its first token to its end is
handed over (`proxy.decoding.HandOver`): the client's own request goes to vLLM and
vLLM's own events come back to the client (`proxy.server.relayed`), the usage event
with the proxy's statistics added; if the answer breaks, the loop goes on from the
tokens the client has.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from contextlib import aclosing
from typing import AsyncIterator, Callable

from fastapi import Response
from fastapi.responses import JSONResponse

from proxy.ab.measure import RequestTiming
from proxy.backend.base import TargetError
from proxy.decoding import GenerationStats, HandOver, stream_generate
from proxy.output import Delta, logprob_token_strings
from proxy.runtime import Runtime
from proxy.server.errors import RequestError, error_body, upstream_error
from proxy.server.metrics import ServerMetrics
from proxy.server.plan import PATHS, Plan
from proxy.server.relayed import RelayedAnswer
from proxy.server.responses import Choice, ddtree_usage, sse, usage_body
from proxy.server.streams import EventStream

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
                    # A JSON answer's tokens go out at its end; a relayed answer counts
                    # its own as they go (`RelayedAnswer`).
                    if plan.stream and not delta.relayed:
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

    async def stream(self, plan: Plan, deadline: float) -> EventStream:
        stats = GenerationStats()
        rounds = self._rounds(plan, stats)
        answer = None
        try:
            async with asyncio.timeout_at(deadline):
                first = await anext(rounds)
                if first.hand_over is not None:
                    answer = await self._open_relay(plan, first.hand_over)
                    if answer is None:
                        self.metrics.handed_over.labels("unopened").inc()
                        first = await anext(rounds)  # nothing went out: the loop goes on
        except ValueError as exc:
            await rounds.aclose()
            raise RequestError(str(exc)) from None
        except BaseException:
            if answer is not None:
                await answer.aclose()
            await rounds.aclose()
            raise
        self.metrics.requests.labels(plan.endpoint, "ddtree").inc()
        if answer is not None:
            events = self._relayed(plan, stats, answer, first.hand_over, rounds, deadline)
        else:
            events = self._events(plan, stats, first, rounds, deadline)
        return EventStream(events, media_type="text/event-stream")

    async def _open_relay(self, plan: Plan, handed: HandOver) -> RelayedAnswer | None:
        """Send the client's own request to vLLM (with token ids, to count and keep
        them); None, with nothing sent to the client, if no 200 answer came (retries
        included): the loop serves the request, as after a plain stream that failed."""
        assert plan.client_body is not None
        body = {key: value for key, value in plan.client_body.items() if key != "ddtree"}
        body["return_token_ids"] = True
        # The model the proxy's own calls name (vLLM's default may be another, e.g. the
        # base of a --model adapter): an answer that breaks goes on with the same model.
        if body.get("model") is None:
            body["model"] = self.runtime.model_name
        try:
            content = json.dumps(body).encode()
            response = await handed.relay(PATHS[plan.endpoint], content, plan.client_headers)
        except TargetError as exc:
            logger.info("a handed-over request's relay did not open: %s", exc)
            return None
        timing = self.timing
        return RelayedAnswer(
            response,
            handed.sent,
            keep_ids=plan.writer.return_token_ids,
            on_tokens=None if timing is None else timing.tokens,
        )

    async def _relayed(
        self,
        plan: Plan,
        stats: GenerationStats,
        answer: RelayedAnswer,
        handed: HandOver,
        rounds: AsyncIterator[Delta],
        deadline: float,
    ) -> AsyncIterator[bytes]:
        """vLLM's answer to a handed-over request, as it comes; then the loop records it
        and, if it broke, goes on from the tokens the client has (`_events`)."""
        try:
            try:
                async for events in answer.relay(deadline):
                    yield events
                handed.outcome = answer.outcome()
            except TimeoutError:
                yield sse(self.deadline_error().body())
                yield sse("[DONE]")
                return
            except ValueError as exc:  # an event sent cannot be read: no going on
                yield sse(upstream_error(TargetError(str(exc)), self.metrics).body())
                yield sse("[DONE]")
                return
            except asyncio.CancelledError:
                self.metrics.client_disconnects.inc()  # vLLM aborts the closed answer
                raise
            if handed.outcome.complete:
                self.metrics.handed_over.labels("whole").inc()
                async for _ in rounds:  # the loop records the stretch
                    pass
                if answer.usage is not None:  # vLLM's, with the proxy's statistics
                    answer.usage["usage"]["ddtree"] = ddtree_usage(stats)
                    yield sse(answer.usage)
                elif plan.include_usage and not answer.done:
                    # It broke after the last token, before the usage event. (After [DONE]
                    # without one, vLLM sent none: an error event ended the answer.)
                    _keep_names(plan, answer)
                    usage = usage_body(len(plan.generation.prompt_ids),
                                       len(handed.outcome.tokens), stats)  # fmt: skip
                    yield sse(plan.writer.usage_chunk(usage))
                yield sse("[DONE]")
                return
            self.metrics.handed_over.labels("resumed").inc()
            _keep_names(plan, answer)
            logger.info(
                "a relayed answer broke after %d tokens; going on from them",
                len(handed.outcome.tokens),
            )
            events = self._events(plan, stats, None, rounds, deadline, opened=bool(answer.events))
            async for event in events:
                yield event
        finally:
            await answer.aclose()
            await rounds.aclose()

    async def _events(
        self,
        plan: Plan,
        stats: GenerationStats,
        first: Delta | None,
        rounds: AsyncIterator[Delta],
        deadline: float,
        opened: bool = False,
    ) -> AsyncIterator[bytes]:
        """The stream's events from `first` (None: the loop's next delta) on; `opened`:
        a relayed answer sent the first events (the opening chunk, the prompt ids)."""
        writer = plan.writer
        prompt_ids = plan.generation.prompt_ids
        num_tokens = 0
        sent_prompt_ids = opened
        try:
            opening = None if opened else writer.first_chunk(prompt_ids)
            if opening is not None:
                yield sse(opening)
            delta: Delta | None = first
            if delta is None:
                async with asyncio.timeout_at(deadline):
                    delta = await anext(rounds, None)
            emitted: list[int] = []  # tokens sent so far (context for logprob texts)
            while delta is not None:
                num_tokens += len(delta.token_ids)
                finish = delta.finish_reason
                if delta.relayed:  # its tokens went out already; what is due is text
                    emitted.extend(delta.token_ids)
                    delta = dataclasses.replace(delta, token_ids=[])
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


def _keep_names(plan: Plan, answer: RelayedAnswer) -> None:
    """The client's events so far are vLLM's: the proxy's own after them keep their id and
    creation time."""
    names = answer.names()
    if names is not None:
        plan.writer.id, plan.writer.created = names
