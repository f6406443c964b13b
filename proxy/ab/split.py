"""Which arm a request goes to.

Arms: "ddtree" (served by the decoding loop) and "direct" (passed through to vLLM
unchanged). A request with a client key (header `x-ddtree-ab-key`, else the body's
`user`) lands by the key's hash, so one user always meets the same arm while the share
stays put; without a key, by chance. A request that forces an arm (`x-ddtree: on|off`,
a `ddtree` field) gets it whatever the split.
"""

from __future__ import annotations

import hashlib
import random
from typing import Literal

Arm = Literal["ddtree", "direct"]
ARMS: tuple[Arm, ...] = ("ddtree", "direct")


def key_point(key: str) -> float:
    """A key's place in [0, 1): the first 8 bytes of its SHA-256 (stable across
    processes and versions, unlike Python's `hash`)."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


class Split:
    """`share` of the requests go to DDTree; changeable while serving."""

    def __init__(self, share: float, rng: random.Random | None = None):
        self.share = share
        self._rng = rng or random.Random()

    @property
    def share(self) -> float:
        return self._share

    @share.setter
    def share(self, share: float) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"the split must be between 0 and 1, got {share}")
        self._share = share

    def assign(self, key: str | None) -> Arm:
        point = key_point(key) if key else self._rng.random()
        return "ddtree" if point < self._share else "direct"
