"""The pieces of `benchmarks/reference.py` that do not need the reference checkout:
the round-by-round comparison, the cache adapter, the refusal of a wrong directory and
the table. (The comparison itself runs the user's checkout; see benchmarks/README.md.)"""

from __future__ import annotations

import pytest
import torch

from benchmarks.reference import (
    LegacyCropCache,
    RoundCompare,
    compare_rounds,
    load_reference,
    render_markdown,
)


def test_identical_rounds():
    compare = RoundCompare()
    compare_rounds([3, 4, 2], [3, 4, 2], 8, compare, {"prompt": 0})
    assert (compare.rounds, compare.our_rounds, compare.identical, compare.tokens) == (3, 3, 3, 8)
    assert compare.differ_last_only == compare.differ_earlier == 0
    assert compare.first_differences == []


def test_a_last_round_difference_is_told_apart_from_an_earlier_one():
    compare = RoundCompare()
    # the reference's last round accepted 5, of which it kept 2; ours stopped at 2
    compare_rounds([3, 4, 5], [3, 4, 2], 9, compare, {"prompt": 0})
    # an extra round of ours after a shorter last one still counts as "last rounds"
    compare_rounds([2, 6], [2, 3, 1], 6, compare, {"prompt": 1})
    compare_rounds([2, 6, 1, 1], [3, 5, 1, 1], 10, compare, {"prompt": 2})
    assert compare.differ_last_only == 2 and compare.differ_earlier == 1
    assert compare.identical == 2 + 1 + 2
    assert compare.first_differences[0] == {
        "prompt": 0, "round": 2, "of": 3, "reference": [5], "ours": [2]
    }  # fmt: skip
    assert compare.first_differences[2]["round"] == 0


def test_legacy_crop_keeps_the_first_positions():
    cache = LegacyCropCache()
    keys = torch.arange(10, dtype=torch.float32).view(1, 1, 10, 1)
    cache.update(keys, keys.clone(), 0)
    cache.crop(7)
    assert cache.get_seq_length() == 7
    assert torch.equal(cache.layers[0].keys, keys[:, :, :7])
    cache.crop(9)  # longer than the cache: nothing to drop
    assert cache.get_seq_length() == 7


def test_a_directory_without_the_reference_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="has no ddtree.py"):
        load_reference(tmp_path)


def test_markdown_table():
    row = {
        "setting": "ddtree B=32", "reference_tau": 4.06, "ours_tau": 3.98,
        "reference_tokens_per_s": 100.0, "ours_tokens_per_s": 130.0,
        "ours_over_reference": 1.3, "ours_over_reference_cpu_time": 1.25,
        "rounds_identical": 247, "rounds_compared": 255,
        "reference_tau_kept_tokens": 3.984, "ours_tau_same_rounds": 4.0,
        "mismatched_prompts": 0,
        "reference_ms_per_round": {"draft": 2.0, "verify": 9.0, "other": 1.0, "total": 12.0},
        "ours_ms_per_round": {"draft": 1.5, "tree": 0.1, "verify": 7.0, "other": 0.4, "total": 9.0},
    }  # fmt: skip
    report = {
        "date": "2026-12-01T09:00:00+00:00", "command": "python -m benchmarks.reference",
        "prompts": 8, "max_tokens": 128, "machine": {"torch_threads": 1}, "rows": [row],
    }  # fmt: skip
    lines = render_markdown(report).splitlines()
    assert (
        "| ddtree B=32 | 4.06 | 3.98 | 100.0 | 130.0 | 1.30 | 1.25 | 247/255 | 3.984 / 4.000 | 0 |"
        in lines
    )
    assert lines[-1] == (
        "| ddtree B=32 | draft 2.00, verify 9.00, other 1.00, total 12.00 "
        "| draft 1.50, tree 0.10, verify 7.00, other 0.40, total 9.00 |"
    )
