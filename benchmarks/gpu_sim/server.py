"""The simulator as an upstream: vLLM's API, vLLM-CPU's tokens, a GPU's timeline.

Every request goes to a real vLLM (on CPU) and every answer body and streamed event is
vLLM's own; only *when* it reaches the client is simulated. The same request enters
the simulated engine (`Timeline`, driving `engine.Engine` against the wall clock), and
each answer, or each streamed token, is released when the simulated engine has
produced it -- never before vLLM-CPU has: a release that had to wait for vLLM-CPU is
*late* (`Lateness`; there the CPU set the pace, not the simulated GPU).

    simulated seconds x dilation = wall seconds

vLLM-CPU cannot produce tokens as fast as an H200 at batch 16, so `--dilation`
stretches the simulated clock by one factor for every request and every load: the
benchmark's tokens/s are the GPU's divided by the dilation, and ratios between
configurations are unchanged. A request costs the API server `per_call_s +
per_prompt_s * sequences` (one after the other, as one process serves them) before
the engine admits it; a batched call of n prompts (times `n` samples) is that many
sequences in the engine, as in vLLM.

Routes: `/v1/completions` and `/v1/chat/completions` (simulated; text prompts and chat
messages are tokenized by the upstream's `/tokenize`, so the prefix cache sees the
same ids), `GET /sim/stats` (releases, late ones, the engine's counters), and relayed
unchanged: `/v1/models`, `/health`, `/tokenize`, `/detokenize`, `/metrics`,
`/reset_prefix_cache` (which also empties the simulated prefix cache). A client that
disconnects, or closes its stream, aborts its sequences in the simulated engine and
its request upstream. A streamed event's tokens are counted from its `token_ids`
(`return_token_ids`); without them, one per event that carries text.

    python -m benchmarks.gpu_sim --upstream URL --port P [--profile dense27b-h200]
        [--dilation 12]
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from benchmarks.gpu_sim.engine import Engine
from benchmarks.gpu_sim.roofline import PROFILES, Profile, profile

DEFAULT_PROFILE = "dense27b-h200"
COMPLETIONS_MAX_TOKENS = 16  # vLLM's default for /v1/completions
UNTIL_THE_ANSWER_ENDS = 1 << 30  # chat's default: the real answer's end cuts it (`limit`)
RELAYED = ("/v1/models", "/health", "/tokenize", "/detokenize", "/metrics", "/reset_prefix_cache")


@dataclass
class Lateness:
    """Releases (non-streaming answers, stream events with tokens) so far, and those
    whose vLLM-CPU answer came after the simulated engine's time for them."""

    answers: int = 0
    late_answers: int = 0
    tokens: int = 0
    late_tokens: int = 0

    def answer(self, arrived: float, due: float) -> None:
        self.answers += 1
        self.late_answers += arrived > due

    def token(self, arrived: float, due: float) -> None:
        self.tokens += 1
        self.late_tokens += arrived > due


def late_share(before: dict, after: dict) -> float | None:
    """Late releases over releases between two `/sim/stats` readings (None: none)."""
    released = after["answers"] + after["tokens"] - before["answers"] - before["tokens"]
    late = after["late_answers"] + after["late_tokens"]
    late -= before["late_answers"] + before["late_tokens"]
    return late / released if released else None


