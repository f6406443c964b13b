"""The one interface every drafter implements.

A `Drafter` is loaded once and shared by requests; `start()` gives each request its
own `DraftSession`, which holds that request's drafter state (a KV cache, target
features, or nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Sequence

from proxy.tree import DraftDistribution

if TYPE_CHECKING:  # torch is needed only by the model drafters, which import it themselves
    import torch


@dataclass(frozen=True)
class TargetInfo:
    """What a drafter may know about its target when it is loaded."""

    vocab_size: int
    num_hidden_layers: int
    hidden_size: int
    # The target's local directory (config, tokenizer, safetensors); None if unknown.
    model_dir: Path | None = None
    # The in-process target (engine mode), to share embed_tokens / lm_head; None in
    # proxy mode, where a drafter that needs them reads them from model_dir.
    model: torch.nn.Module | None = None


class DraftSession(Protocol):
    def propose(self, committed: Sequence[int], depth: int, top_k: int) -> DraftDistribution:
        """Per-depth top-k log-probs for depths 1..depth after committed[-1] (the root).

        Returns a DraftDistribution of shape [depth, top_k]; ranks a drafter cannot
        fill carry log-prob -inf.
        """
        ...

    def advance(self, committed: Sequence[int], target_features: torch.Tensor | None) -> None:
        """Take the state after a round.

        committed: every token so far, the new root last.
        target_features: [n, num_feature_layers * hidden] float, the target's hidden
        states (at the drafter's `target_layer_ids`) of the n tokens the target has
        processed since the last call, i.e. committed[-n-1:-1]; None unless the
        drafter asked for features.
        """
        ...


class Drafter(Protocol):
    name: str
    # Largest depth the drafter can propose in one call; None = no limit.
    max_depth: int | None
    # Target layers whose hidden states the drafter conditions on; None = needs none.
    target_layer_ids: tuple[int, ...] | None

    @classmethod
    def load(cls, path: str | None, target: TargetInfo) -> "Drafter":
        """Load from `path` (the part after ':' in --drafter NAME:PATH), or the default."""
        ...

    def start(
        self, prompt_ids: Sequence[int], prompt_features: torch.Tensor | None
    ) -> DraftSession:
        """A session for one request. prompt_features: [len(prompt_ids) - 1, F] or None."""
        ...
