"""The one interface every drafter implements.

A `Drafter` is loaded once and shared by requests; `start()` gives each request its
own `DraftSession`, which holds that request's drafter state (a KV cache, target
features, or nothing).

A session proposes either synchronously (`propose`, compute-bound drafters: the round
runs it in a worker thread) or asynchronously (`apropose`, drafters that wait on I/O,
e.g. a draft model behind its own server: it runs in the event loop). The round calls
`draft()` below, which picks the one a session has. A drafter whose proposal can fail
for reasons outside the request (its server is down or slow) raises `DraftError`: the
round then goes on without a draft, and the request never sees the failure.
"""

from __future__ import annotations

import asyncio
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
    # Optional class attribute `inline = True`: propose is cheap pure Python, called in
    # the event loop's thread rather than a worker's (see `draft`).

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


class AsyncDraftSession(Protocol):
    """A session whose drafts wait on I/O (a draft server): `apropose` runs in the event
    loop. Same contract as `DraftSession.propose`, plus `DraftError` when the draft
    cannot be had this round; `draft_calls` counts its calls to the server."""

    draft_calls: int

    async def apropose(
        self, committed: Sequence[int], depth: int, top_k: int
    ) -> DraftDistribution: ...

    def advance(self, committed: Sequence[int], target_features: torch.Tensor | None) -> None: ...


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
    ) -> DraftSession | AsyncDraftSession:
        """A session for one request. prompt_features: [len(prompt_ids) - 1, F] or None."""
        ...


class ServedDrafter(Protocol):
    """What a drafter behind its own server adds to `Drafter`: the runtime connects it
    once (checking it against the target's tokenization), asks it for /health, and
    closes it. Its sessions implement `apropose` and count their calls in
    `draft_calls`."""

    async def connect(self, target_tokens: Tokens) -> None: ...

    async def health(self) -> dict[str, Any]: ...

    def counters(self) -> dict[str, Any]:
        """Process-wide totals for /metrics: {"calls": int, "failures": {kind: int}}."""
        ...

    async def aclose(self) -> None: ...


async def draft(
    session: DraftSession | AsyncDraftSession, committed: Sequence[int], depth: int, top_k: int
) -> DraftDistribution:
    """The session's proposal: `apropose` awaited in the loop if it has one; `propose`
    called right here if the session says it is `inline` (cheap Python that holds the
    GIL anyway); else `propose` in a worker thread (a model drafter computes for
    milliseconds, mostly in torch kernels that release the GIL).

    Why not every drafter in a thread: a worker thread running Python takes the GIL
    each time the loop's thread lets it go for a system call, and gives it back only
    after the 5 ms switch interval. Measured with the n-gram drafter's shadow rounds in
    a worker thread, 16 plain streams: the loop spent 8 ms in each socket `send`
    (cProfile: 2.86 s of 3.43 s)."""
    apropose = getattr(session, "apropose", None)
    if apropose is not None:
        return await apropose(committed, depth, top_k)
    if getattr(session, "inline", False):
        return session.propose(committed, depth, top_k)
    return await asyncio.to_thread(session.propose, committed, depth, top_k)


def draft_calls(session: DraftSession | AsyncDraftSession | None) -> int:
    """Calls the session has made to a draft server so far (0 for in-process drafters)."""
    return int(getattr(session, "draft_calls", 0))
