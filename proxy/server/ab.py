"""The A/B split over HTTP: which arm answers a request, the arm header on every
generation answer, each answer timed for the report and the per-arm metrics, shadow
replays of direct answers, and the admin and report routes.

Eligible requests -- those DDTree could serve -- are the experiment: the split (or a
forced arm: `x-ddtree: on|off`, a `ddtree` field) sends each to "ddtree" or "direct"
(pass-through). Requests DDTree cannot serve are passed through outside it (arm header
`passthrough`, not in the report). A direct answer's body is the bytes vLLM sent; for
one sampled for a shadow replay, the proxy asked vLLM for token ids and, unless the
client asked for them too, sets those arrays back to `null` in the bytes (as vLLM writes
them when not asked), every other byte as vLLM sent it.

Measuring and shadow hooks run inside the client's response; a failure there is logged
and the answer goes on unchanged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import time
from collections import deque
from typing import Any, AsyncIterator, Callable, Iterable

import numpy as np
from fastapi import Request, Response

from proxy.ab import report
from proxy.ab.measure import MAX_RECORDS, ABMetrics, ArmRecords, RequestRecord, RequestTiming
from proxy.ab.shadow import Pricing, Prober, Shadow, ShadowJob
from proxy.ab.split import ARMS, Arm, Split
from proxy.adaptive.estimates import LinearCost
from proxy.adaptive.policy import Policy
from proxy.drafter.base import Drafter
from proxy.runtime import Runtime
from proxy.server.errors import RequestError
from proxy.server.plan import max_tokens_in_force, requested_max_tokens
from proxy.server.relayed import split_token_ids
from proxy.server.request_models import REQUEST_MODELS, Endpoint
from proxy.server.settings import ServerSettings
from proxy.server.streams import EventStream

logger = logging.getLogger("ddtree_proxy.ab")
ARM_HEADER = "x-ddtree-arm"
KEY_HEADER = "x-ddtree-ab-key"
# The guardrail judges disjoint blocks of finished requests, each once both arms have
# GUARDRAIL_BLOCK of them (from about 20 per arm the rank-sum test's normal
# approximation is close to its exact distribution). The k-th block is judged at level
# GUARDRAIL_ALPHA / (k (k + 1)); those levels sum to GUARDRAIL_ALPHA, so arms of equal
# speed trip it with at most that chance however long a split runs.
GUARDRAIL_BLOCK = 30
GUARDRAIL_ALPHA = 0.05


class AB:
    """The split, the records and the shadow of one server."""

    def __init__(
        self,
        settings: ServerSettings,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not settings.proxy_mode and (settings.ab.ab_split is not None or settings.ab.shadow):
            raise ValueError("--ab-split and --shadow need proxy mode (--target-url): the "
                             "direct arm is the upstream vLLM")  # fmt: skip
        self.settings = settings.ab
        self.split = None if settings.ab.ab_split is None else Split(settings.ab.ab_split, rng)
        self._rng = rng or random.Random()
        self.records = ArmRecords(clock)
        self.metrics: ABMetrics | None = None
        self.shadow: Shadow | None = None
        self._owned: list[Drafter] = []
        self._tree_depth = settings.tree.depth
        self._half_life_s = settings.policy_half_life
        self._proxy_mode = False
        self._policy: Policy | None = None
        self.guardrail_tripped = False
        self.num_forced = 0  # finished requests that forced an arm during a split
        # The guardrail's block being filled (tokens/s per request) and the blocks judged
        # since the split last changed.
        self._block: dict[Arm, deque[float]] = {arm: deque(maxlen=MAX_RECORDS) for arm in ARMS}
        self._num_judged = 0
        self._hooks = _Hooks()

    async def start(self, runtime: Runtime, registry) -> None:
        self.metrics = ABMetrics(registry, runtime.model_name, runtime.max_model_len)
        self._proxy_mode = runtime.mode == "proxy"
        self._policy = runtime.policy
        self._show_split()
        settings = self.settings
        if settings.shadow == 0:
            return
        drafters: dict[str, Drafter] = {}
        if settings.drafter_specs:
            assert runtime.load_drafter is not None
            for spec in settings.drafter_specs:
                drafters[spec] = await runtime.load_drafter(spec)
                self._owned.append(drafters[spec])
        elif runtime.drafter is not None:
            drafters[runtime.drafter.name] = runtime.drafter
        else:
            raise ValueError("--shadow needs a drafter: --shadow-drafters, or serve with one")
        prober = None
        if settings.shadow_probes > 0:
            prober = Prober(runtime.target, settings.shadow_probes,
                            needed=lambda: _fitted(self._policy)[0] is None,
                            half_life_s=self._half_life_s)  # fmt: skip
        self.shadow = Shadow(drafters, settings.budgets, self._tree_depth, settings.shadow_queue,
                             runtime.max_model_len, settings.shadow_busy, prober,
                             self._pricing)  # fmt: skip
        self.shadow.start()

    async def stop(self) -> None:
        if self.shadow is not None:
            await self.shadow.stop()
        for drafter in self._owned:
            await drafter.aclose()

    def _show_split(self) -> None:
        if self.metrics is not None:
            self.metrics.split.set(1.0 if self.split is None else self.split.share)

    # ----- which arm --------------------------------------------------------------

    def arm(self, request: Request, body: dict[str, Any], opted_out: bool) -> tuple[Arm, bool]:
        """The arm of an eligible request (the header and field are validated already),
        and whether the report compares it: while a split runs, only the requests it
        assigned (a client that forces an arm chooses which requests go where, and its
        choice need not be blind to their speed); without a split, every request."""
        forced: Arm | None = None
        header = request.headers.get("x-ddtree", "").strip().lower()
        if opted_out:
            forced = "direct"
        elif header in ("on", "true", "1") or body.get("ddtree") is not None:
            forced = "ddtree"
        if self.split is None:
            return forced or "ddtree", True
        if forced is not None:
            return forced, False
        key = request.headers.get(KEY_HEADER) or body.get("user")
        return self.split.assign(key if isinstance(key, str) else None), True

    def set_split(self, share: float | None) -> None:
        if share is None:
            self.split = None
        elif self.split is None:
            self.split = Split(share, self._rng)
        else:
            self.split.share = share
        for values in self._block.values():  # a new split: a new experiment
            values.clear()
        self._num_judged = 0
        self._show_split()

    def state(self) -> dict[str, Any]:
        return {"split": None if self.split is None else self.split.share,
                "guardrail": {"enabled": self.settings.ab_guardrail,
                              "tripped": self.guardrail_tripped}}  # fmt: skip

    def change(self, raw: bytes) -> dict[str, Any]:
        """The admin route: a new split (0 stops the DDTree arm, null ends the split)."""
        share = split_of(raw)
        if self.metrics is None:
            raise RequestError("server is starting", status=503, err_type="service_unavailable")
        if share is not None and not self._proxy_mode:
            raise RequestError("a split needs proxy mode: engine mode has no direct arm",
                               param="split")  # fmt: skip
        logger.warning("A/B split changed: %s -> %s", self.state()["split"], share)
        self.set_split(share)
        self.guardrail_tripped = False
        return self.state()

    # ----- timing -----------------------------------------------------------------

    def finish(self, timing: RequestTiming, ok: bool) -> None:
        record = timing.record() if ok else None
        assert self.metrics is not None
        self.metrics.observe(timing, record)
        if record is None:
            return
        if not timing.compared:
            self.num_forced += 1
            return
        self.records.add(record)
        self._guard(record)

    def watch(self, response: Response, timing: RequestTiming,
              on_chunk: Callable[[bytes], None] | None = None) -> Response:  # fmt: skip
        """Name the arm on `response`; finish `timing` when its body has gone out
        (`on_chunk` sees each piece first)."""
        response.headers[ARM_HEADER] = timing.arm
        hooks = self._hooks
        ok = response.status_code == 200
        if not isinstance(response, EventStream):
            if on_chunk is not None and ok:
                ok = hooks.run("timing", on_chunk, response.body)
            hooks.run("timing", self.finish, timing, ok)
            return response
        measured = ok  # False after a failed hook: the clock missed tokens

        def chunk_out(chunk: bytes) -> None:
            nonlocal measured
            if measured:
                measured = hooks.run("timing", on_chunk, chunk)

        def closed(complete: bool) -> None:
            hooks.run("timing", self.finish, timing, measured and complete)

        if on_chunk is not None:
            response.on_chunk = chunk_out
        response.on_close.append(closed)
        return response

    # ----- the direct arm ---------------------------------------------------------

    def wants_shadow(self) -> bool:
        return self.shadow is not None and self._rng.random() < self.settings.shadow

    async def direct(
        self,
        relay: Callable[[dict[str, Any]], Any],
        body: dict[str, Any],
        endpoint: Endpoint,
        timing: RequestTiming,
        runtime: Runtime,
    ) -> Response:
        """Pass `body` through (`relay`), timing its answer as it goes out; a sampled
        request asks vLLM for token ids and is queued for a shadow replay."""
        stream = bool(body.get("stream"))
        if not self.wants_shadow():
            response = await relay(body)
            return self.watch(response, timing, _TokenCounter(timing, stream))
        asked = body.get("return_token_ids") is True

        def queue(prompt_ids: list[int], output_ids: list[int]) -> None:
            first = timing.first if stream else None  # a JSON answer's is its whole time
            first_token_s = None if first is None else first - timing.start
            self._queue_replay(prompt_ids, output_ids, body, endpoint, runtime, first_token_s)

        response = await relay(body | {"return_token_ids": True})
        if stream:
            if response.status_code == 200:
                ids = _StreamIds(asked, queue, self._hooks)
                response.body_iterator = ids.relay(response.body_iterator)
                if not asked:  # ids set to null: a length the upstream declared is wrong
                    response.raw_headers = [(name, value) for name, value in response.raw_headers
                                            if name != b"content-length"]  # fmt: skip
            return self.watch(response, timing, _TokenCounter(timing, True))
        chunks = [chunk async for chunk in response.body_iterator]
        content = b"".join(chunks)
        headers = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in response.raw_headers if name != b"content-length"}  # fmt: skip
        if response.status_code == 200:
            self._hooks.run("shadow", _queue_answer, content, queue)
            if not asked:
                content = split_token_ids(content)[0]
        plain = Response(content, status_code=response.status_code, headers=headers)
        return self.watch(plain, timing, _TokenCounter(timing, False))

    def _queue_replay(
        self,
        prompt_ids: list[int],
        output_ids: list[int],
        body: dict[str, Any],
        endpoint: Endpoint,
        runtime: Runtime,
        first_token_s: float | None,
    ) -> None:
        """Queue a replay run to the output limit the request had (what DDTree would have
        run to: the loop's depth rule depends on it), with the answer's time to its first
        token where it streamed."""
        assert self.shadow is not None
        if not prompt_ids or not output_ids:
            return
        requested, _ = requested_max_tokens(REQUEST_MODELS[endpoint].parse(body))
        room = runtime.max_model_len - len(prompt_ids)
        max_tokens = max_tokens_in_force(requested, room, runtime.generation_defaults)
        self.shadow.offer(ShadowJob(list(prompt_ids), list(output_ids), max_tokens, first_token_s))

    # ----- the report and the guardrail -------------------------------------------

    def _report_inputs(self) -> Callable[[], dict[str, Any]]:
        """On the event loop: a snapshot of the records; the returned call builds the
        report from it (anywhere: its bootstraps take a moment)."""
        records, settings, shadow = self.records, self.settings, self.shadow
        now = records.clock()
        since_start = records.since(records.started)
        recent = records.since(now - settings.ab_window)
        split = None if self.split is None else self.split.share
        table = self._shadow_table(since_start["direct"]) if shadow is not None else []
        counts = None
        if shadow is not None:
            counts = {"offered": shadow.num_offered, "replayed": shadow.num_replayed,
                      "dropped": shadow.num_dropped, "failed": shadow.num_failed,
                      "queued": shadow.queue.qsize()}  # fmt: skip
            if shadow.prober is not None:
                counts |= {"probes": shadow.prober.num_probes,
                           "failed_probes": shadow.prober.num_failed}  # fmt: skip
        guardrail = {"enabled": settings.ab_guardrail, "tripped": self.guardrail_tripped}
        forced = self.num_forced

        def build() -> dict[str, Any]:
            out = report.build(
                since_start, recent, uptime_s=now - records.started, window_s=settings.ab_window,
                split=split, shadow=table, shadow_dropped=counts["dropped"] if counts else 0,
            )  # fmt: skip
            out["guardrail"] = guardrail
            out["forced_requests"] = forced
            if counts is not None:
                out["shadow_counts"] = counts
            return out

        return build

    def _cost(self) -> tuple[LinearCost | None, float, str]:
        """(the fit of a verification call's seconds, host seconds per round outside
        it, where they come from): the DDTree arm's rounds (the adaptive policy's fit)
        where it has measured any, else the shadow's probe calls; (None, 0, why not)."""
        policy, replica = _fitted(self._policy)
        if policy is not None:
            source = "ddtree arm's rounds" + ("" if replica is None else f" (replica {replica})")
            return policy.calls, policy.overhead.ratio() or 0.0, source
        prober = self.shadow.prober if self.shadow is not None else None
        if prober is not None and prober.calls.num_rows:
            return prober.calls, 0.0, f"probe calls ({prober.num_probes})"
        return None, 0.0, "none: no DDTree rounds measured" + (", no probe yet" if prober else "")

    def _direct_itl(self, direct: Iterable[RequestRecord]) -> float | None:
        """The direct arm's median inter-token latency (a decode rate needs a gap:
        answers whose tokens came at once have none)."""
        itls = [r.itl_s for r in direct if r.itl_s is not None and r.itl_s > 0]
        return float(np.median(itls)) if itls else None

    def _pricing(self) -> Pricing | None:
        """The upstream's costs now, for the shadow's emulation of the policy; None
        until both a round's cost and the direct arm's decode rate are measured."""
        calls, overhead, _ = self._cost()
        itl = self._direct_itl(self.records.records["direct"])  # every record kept
        if calls is None or itl is None:
            return None

        def round_seconds(num_prompts: np.ndarray, computed_tokens: np.ndarray) -> np.ndarray:
            return calls.seconds(num_prompts, computed_tokens) + overhead

        return Pricing(round_seconds, itl)

    def _shadow_table(self, direct: list[RequestRecord]) -> list[dict[str, Any]]:
        """The shadow's rows, each with its median predicted tokens/s per request over
        the direct arm's median (`direct`: the report's ratio of medians, predicted) and
        where the cost came from."""
        assert self.shadow is not None
        _, _, source = self._cost()
        median = float(np.median([r.tokens_per_s for r in direct])) if direct else None
        if median is None:
            source = "none: no direct answers"
        rows = []
        for row in self.shadow.table():
            rate = row["predicted_tokens_per_s"]
            ratio = None if rate is None or median is None else round(rate / median, 3)
            rows.append(row | {"predicted_ratio": ratio, "cost_source": source})
        return rows

    async def report(self) -> dict[str, Any]:
        return await asyncio.to_thread(self._report_inputs())

    def _guard(self, record: RequestRecord) -> None:
        """Add `record` to the guardrail's block; once both arms fill it, judge it: split
        0 when DDTree's tokens/s are significantly lower (one-sided rank-sum test at the
        block's level), then start the next block."""
        if not self.settings.ab_guardrail or self.split is None or self.split.share == 0:
            return
        block = self._block
        block[record.arm].append(record.tokens_per_s)
        if min(len(values) for values in block.values()) < GUARDRAIL_BLOCK:
            return
        ddtree, direct = np.asarray(block["ddtree"]), np.asarray(block["direct"])
        for values in block.values():
            values.clear()
        self._num_judged += 1
        level = GUARDRAIL_ALPHA / (self._num_judged * (self._num_judged + 1))
        p = report.slower_p(ddtree, direct)
        ratio = float(np.median(ddtree) / np.median(direct))
        logger.info("A/B guardrail: block %d, DDTree/direct median tokens/s %.3g over %d and "
                    "%d requests, p %.2g (trips below %.2g)", self._num_judged, ratio,
                    len(ddtree), len(direct), p, level)  # fmt: skip
        if p >= level:
            return
        logger.warning("A/B guardrail: DDTree/direct median tokens/s %.3g over %d and %d "
                       "requests, p %.2g < %.2g: split set to 0", ratio, len(ddtree),
                       len(direct), p, level)  # fmt: skip
        self.set_split(0.0)
        self.guardrail_tripped = True
        assert self.metrics is not None
        self.metrics.guardrail_trips.inc()


