"""Model-free drafter: continuations of earlier occurrences of the current suffix.

The longest suffix (up to `max_ngram` tokens, at least `min_ngram`) that occurred
earlier in the committed tokens is looked up; each occurrence's continuation votes
for the token at each depth. Several occurrences with different continuations give
natural branching. Log-prob of a candidate = log(votes / (occurrences + 1)): a
single match is never fully certain. Costs microseconds; strong on repetitive text.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Sequence

import numpy as np

from proxy.drafter.base import InProcessDrafter, TargetInfo
from proxy.tree import DraftDistribution

if TYPE_CHECKING:
    import torch


def _match_starts(tokens: np.ndarray, ngram: int) -> np.ndarray:
    """Start indices of the continuations after earlier occurrences of the last `ngram` tokens."""
    if tokens.shape[0] <= ngram:
        return np.empty(0, dtype=np.int64)
    # Where an occurrence ends: the last token's earlier places (the suffix itself
    # excluded), kept while the tokens before them match too (a few numpy calls; numpy's
    # sliding windows cost tens of microseconds a call).
    ends = np.nonzero(tokens[:-1] == tokens[-1])[0]
    ends = ends[ends >= ngram - 1]
    for back in range(1, ngram):
        ends = ends[tokens[ends - back] == tokens[-1 - back]]
    return ends + 1


class NgramSession:
    draft_calls = 0  # an in-process drafter calls no server

    def __init__(self, drafter: "NgramDrafter"):
        self.drafter = drafter

    async def propose(
        self, committed: Sequence[int], depth: int, top_k: int
    ) -> DraftDistribution:
        # A fraction of a millisecond of numpy: right here in the event loop (see
        # proxy.drafter.base on why not in a worker thread).
        tokens = np.asarray(committed, dtype=np.int64)
        token_ids = np.zeros((depth, top_k), dtype=np.int64)
        log_probs = np.full((depth, top_k), -np.inf)
        starts = np.empty(0, dtype=np.int64)
        for ngram in range(self.drafter.max_ngram, self.drafter.min_ngram - 1, -1):
            starts = _match_starts(tokens, ngram)
            if starts.size:
                break
        starts = starts[-self.drafter.max_matches :]  # the most recent occurrences
        for depth_idx in range(depth):
            positions = starts + depth_idx
            positions = positions[positions < tokens.shape[0]]
            if positions.size == 0:
                break
            votes = Counter(tokens[positions].tolist())
            # Most votes first; ties go to the smaller token id, for determinism.
            ranked = sorted(votes.items(), key=lambda item: (-item[1], item[0]))[:top_k]
            for rank, (token, count) in enumerate(ranked):
                token_ids[depth_idx, rank] = token
                log_probs[depth_idx, rank] = np.log(count / (starts.size + 1))
        return DraftDistribution(token_ids=token_ids, log_probs=log_probs)

    def advance(self, committed: Sequence[int], target_features: torch.Tensor | None) -> None:
        return None


class NgramDrafter(InProcessDrafter):
    name = "ngram"
    max_depth: int | None = None
    target_layer_ids: tuple[int, ...] | None = None

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_matches: int = 16):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = max_matches

    @classmethod
    def load(cls, path: str | None, target: TargetInfo) -> "NgramDrafter":
        if path:
            raise ValueError(f"the ngram drafter takes no model path, got {path!r}")
        return cls()

    def start(
        self, prompt_ids: Sequence[int], prompt_features: torch.Tensor | None
    ) -> NgramSession:
        return NgramSession(self)
