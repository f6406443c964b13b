"""The one interface every drafter implements.

A `Drafter` is loaded once and shared by requests; `start()` gives each request its
own `DraftSession`, which holds that request's drafter state (a KV cache, target
features, or nothing).

Every session proposes through one awaitable, `propose`; how it computes is its own
business: a model drafter computes in a worker thread (milliseconds, mostly in torch
kernels that release the GIL), the n-gram drafter right in the event loop (a fraction
of a millisecond of numpy), a served drafter waits on its server's answer. A drafter
whose proposal can fail for reasons outside the request (its server is down or slow)
raises `DraftError`: the round then goes on without a draft, and the request never
sees the failure.

Why not every drafter in a worker thread: a worker thread running Python takes the GIL
each time the loop's thread lets it go for a system call, and gives it back only after
the 5 ms switch interval. Measured with the n-gram drafter's shadow rounds in a worker
thread, 16 plain streams: the loop spent 8 ms in each socket `send` (cProfile: 2.86 s
of 3.43 s).

A drafter behind its own server is connected at start-up, asked for /health, counted
on /metrics and closed; an in-process drafter inherits the no-op versions of those
from `InProcessDrafter`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from proxy.tree import DraftDistribution

if TYPE_CHECKING:  # torch is needed only by the model drafters, which import it themselves
    import torch

    from proxy.tokens import Tokens


class DraftError(RuntimeError):
    """A draft could not be had this round (the drafter's fault, not the request's).

    `kind`: "timeout", "connect", "network", "http", "malformed" (as for upstream
    failures), or "unavailable" (the drafter is backing off after earlier failures).
    """

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


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
    draft_calls: int  # calls this request made to a draft server (0 in process)

    async def propose(self, committed: Sequence[int], depth: int, top_k: int) -> DraftDistribution:
        """Per-depth top-k log-probs for depths 1..depth after committed[-1] (the root).

        Returns a DraftDistribution of shape [depth, top_k]; ranks a drafter cannot
        fill carry log-prob -inf. Raises DraftError when the draft cannot be had this
        round (a served drafter's server is down or slow).
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

    async def connect(self, target_tokens: Tokens) -> None:
        """Reach the drafter's server, if it has one, and check that it tokenizes as the
        target does (ValueError naming the problem otherwise)."""
        ...

    async def health(self) -> dict[str, Any] | None:
        """Its server's state for /health; None for an in-process drafter."""
        ...

    def counters(self) -> dict[str, Any] | None:
        """Process-wide totals for /metrics, {"calls": int, "failures": {kind: int}};
        None for an in-process drafter (it calls no server)."""
        ...

    async def aclose(self) -> None: ...


class InProcessDrafter:
    """What a drafter that runs in this process has in place of a server's life cycle."""

    async def connect(self, target_tokens: Tokens) -> None:
        return None

    async def health(self) -> dict[str, Any] | None:
        return None

    def counters(self) -> dict[str, Any] | None:
        return None

    async def aclose(self) -> None:
        return None