class Timeline:
    """The simulated engine run on the wall clock: each step starts when the previous
    one ends (or when a request is admitted to an idle engine), and its tokens are
    published when its simulated end comes round on the wall clock."""

    def __init__(self, engine: Engine, dilation: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        if dilation <= 0:
            raise ValueError(f"dilation must be positive, got {dilation}")
        self.engine = engine
        self.dilation = dilation
        self.clock = clock
        self.t0 = clock()
        self.max_lag_s = 0.0  # wall seconds a step's tokens were published after their time
        self._free_s = 0.0  # simulated time the engine is free from
        self._api_free_s = 0.0  # ... and the API server
        self._due: dict[int, list[float]] = {}  # request id -> wall time of each token
        self._ended: set[int] = set()
        self._limits: dict[int, int] = {}  # request id -> tokens of vLLM-CPU's answer
        self._ids = itertools.count()
        self._changed = asyncio.Condition()
        self._wake = asyncio.Event()
        self._driver: asyncio.Task | None = None

    def wall(self, sim_s: float) -> float:
        return self.t0 + sim_s * self.dilation

    def sim(self, wall: float) -> float:
        return (wall - self.t0) / self.dilation

    def submit(self, prompts: list[list[int]], max_tokens: int, arrived: float,
               read_cache: bool = True) -> list[int]:  # fmt: skip
        """Sequences for `prompts` (one each), arrived at wall time `arrived`."""
        profile = self.engine.profile
        start = max(self.sim(arrived), self._api_free_s)
        admit = start + profile.per_call_s + profile.per_prompt_s * len(prompts)
        self._api_free_s = admit
        request_ids = [next(self._ids) for _ in prompts]
        for request_id, prompt in zip(request_ids, prompts, strict=True):
            self.engine.add(request_id, prompt, max_tokens, admit, read_cache)
            self._due[request_id] = []
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        self._wake.set()
        return request_ids

    async def token_due(self, request_id: int, token_idx: int) -> float:
        """Wall time token `token_idx` of a request was (or will be) done; for a token
        the engine never made (the sequence ended first), its last token's."""
        due = self._due[request_id]
        async with self._changed:
            await self._changed.wait_for(lambda: len(due) > token_idx or request_id in self._ended)
        return due[min(token_idx, len(due) - 1)] if due else self.clock()

    async def finish_due(self, request_ids: list[int]) -> float:
        """Wall time the last of these sequences ended."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._ended.issuperset(request_ids))
        return max((due[-1] for due in map(self._due.get, request_ids) if due), default=0.0)

    async def limit(self, request_id: int, num_tokens: int) -> None:
        """vLLM-CPU's answer has `num_tokens` tokens (an EOS or stop came first). The
        sequence ends once that many of its tokens are published (the engine's state
        runs a step ahead of the wall clock)."""
        self.engine.limit(request_id, num_tokens)
        self._limits[request_id] = num_tokens
        if len(self._due[request_id]) >= num_tokens:
            async with self._changed:
                self._ended.add(request_id)
                self._changed.notify_all()

    def forget(self, request_ids: list[int]) -> None:
        """The client is done with these (answered, or gone): abort what still runs."""
        for request_id in request_ids:
            self.engine.abort(request_id)
            self._due.pop(request_id, None)
            self._limits.pop(request_id, None)
            self._ended.discard(request_id)

    async def _drive(self) -> None:
        engine = self.engine
        while True:
            start = engine.next_start(self._free_s)
            if start is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.wall(start) > self.clock():
                # Until an admitted request's turn; a later arrival cannot start sooner.
                await asyncio.sleep(self.wall(start) - self.clock())
            step = engine.step(start)
            await _sleep_until(self.wall(step.end_s), self.clock)
            self._free_s = step.end_s
            self.max_lag_s = max(self.max_lag_s, self.clock() - self.wall(step.end_s))
            async with self._changed:
                for request_id in step.emitted:
                    if request_id in self._due:
                        due = self._due[request_id]
                        due.append(self.wall(step.end_s))
                        if len(due) >= self._limits.get(request_id, len(due) + 1):
                            self._ended.add(request_id)
                self._ended.update(r for r in step.finished if r in self._due)
                self._changed.notify_all()


def create_app(upstream_url: str, gpu_profile: Profile, dilation: float,
               clock: Callable[[], float] = time.perf_counter) -> Starlette:  # fmt: skip
    client = httpx.AsyncClient(base_url=upstream_url, timeout=600)
    timeline = Timeline(Engine(gpu_profile), dilation, clock)
    lateness = Lateness()

    async def simulated(request: Request) -> Response:
        arrived = clock()
        raw = await request.body()
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            return await relay(request)  # vLLM's own 400
        prompts = await _prompt_ids(client, request.url.path, body)
        samples = int(body.get("n") or 1)
        sequences = [prompt for prompt in prompts for _ in range(samples)]
        if not sequences or not all(sequences):
            return await relay(request)  # vLLM refuses an empty prompt: nothing to time
        chat = request.url.path.endswith("/chat/completions")
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens")
                         or (UNTIL_THE_ANSWER_ENDS if chat else COMPLETIONS_MAX_TOKENS))  # fmt: skip
        request_ids = timeline.submit(sequences, max_tokens, arrived,
                                      read_cache=not body.get("prompt_logprobs"))  # fmt: skip
        upstream = client.build_request("POST", request.url.path, content=raw,
                                        headers={"content-type": "application/json"})  # fmt: skip
        response = await _unless_disconnected(request, client.send(upstream, stream=True))
        if response is None:
            timeline.forget(request_ids)
            return Response(status_code=499)
        if response.status_code != 200 or not body.get("stream"):
            return await _answer(request, response, sequences, request_ids)
        return StreamingResponse(
            _events(response, sequences, request_ids), media_type="text/event-stream"
        )

    async def _answer(request, response, sequences, request_ids) -> Response:
        try:
            content = await _unless_disconnected(request, response.aread())
            if content is None:
                return Response(status_code=499)
            if response.status_code != 200:  # vLLM's refusal, as it comes
                return Response(content, response.status_code, media_type="application/json")
            arrived = clock()
            outputs = _choice_tokens(json.loads(content), len(sequences))
            for request_id, output in zip(request_ids, outputs, strict=True):
                if output is not None:
                    await timeline.limit(request_id, len(output))
            due = await _unless_disconnected(request, timeline.finish_due(request_ids))
            if due is None:
                return Response(status_code=499)
            lateness.answer(arrived, due)
            await _sleep_until(due, clock)
            _register(timeline.engine, sequences, outputs)
            return Response(content, response.status_code, media_type="application/json")
        finally:
            await response.aclose()
            timeline.forget(request_ids)

    async def _events(response, sequences, request_ids):
        # Event i of a choice is due when the simulated engine made that choice's i-th
        # token; a token vLLM-CPU delivers later goes out when it comes.
        counts = [0] * len(sequences)
        outputs: list[list[int] | None] = [[] for _ in sequences]
        try:
            async for line in response.aiter_lines():
                arrived, event, due = clock(), _event(line), None
                for choice in (event or {}).get("choices") or []:
                    choice_idx = int(choice.get("index", 0))
                    if not 0 <= choice_idx < len(sequences):
                        continue
                    tokens = _new_tokens(choice)
                    if tokens:
                        counts[choice_idx] += len(tokens) if isinstance(tokens, list) else 1
                        token_due = await timeline.token_due(request_ids[choice_idx],
                                                             counts[choice_idx] - 1)  # fmt: skip
                        due = token_due if due is None else max(due, token_due)
                    if tokens is True:
                        outputs[choice_idx] = None  # text without ids: the output is unknown
                    elif tokens and outputs[choice_idx] is not None:
                        outputs[choice_idx] += tokens
                    if choice.get("finish_reason"):
                        await timeline.limit(request_ids[choice_idx], counts[choice_idx])
                if due is not None:
                    lateness.token(arrived, due)
                    await _sleep_until(due, clock)
                yield (line + "\n").encode()
            _register(timeline.engine, sequences, outputs)
        finally:
            await response.aclose()
            timeline.forget(request_ids)

    async def relay(request: Request) -> Response:
        upstream = client.build_request(
            request.method, request.url.path, content=await request.body(),
            headers={"content-type": request.headers.get("content-type", "application/json")},
        )  # fmt: skip
        response = await client.send(upstream)
        if request.url.path == "/reset_prefix_cache" and response.status_code == 200:
            timeline.engine.reset_prefix_cache()
        return Response(response.content, response.status_code, headers={
            "content-type": response.headers.get("content-type", "application/json")})  # fmt: skip

    async def stats(request: Request) -> Response:
        return JSONResponse(vars(lateness) | vars(timeline.engine.counters) | {
            "profile": gpu_profile.name, "dilation": dilation,
            "sim_s": timeline.sim(clock()), "max_lag_s": timeline.max_lag_s,
            "cached_blocks": len(timeline.engine.cache)})  # fmt: skip

    routes = [Route(path, simulated, methods=["POST"])
              for path in ("/v1/completions", "/v1/chat/completions")]  # fmt: skip
    routes.append(Route("/sim/stats", stats, methods=["GET"]))
    routes += [Route(path, relay, methods=["GET", "POST"]) for path in RELAYED]
    return Starlette(routes=routes)


async def _prompt_ids(client: httpx.AsyncClient, path: str, body: dict) -> list[list[int]]:
    """The token ids of every prompt of a request, as the upstream tokenizes them."""
    if path.endswith("/chat/completions"):
        return [await _tokenize(client, {"model": body.get("model"),
                                         "messages": body.get("messages", [])})]  # fmt: skip
    prompts = body.get("prompt")
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    return [prompt if isinstance(prompt, list)
            else await _tokenize(client, {"model": body.get("model"), "prompt": prompt})
            for prompt in prompts or [[]]]  # fmt: skip


async def _tokenize(client: httpx.AsyncClient, body: dict) -> list[int]:
    response = await client.post("/tokenize", json=body)
    return response.json().get("tokens") or [] if response.status_code == 200 else []


def _event(line: str) -> dict | None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    try:
        return json.loads(line[len("data: ") :])
    except json.JSONDecodeError:
        return None


def _new_tokens(choice: dict) -> list[int] | bool:
    """A streamed choice's new token ids, or (without ids) whether it carries text."""
    if choice.get("token_ids") is not None:
        return [int(token) for token in choice["token_ids"]]
    delta = choice.get("delta") or {}
    return bool(choice.get("text") or delta.get("content") or delta.get("reasoning_content"))


def _choice_tokens(answer: Any, num_choices: int) -> list[list[int] | None]:
    """Each choice's output token ids (None where the answer does not give them)."""
    outputs: list[list[int] | None] = [None] * num_choices
    for choice in (answer.get("choices") or []) if isinstance(answer, dict) else []:
        choice_idx = int(choice.get("index", 0))
        if 0 <= choice_idx < num_choices and choice.get("token_ids") is not None:
            outputs[choice_idx] = [int(token) for token in choice["token_ids"]]
    return outputs


def _register(engine: Engine, sequences: list[list[int]], outputs: list[list[int] | None]) -> None:
    """vLLM keeps the blocks of what it generated: so does the simulated prefix cache."""
    for prompt, output in zip(sequences, outputs, strict=True):
        if output:
            engine.register(prompt + output)


async def _unless_disconnected(request: Request, work: Awaitable) -> Any:
    """`work`'s result, or None (and `work` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(disconnect())
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


async def _sleep_until(deadline: float, clock: Callable[[], float]) -> None:
    delay = deadline - clock()
    if delay > 0:
        await asyncio.sleep(delay)


def main(argv: list[str] | None = None) -> int:
    """Serve the simulator in its own process (its pacing and the benchmark's event
    handling would otherwise share one GIL)."""
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--upstream", required=True, help="the vLLM server's URL")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    parser.add_argument("--dilation", type=float, required=True,
                        help="wall seconds per simulated second (one value for every load)")  # fmt: skip
    args = parser.parse_args(argv)
    app = create_app(args.upstream, profile(args.profile), args.dilation)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    return 0