def _fitted(policy: Policy | None) -> tuple[Policy | None, str | None]:
    """The policy whose verification-cost fit prices the shadow's rounds, and its
    replica's name: with one upstream the runtime's own; with several, each replica has
    its own policy (the runtime's stays empty) and the one with the most measured rounds
    stands for them. (None, None) where no round has been measured."""
    if policy is None:
        return None, None
    candidates = [(None, policy), *policy.replicas.items()]
    replica, fitted = max(candidates, key=lambda item: item[1].calls.num_rows)
    return (fitted, replica) if fitted.calls.num_rows else (None, None)


class _Hooks:
    """Runs the A/B code that sits in a client's response (timing, collecting token
    ids, queueing replays): a failure is logged, the first of each kind with its
    traceback, and never reaches the client."""

    def __init__(self) -> None:
        self.failed: set[str] = set()

    def run(self, kind: str, call: Callable[..., None], *args: Any) -> bool:
        """`call(*args)`; False when it raised."""
        try:
            call(*args)
        except Exception:
            if kind in self.failed:
                logger.debug("A/B %s hook failed again", kind, exc_info=True)
            else:
                self.failed.add(kind)
                logger.exception("A/B %s hook failed (logged once); the answer goes on "
                                 "unchanged", kind)  # fmt: skip
            return False
        return True


