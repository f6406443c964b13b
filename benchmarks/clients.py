"""What the serving benchmarks send and read around it: a closed-loop load of greedy
completion requests over HTTP, a process's CPU time, a Prometheus counter's samples.
`benchmarks.relay` and `benchmarks.adaptive` measure `ddtree-proxy serve` with these.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


async def send(
    url: str,
    model: str,
    prompts: list,
    max_tokens: int,
    clients: int,
    *,
    stream: bool,
    headers: dict[str, str] | None = None,
    ddtree: dict[str, Any] | None = None,
) -> list[dict]:
    """Send every prompt to `url`'s /v1/completions, `clients` at a time, greedy with EOS
    ignored; each request's `usage` (streaming: from the final chunk, asked for with
    `stream_options.include_usage`), checked to count `max_tokens` completion tokens.
    `ddtree`: the proxy's per-request options (the body's `ddtree` field)."""
    semaphore = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=headers) as client:

        async def one(prompt) -> dict:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": stream}  # fmt: skip
            if stream:
                body["stream_options"] = {"include_usage": True}
            if ddtree is not None:
                body["ddtree"] = ddtree
            async with semaphore:
                if not stream:
                    response = await client.post("/v1/completions", json=body)
                    response.raise_for_status()
                    usage = response.json()["usage"]
                else:
                    usage = None
                    async with client.stream("POST", "/v1/completions", json=body) as response:
                        response.raise_for_status()
                        async for line in response.aiter_lines():
                            if line.startswith("data: {"):
                                usage = json.loads(line[6:]).get("usage") or usage
            assert usage is not None and usage["completion_tokens"] == max_tokens, usage
            return usage

        return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) process `pid` has used so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def counter_samples(url: str, name: str) -> dict[str, float]:
    """The samples named `name` on `url`/metrics, keyed by their labels
    (`"decision=plain,reason=x"`, sorted; `""` without labels); empty when the server
    exports none."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    response.raise_for_status()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == name:
                key = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                samples[key] = samples.get(key, 0.0) + sample.value
    return samples
