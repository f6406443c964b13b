"""The one interface every target implements.

The decoding loop sees "the target's token at the root and at every node" and
nothing else: how the target is reached (in-process Transformers, vLLM over HTTP)
stays inside `proxy/backend/`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np
import torch

from proxy.sampling import SamplingParams
from proxy.tree import DraftTree, WalkResult


class TargetError(RuntimeError):
    """The target failed in a way the client should see (upstream down, bad answer)."""


@dataclass(frozen=True)
class Verification:
    tokens: np.ndarray  # [num_nodes + 1] int64: the target's token at the root and each node
    # [num_nodes + 1] float64: log-prob of that token under the target, when asked for
    logprobs: np.ndarray | None = None


@dataclass
class TargetCounters:
    """Per-request cost counters, reported in usage.ddtree and the benchmarks."""

    upstream_calls: int = 0  # HTTP calls to the upstream (0 in engine mode)
    verify_prompt_tokens: int = 0  # tokens the target had to (re)compute for verification
    extra: dict[str, float] = field(default_factory=dict)


class TargetSession(Protocol):
    counters: TargetCounters
    # [len(prompt) - 1, F] hidden states of the prefilled prompt tokens at the
    # requested feature layers; None when no features were requested.
    prompt_features: torch.Tensor | None

    async def verify(self, committed: Sequence[int], tree: DraftTree) -> Verification:
        """The target's token at the root (committed[-1] == tree root) and at every node."""
        ...

    async def accept(self, tree: DraftTree, result: WalkResult) -> torch.Tensor | None:
        """Keep the accepted path; return features [1 + len(accepted), F] of the root and
        accepted nodes (the tokens the target has now processed), or None."""
        ...

    async def aclose(self) -> None: ...


class Target(Protocol):
    name: str
    max_model_len: int  # longest sequence (prompt + output) the target accepts
    eos_token_ids: tuple[int, ...]

    async def start(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        feature_layer_ids: tuple[int, ...] | None = None,
        want_logprobs: bool = False,
    ) -> TargetSession: ...