def _queue_answer(content: bytes, queue: Callable[[list[int], list[int]], None]) -> None:
    """Queue a JSON answer's prompt and output ids for a replay."""
    answer = json.loads(content)
    choice = answer["choices"][0]
    queue(answer.get("prompt_token_ids") or choice.get("prompt_token_ids"), choice.get("token_ids"))


class _StreamIds:
    """A shadow-sampled stream: collects the token ids vLLM sends (prompt ids in the
    first chunk, each chunk's new ids), queues them at the end and, unless the client
    asked for them, sets them to null in each event, as vLLM writes them without
    `return_token_ids`. An event it cannot read ends the collecting, not the stream."""

    def __init__(self, asked: bool, done: Callable[[list[int], list[int]], None], hooks: _Hooks):
        self.asked = asked
        self.done = done
        self.hooks = hooks
        self.prompt_ids: list[int] = []
        self.output_ids: list[int] = []
        self.collecting = True

    async def relay(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        pending = b""
        async for chunk in chunks:
            *events, pending = (pending + chunk).split(b"\n\n")
            out = b"".join(self._event(event) + b"\n\n" for event in events)
            if out:
                yield out
        if pending:
            yield pending
        if self.collecting:
            self.hooks.run("shadow", self.done, self.prompt_ids, self.output_ids)

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {"):
            return event
        if self.collecting:
            self.collecting = self.hooks.run("shadow", self._collect, event)
        return event if self.asked else split_token_ids(event)[0]

    def _collect(self, event: bytes) -> None:
        data = json.loads(event[6:])
        for holder in (data, *(data.get("choices") or ())):
            self.prompt_ids += holder.get("prompt_token_ids") or ()
        for choice in data.get("choices") or ():
            self.output_ids += choice.get("token_ids") or ()


# What the A/B clock reads from a direct stream's events, found without parsing them
# (a JSON parse per event costs more than the rest of relaying it): output (a non-empty
# text, content or reasoning, or a tool call), the finish reason, the usage's
# completion tokens, and token ids (`"token_ids"`, not `prompt_token_ids`). A quote
# opens a key only outside strings (inside one every quote is escaped), and a key, not
# a string value, is followed by a colon: each match is the key's. (Keys of nested
# objects with other values -- a logprobs' `content` list, a top logprob's number --
# do not match.)
_EVENT_FIELDS = re.compile(
    rb'"(?:(?:text|content|reasoning_content)"\s*:\s*"[^"]'
    rb'|tool_calls"\s*:\s*\[\s*\{'
    rb'|finish_reason"\s*:\s*"([^"]*)"'
    rb'|completion_tokens"\s*:\s*(\d+)'
    rb'|token_ids"\s*:\s*\[([0-9,\s]*)\])'
)


class _TokenCounter:
    """Counts a direct answer's tokens as its bytes go out: a JSON answer's from its
    `usage` at the end; a stream's per event from its `token_ids` where they were asked
    for, else one per output it carries (vLLM sends one event per token and choice
    unless it speculates itself or its client falls behind), set to the stream's `usage`
    at the end where the client asked for it."""

    def __init__(self, timing: RequestTiming, stream: bool):
        self.timing = timing
        self.stream = stream
        self.buffer = b""

    def __call__(self, chunk: bytes) -> None:
        self.buffer += chunk
        if not self.stream:
            return self._json_end()
        *events, self.buffer = self.buffer.split(b"\n\n")
        count = 0
        usage_total = None
        for event in events:
            if not event.startswith(b"data: {"):
                continue
            outputs = ids = 0
            for match in _EVENT_FIELDS.finditer(event):
                reason, completion_tokens, token_ids = match.groups()
                if reason is not None:
                    self.timing.finish_reason = reason.decode()
                elif completion_tokens is not None:
                    usage_total = int(completion_tokens)
                elif token_ids is not None:
                    ids += token_ids.count(b",") + 1 if token_ids.strip() else 0
                else:
                    outputs += 1
            count += ids or outputs
        self.timing.tokens(count)
        if usage_total is not None:
            # vLLM merges tokens into one event when its client falls behind; the usage
            # the client asked for says how many there were.
            self.timing.num_tokens = max(self.timing.num_tokens, usage_total)

    def _json_end(self) -> None:
        try:
            data = json.loads(self.buffer)
        except json.JSONDecodeError:
            return  # not all of it yet
        usage = data.get("usage") or {}
        choices = data.get("choices") or [{}]
        self.timing.finish_reason = choices[0].get("finish_reason")
        self.timing.tokens(int(usage.get("completion_tokens") or 0))


def split_of(raw: bytes) -> float | None:
    """The admin body `{"split": F}` (F in [0, 1], or null: no split)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict) or set(body) != {"split"}:
        raise RequestError('send {"split": F} with F between 0 and 1, or null for no split',
                           param="split")  # fmt: skip
    share = body["split"]
    if share is None:
        return None
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise RequestError(f"split must be a number between 0 and 1, got {share!r}", param="split")
    return float(share)
