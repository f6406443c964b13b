"""The A/B report: per arm, what its clients felt, each figure with a bootstrap 95 %
interval; the ratio DDTree/direct of the arms' median per-request tokens/s with its
interval; the shadow table; one verdict line. Pure: records in, a JSON-able dict out
(`build`), and the dict as a text table (`format_report`).

Per request, tokens/s = output tokens / (time of the last token - the request's start),
so a slow first token counts. An interval is the 2.5 and 97.5 percentiles of the figure
over BOOTSTRAP_RESAMPLES resamples of the requests (with replacement); the ratio's
resamples each arm on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from proxy.ab.measure import RequestRecord
from proxy.ab.split import ARMS, Arm

BOOTSTRAP_RESAMPLES = 1000
# The latest requests a bootstrap resamples: bounds one report's work (1000 x 5000
# values) while leaving the interval about as narrow as all of them would.
MAX_BOOTSTRAP_REQUESTS = 5000
# Resamples drawn at a time: bounds a report's memory at 50 x 5000 values per array
# whatever the number of requests (all 1000 at once held 1000 x N, and the proxy's
# resident memory kept that peak: it grew with every report as requests accrued).
BOOTSTRAP_CHUNK = 50
MIN_REQUESTS = 10  # per arm, before a ratio or a verdict
SEED = 0  # the same records give the same intervals

# (name in the report, record field, scale to the unit shown)
FIGURES: tuple[tuple[str, str, float], ...] = (
    ("ttft_ms", "ttft_s", 1000.0),
    ("itl_ms", "itl_s", 1000.0),
    ("e2e_ms", "e2e_s", 1000.0),
    ("tokens_per_s", "tokens_per_s", 1.0),
)


@dataclass(frozen=True)
class Interval:
    value: float
    low: float
    high: float

    def to_list(self) -> list[float]:
        return [round(self.value, 4), round(self.low, 4), round(self.high, 4)]


def bootstrap(
    samples: Sequence[np.ndarray],
    statistic: Callable[..., np.ndarray],
    rng: np.random.Generator,
    resamples: int = BOOTSTRAP_RESAMPLES,
) -> Interval:
    """`statistic` of the samples, and its 95 % interval: `statistic` takes one
    [resamples, n] array per sample and reduces along axis 1."""
    value = float(statistic(*(s[None, :] for s in samples))[0])
    statistics = []
    for start in range(0, resamples, BOOTSTRAP_CHUNK):
        size = min(BOOTSTRAP_CHUNK, resamples - start)
        draws = [s[rng.integers(0, len(s), size=(size, len(s)))] for s in samples]
        statistics.append(statistic(*draws))
    low, high = np.percentile(np.concatenate(statistics), [2.5, 97.5])
    return Interval(value, float(low), float(high))


def _values(records: Sequence[RequestRecord], field: str, scale: float) -> np.ndarray:
    values = [getattr(r, field) for r in records[-MAX_BOOTSTRAP_REQUESTS:]]
    return np.asarray([v * scale for v in values if v is not None and np.isfinite(v)])


def _percentile(q: float) -> Callable[[np.ndarray], np.ndarray]:
    return lambda values: np.percentile(values, q, axis=1)


def arm_figures(records: Sequence[RequestRecord], rng: np.random.Generator) -> dict[str, Any]:
    out: dict[str, Any] = {
        "requests": len(records),
        "tokens": int(sum(r.num_tokens for r in records)),
    }
    for name, field, scale in FIGURES:
        values = _values(records, field, scale)
        if len(values) == 0:
            out[name] = None
            continue
        out[name] = {f"p{q}": bootstrap([values], _percentile(q), rng).to_list() for q in (50, 90)}
    return out


def median_ratio(
    ddtree: Sequence[RequestRecord], direct: Sequence[RequestRecord], rng: np.random.Generator
) -> Interval | None:
    """DDTree's median per-request tokens/s over direct's, with its interval."""
    a = _values(ddtree, "tokens_per_s", 1.0)
    b = _values(direct, "tokens_per_s", 1.0)
    if len(a) < MIN_REQUESTS or len(b) < MIN_REQUESTS:
        return None
    return bootstrap([a, b], lambda x, y: np.median(x, axis=1) / np.median(y, axis=1), rng)


def slower_p(ddtree: np.ndarray, direct: np.ndarray) -> float:
    """One-sided p-value of "DDTree's values are lower than direct's": the Mann-Whitney
    rank-sum test in its normal approximation, with the tie and continuity corrections
    (scipy.stats.mannwhitneyu(alternative="less", method="asymptotic") computes it)."""
    n1, n2 = len(ddtree), len(direct)
    n = n1 + n2
    _, group, ties = np.unique(np.concatenate([ddtree, direct]), return_inverse=True,
                               return_counts=True)  # fmt: skip
    mean_ranks = np.cumsum(ties) - (ties - 1) / 2.0  # ranks 1..n, ties share their mean
    u = float(mean_ranks[group[:n1]].sum()) - n1 * (n1 + 1) / 2.0
    tie_term = float((ties**3 - ties).sum()) / (n * (n - 1))
    variance = n1 * n2 / 12.0 * ((n + 1) - tie_term)
    if variance <= 0:  # every value equal: no evidence either way
        return 1.0
    z = (u - n1 * n2 / 2.0 + 0.5) / math.sqrt(variance)
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def window(records: dict[Arm, list[RequestRecord]], seconds: float) -> dict[str, Any]:
    rng = np.random.default_rng(SEED)
    ratio = median_ratio(records["ddtree"], records["direct"], rng)
    return {
        "seconds": round(seconds, 1),
        "arms": {arm: arm_figures(records[arm], rng) for arm in ARMS},
        "tokens_per_s_ratio": None if ratio is None else ratio.to_list(),
    }


def verdict(since_start: dict[str, Any], shadow: list[dict[str, Any]]) -> str:
    counts = {arm: since_start["arms"][arm]["requests"] for arm in ARMS}
    ratio = since_start["tokens_per_s_ratio"]
    if ratio is None:
        line = (
            f"not enough requests yet: ddtree {counts['ddtree']}, direct {counts['direct']} "
            f"(a ratio needs {MIN_REQUESTS} of each)"
        )
    else:
        value, low, high = ratio
        if low > 1:
            call = "DDTree is faster"
        elif high < 1:
            call = "DDTree is slower: serve direct"
        else:
            call = "no clear difference yet"
        total = counts["ddtree"] + counts["direct"]
        line = (
            f"DDTree {value:.2f}x [{low:.2f}, {high:.2f}] per-request tokens/s over "
            f"{total:,} requests: {call}"
        )
    predicted = [row for row in shadow if row.get("predicted_ratio") is not None]
    replayed = [row for row in shadow if row["rounds"]]
    if predicted:
        best = max(predicted, key=lambda row: row["predicted_ratio"])
        line += (f"; shadow: {best['drafter']} B={best['budget']} predicted best "
                 f"({best['predicted_ratio']:.2f}x direct's tokens/s per request, "
                 f"{best['speculated_share']:.0%} of tokens speculated; tau {best['tau']:.2f})")  # fmt: skip
    elif replayed:
        best = max(replayed, key=lambda row: row["tau"])
        line += f"; shadow: {best['drafter']} B={best['budget']} accepts most (tau {best['tau']:.2f})"
    return line


def build(
    since_start: dict[Arm, list[RequestRecord]],
    recent: dict[Arm, list[RequestRecord]],
    *,
    uptime_s: float,
    window_s: float,
    split: float | None,
    shadow: list[dict[str, Any]],
    shadow_dropped: int,
) -> dict[str, Any]:
    start = window(since_start, uptime_s)
    return {
        "split": split,
        "windows": {"since_start": start, "recent": window(recent, min(window_s, uptime_s))},
        "shadow": shadow,
        "shadow_dropped": shadow_dropped,
        "verdict": verdict(start, shadow),
    }


def _cell(figure: dict[str, Any] | None, q: str) -> str:
    if figure is None:
        return "-"
    value, low, high = figure[q]
    return f"{value:.4g} [{low:.4g}, {high:.4g}]"


def format_report(report: dict[str, Any]) -> str:
    """The report as text tables: one per window, the shadow's, the verdict."""
    lines: list[str] = [f"split: {report['split']}"]
    names = {"since_start": "since start", "recent": "recent"}
    for key, title in names.items():
        data = report["windows"][key]
        arms = data["arms"]
        lines += ["", f"{title} ({data['seconds']:g} s)", "| figure | ddtree | direct |",
                  "|---|---|---|"]  # fmt: skip
        for field in ("requests", "tokens"):
            lines.append(f"| {field} | {arms['ddtree'][field]} | {arms['direct'][field]} |")
        for name, _, _ in FIGURES:
            for q in ("p50", "p90"):
                cells = [_cell(arms[arm][name], q) for arm in ARMS]
                lines.append(f"| {name} {q} | {cells[0]} | {cells[1]} |")
        ratio = data["tokens_per_s_ratio"]
        if ratio is not None:
            lines.append(
                f"ddtree/direct median tokens/s: {ratio[0]:.3g}x [{ratio[1]:.3g}, {ratio[2]:.3g}]"
            )
    if report["shadow"]:
        lines += ["", "shadow replays (direct answers)",
                  "| drafter | budget | requests | rounds | tau | predicted x direct "
                  "| speculated share | speculated nodes | cost source |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in report["shadow"]:
            ratio, share = row.get("predicted_ratio"), row.get("speculated_share")
            nodes = row.get("speculated_nodes")
            lines.append(
                f"| {row['drafter']} | {row['budget']} | {row['requests']} | {row['rounds']} "
                f"| {row['tau']:.3f} | {'-' if ratio is None else f'{ratio:.3g}x'} "
                f"| {'-' if share is None else f'{share:.0%}'} | {'-' if nodes is None else nodes} "
                f"| {row.get('cost_source', '-')} |"
            )
        lines.append(f"dropped (queue full): {report['shadow_dropped']}")
    if report.get("forced_requests"):
        lines.append(f"not compared: {report['forced_requests']} requests that forced an arm "
                     "(x-ddtree, a ddtree field) while the split ran")  # fmt: skip
    lines += ["", report["verdict"]]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """A PNG of the since-start window: median tokens/s and TTFT per arm, with their
    intervals. Needs matplotlib (`pip install 'ddtree-proxy[plot]'`)."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib, which is not installed: pip install 'ddtree-proxy[plot]' "
            "(or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = report["windows"]["since_start"]["arms"]
    figure, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    panels = (("tokens_per_s", "tokens/s per request (median)"),
              ("ttft_ms", "time to first token, ms (median)"))  # fmt: skip
    for ax, (name, label) in zip(axes, panels, strict=True):
        values, errors = [], [[], []]
        for arm in ARMS:
            value, low, high = arms[arm][name]["p50"] if arms[arm][name] else (0.0, 0.0, 0.0)
            values.append(value)
            errors[0].append(value - low)
            errors[1].append(high - value)
        ax.bar(ARMS, values, yerr=errors, capsize=6, color=["tab:green", "tab:gray"])
        ax.set_title(label, fontsize=10)
    figure.suptitle(report["verdict"], fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
