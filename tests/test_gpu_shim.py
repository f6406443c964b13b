"""The benchmark's GPU shim (`benchmarks/gpu_shim.py`): its model of vLLM's prefix
cache, which decides the recomputed tokens each call is charged for."""

from __future__ import annotations

from benchmarks.gpu_shim import BLOCK, PrefixModel


def test_prefix_model_recomputes_past_the_longest_block_aligned_prefix_seen():
    prefixes = PrefixModel()
    prompt = list(range(3 * BLOCK + 5))
    assert prefixes.recompute(prompt) == len(prompt)
    assert prefixes.recompute(prompt) == 5  # three cached blocks
    assert prefixes.recompute(prompt[: 2 * BLOCK]) == 1  # the last token is always computed
    other = prompt[:BLOCK] + [9999] + prompt[BLOCK + 1 :]
    assert prefixes.recompute(other) == len(other) - BLOCK  # differs in the second block
