"""Per dilation and cell: the late share's min / median / max over the runs in
runs.jsonl (one configuration's share is that of its releases in the cell), and the
host's load average around the runs.

    python3 benchmarks/results/runs/2026-12-03-gpu-sim-dilation/summarize.py [runs.jsonl]
"""

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

path = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("runs.jsonl"))
records = [json.loads(line) for line in path.read_text().splitlines()]
cells = list(dict.fromkeys((c["prompts"], c["concurrency"]) for r in records for c in r["cells"]))
dilations = sorted({r["dilation"] for r in records})
# A cell's late share: the worst of its three configurations in that run.
worst = defaultdict(list)
for record in records:
    per_cell = defaultdict(float)
    for cell in record["cells"]:
        key = (cell["prompts"], cell["concurrency"])
        per_cell[key] = max(per_cell[key], cell["late_share"])
    for key, share in per_cell.items():
        worst[(record["dilation"], key)].append(share)
print("| dilation | runs | load avg (1 min, before / after each run) | "
      + " | ".join(f"{p} {c}" for p, c in cells) + " | max lag |")
print("|---|---|---|" + "---|" * len(cells) + "---|")
for dilation in dilations:
    runs = [r for r in records if r["dilation"] == dilation]
    loads = ", ".join(f"{r['loadavg_before'][0]:.0f}/{r['loadavg_after'][0]:.0f}"
                      if "loadavg_before" in r else "-" for r in runs)
    shares = []
    for key in cells:
        values = worst[(dilation, key)]
        shares.append(f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}")
    lag = max(r["sim_stats"]["max_lag_s"] for r in runs)
    print(f"| {dilation:g} | {len(runs)} | {loads} | " + " | ".join(shares) + f" | {lag:.2f} s |")
