"""The README's benchmark tables and plots are the committed report's, not typed in or
left over from an older run: every row between the `benchmark-tables` markers must equal
the row of `benchmarks/results/latest.json` with the same configuration, formatted as
the report formats it, and every plot it shows must be what the report's own plotting
function draws from that file."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from matplotlib.image import imread

from benchmarks import adaptive_report
from benchmarks.report import MAIN_COLUMNS, _fmt, validate_report, write_plots

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"
KEY_COLUMNS = ("mode", "tree", "drafter", "strategy", "budget")


def _readme_rows() -> tuple[list[str], list[list[str]]]:
    text = (REPO_ROOT / "README.md").read_text()
    match = re.search(
        r"<!-- benchmark-tables:start -->(.*?)<!-- benchmark-tables:end -->", text, re.S
    )
    assert match, "README.md lost its benchmark-tables markers"
    header: list[str] = []
    rows = []
    for line in match.group(1).splitlines():
        if not line.startswith("|") or line.startswith("|---"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[0] == "mode":
            assert not header or header == cells, "all README benchmark tables share columns"
            header = cells
        else:
            rows.append(cells)
    return header, rows


def test_readme_benchmark_rows_match_the_committed_report():
    report = validate_report(RESULTS / "latest.json")
    title_to_column = {title: (key, digits) for key, title, digits in MAIN_COLUMNS}
    header, readme_rows = _readme_rows()
    assert len(readme_rows) >= 10
    assert header[: len(KEY_COLUMNS)] == ["mode", "tree", "drafter", "strategy", "B"]
    by_key = {}
    for row in report.rows:
        data = row.model_dump()
        by_key[tuple(_fmt(data.get(key), 0) for key in KEY_COLUMNS)] = data
    for cells in readme_rows:
        data = by_key.get(tuple(cells[: len(KEY_COLUMNS)]))
        assert data is not None, f"README row {cells} is not in the report"
        for title, cell in zip(header, cells, strict=True):
            key, digits = title_to_column[title]
            assert cell == _fmt(data.get(key), digits), (cells, title)


def test_readme_plots_are_the_reports(tmp_path):
    text = (REPO_ROOT / "README.md").read_text()
    shown = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text) + re.findall(
        r"<img[^>]*src=\"([^\"]+)\"", text
    )
    assert shown, "README.md shows no images"
    for path in shown:
        assert (REPO_ROOT / path).is_file(), f"README.md shows {path}, which does not exist"
    # Re-drawn from latest.json, each plot must be pixel for pixel the committed one.
    drawn = write_plots(validate_report(RESULTS / "latest.json"), tmp_path)
    plots = {f"benchmarks/results/{name}" for name in drawn}
    assert plots and plots <= set(shown), f"README.md does not show {plots - set(shown)}"
    adaptive_plot = f"benchmarks/results/{adaptive_report.PLOT}"
    assert {path for path in shown if path.startswith("benchmarks/results/")} <= plots | {
        adaptive_plot
    }
    for name in drawn:
        committed, redrawn = imread(RESULTS / name), imread(tmp_path / name)
        assert committed.shape == redrawn.shape, name
        assert np.array_equal(committed, redrawn), (
            f"benchmarks/results/{name} is not what write_plots draws from latest.json; "
            "redraw it with benchmarks.report.write_plots, or rerun the benchmark"
        )


def test_readme_adaptive_table_and_plot_are_the_reports(tmp_path):
    """The adaptive policy's table in the README is
    `benchmarks.adaptive_report.readme_table` of the committed report, and its plot is
    what `write_plot` draws from it."""
    import json

    rows = json.loads((RESULTS / "adaptive.json").read_text())["rows"]
    text = (REPO_ROOT / "README.md").read_text()
    match = re.search(r"<!-- adaptive-table:start -->\n(.*?)<!-- adaptive-table:end -->", text, re.S)
    assert match, "README.md lost its adaptive-table markers"
    assert match.group(1) == adaptive_report.readme_table(rows)
    assert f"benchmarks/results/{adaptive_report.PLOT}" in text
    name = adaptive_report.write_plot(rows, tmp_path)
    committed, redrawn = imread(RESULTS / name), imread(tmp_path / name)
    assert committed.shape == redrawn.shape and np.array_equal(committed, redrawn), (
        f"benchmarks/results/{name} is not what benchmarks.adaptive_report.write_plot draws "
        "from adaptive.json; rerun the benchmark"
    )
