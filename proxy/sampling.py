"""Sampling parameters, and the seed of each draw (no torch: proxy mode needs these too).

Lossless sampling needs an independent draw at every node. With a client seed the
draw for the token at absolute position p uses a generator seeded with
derive_seed(seed, p): siblings share it, but only one of them is ever on the
accepted path, so the output for a given seed does not depend on the drafter, the
budget or the tree shape.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


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
