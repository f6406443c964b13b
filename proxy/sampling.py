"""Sampling parameters and the target-side token choice for engine mode.

Lossless sampling needs an independent draw at every node. With a client seed the
draw for the token at absolute position p uses a generator seeded with
derive_seed(seed, p): siblings share it, but only one of them is ever on the
accepted path, so the output for a given seed does not depend on the drafter, the
budget or the tree shape.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass, (0, 1]
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def derive_seed(seed: int, position: int) -> int:
    """A 63-bit seed for the draw of the token at absolute `position`."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] float32 probabilities after temperature, top-k and top-p."""
    scaled = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, sorted_idx = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, sorted_idx, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def select_tokens(
    logits: torch.Tensor,  # [n, vocab] float
    positions: np.ndarray,  # [n] int64: absolute position of the token being chosen
    params: SamplingParams,
) -> np.ndarray:  # [n] int64
    """The target's token for each row: argmax, or one independent draw per row."""
    assert logits.ndim == 2 and positions.shape == (logits.shape[0],)
    if params.greedy:
        return logits.argmax(dim=-1).cpu().numpy().astype(np.int64)
    probs = filtered_probs(logits, params)
    if params.seed is None:
        return torch.multinomial(probs, 1).squeeze(-1).cpu().numpy().astype(np.int64)
    tokens = np.empty(len(positions), dtype=np.int64)
    for row, position in enumerate(positions.tolist()):
        generator = torch.Generator().manual_seed(derive_seed(params.seed, position))
        tokens[row] = int(torch.multinomial(probs[row], 1, generator=generator))
    return tokens
