"""Pieces of the model-family trainer that the shipped weights depend on: the target's
greedy rollouts (the drafters' last training stage) and the drafter label choice."""

from __future__ import annotations

import pytest
import torch

from proxy.backend.engine.hf import load_causal_lm
from training.distill import train_drafters
from training.modelgen import random_qwen3
from training.rollouts import RowSampler, greedy_rollouts


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    path = random_qwen3(tmp_path_factory.mktemp("train") / "t", seed=11, initializer_range=0.2)
    return load_causal_lm(path)


def test_rollouts_are_the_targets_greedy_continuations(tiny_target):
    prefixes = torch.randint(0, 200, (5, 7), generator=torch.Generator().manual_seed(0))
    # Batches of 2: the last one is partial, and every row decodes independently.
    rows = greedy_rollouts(tiny_target, prefixes, num_new_tokens=9, batch_size=2)
    assert rows.shape == (5, 16)
    assert torch.equal(rows[:, :7], prefixes)
    with torch.inference_mode():
        for prefix, row in zip(prefixes, rows, strict=True):
            reference = prefix
            for _ in range(9):  # no cache, no EOS handling: argmax of a full forward
                next_id = tiny_target(input_ids=reference[None]).logits[0, -1].argmax()
                reference = torch.cat([reference, next_id[None]])
            assert torch.equal(row, reference)


def test_row_sampler_visits_every_row_once_per_epoch():
    rows = torch.arange(10)[:, None].repeat(1, 3)  # row i is all i
    sampler = RowSampler(rows, batch_size=5, seed=1)
    for _ in range(3):
        epoch = torch.cat([sampler.next_batch()[:, 0] for _ in range(2)])
        assert sorted(epoch.tolist()) == list(range(10))
    with pytest.raises(ValueError, match="cannot fill a batch"):
        RowSampler(rows[:3], batch_size=4, seed=0)


def test_unknown_label_kind_is_refused(tiny_target):
    with pytest.raises(ValueError, match="labels must be 'greedy' or 'soft'"):
        train_drafters(tiny_target, None, None, [], 1e-3, 1e-3, 0, 0.0, seed=0, labels="hard")
