"""The one interface every target implements.

The decoding loop sees "the target's token at the root and at every node" and
nothing else: how the target is reached (in-process Transformers, vLLM over HTTP)
stays inside `proxy/backend/`. Whatever differs between engine mode and proxy mode
is a property or a method of the target, never a mode string above this package.

This module imports no torch: proxy mode with a model-free drafter runs without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Protocol, Sequence

import numpy as np

from proxy.sampling import SamplingParams
from proxy.tree import DraftTree, WalkResult

if TYPE_CHECKING:
    import torch


# An upstream status worth another try: overload and server-side failures. A 4xx is
# the request's own fault and would fail again.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class TargetError(RuntimeError):
    """The target failed in a way the client should see.

    `kind` says how: "timeout", "connect", "network" (the call did not complete),
    "http" (the upstream answered with a non-200 `status`), "malformed" (an answer
    that does not parse or does not fit the request). This is the one classification
    of upstream failures; retries and the client-facing status are derived from it.
    """

    def __init__(
        self,
        message: str,
        kind: str = "malformed",
        status: int | None = None,
        error: dict[str, Any] | None = None,
    ):
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.error = error  # the upstream's own error object, when it sent one

    @property
    def retriable(self) -> bool:
        return self.kind != "http" or self.status in RETRY_STATUSES


class PlainStreamLost(TargetError):
    """A plain generation broke after its first tokens where going on from the committed
    tokens would change the output (a seeded request, which vLLM draws in one call from
    its seed): the request fails instead of resuming."""


@dataclass(frozen=True)
class SessionOptions:
    """Per-request choices a target session is started with."""

    sampling: SamplingParams = SamplingParams()
    # Target layers whose hidden states the drafter needs; None = none.
    feature_layer_ids: tuple[int, ...] | None = None
    want_logprobs: bool = False  # report the target's log-prob of each chosen token
    # How the target verifies a tree (one of `Target.strategies`); None = its default.
    strategy: str | None = None
    # The client's stop token ids. They do not change a verification (it asks for one
    # token), but a remote target sends them along so that its server judges them as it
    # would judge the client's own request (vLLM refuses out-of-vocabulary ids).
    stop_token_ids: tuple[int, ...] = ()
    # The output ends at the target's EOS (the client did not ask to ignore it): a plain
    # call may stop there too instead of generating on until the proxy closes it.
    stop_at_eos: bool = False
    # A remote target's sampling fields: exactly the ones the client set (vLLM's names),
    # so that its server applies its own defaults to the rest, as for a direct request;
    # None: `sampling` is the whole rule, sent in full with neutral penalties.
    sampling_fields: dict[str, Any] | None = None


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


class PlainGeneration(Protocol):
    """The target's own decoding, without a tree: what a session offers where plain
    generation is cheaper than a round of the root alone (a remote server's stream)."""

    def __call__(
        self, committed: Sequence[int], max_tokens: int, stream: bool = True
    ) -> AsyncIterator[tuple[list[int], list[float] | None]]:
        """Up to `max_tokens` tokens after `committed`, EOS ignored (the output
        processor decides where the output stops): yields (token ids, their log-probs
        or None) as they come -- streamed, or with `stream` False as one answer.
        Closing the iterator early ends the generation upstream."""
        ...


class TargetSession(Protocol):
    counters: TargetCounters
    # [len(prompt) - 1, F] hidden states of the prefilled prompt tokens at the
    # requested feature layers; None when no features were requested.
    prompt_features: torch.Tensor | None
    # Plain generation, where the target offers it; None: a round of the root alone is
    # the target's plain step (in-process targets).
    plain: PlainGeneration | None
    # Where the target is a server: `await relay(path, body, headers)` sends the client's
    # own request (JSON bytes, and headers of its own to pass on) to it and returns the
    # open streaming response (an httpx.Response); the server relays it when the rest of
    # a request is the target's alone (`proxy.decoding.HandOver`). None: no server.
    relay: Callable[[str, bytes, dict[str, str]], Awaitable[Any]] | None
    # The upstream replica serving the request now (several upstreams: the policy keeps
    # estimates per replica); None: the target is one.
    replica: str | None

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
    label: str  # what serves it, for /health and logs ("engine", "proxy")
    max_model_len: int  # longest sequence (prompt + output) the target accepts
    eos_token_ids: tuple[int, ...]
    strategies: tuple[str, ...]  # verification strategies it offers; () = just one way

    def check_options(self, options: SessionOptions) -> None:
        """Raise ValueError naming the problem if `start` would refuse these options."""
        ...

    async def start(self, prompt_ids: Sequence[int], options: SessionOptions) -> TargetSession: ...

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, details for /health)."""
        ...

    async def aclose(self) -> None: ...
