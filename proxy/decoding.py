"""The one decoding loop, shared by engine mode, proxy mode, the CLI and the server.

Each round: draft -> build the tree -> verify it on the target -> walk -> commit the
accepted tokens and the bonus token -> let the target and drafter keep state. The
loop knows nothing about HTTP or models: it sees a `Target` session that returns
"the target's token at the root and at every node", and a `DraftSession`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from proxy.backend.base import Target
from proxy.drafter.base import Drafter
from proxy.sampling import SamplingParams
from proxy.tree import DraftTree, build_chain, build_tree, walk

DEFAULT_DEPTH = 8  # used when the drafter has no block limit of its own

Detokenize = Callable[[list[int]], Awaitable[str]]


class TreeSettings(BaseModel):
    """How each round's draft tree is shaped."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["ddtree", "chain", "none"] = Field(
        "ddtree", description="ddtree: best-first tree; chain: rank-0 path; none: no drafting"
    )
    budget: int = Field(16, ge=1, le=4096, description="tree nodes per round (ddtree)")
    depth: int | None = Field(
        None, ge=1, le=256, description="levels per round; default: the drafter's maximum, else 8"
    )


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    tree: TreeSettings = TreeSettings()
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before the first one
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens besides EOS
    ignore_eos: bool = False
    logprobs: bool = False  # report the target's log-prob of each emitted token

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


@dataclass
class GenerationStats:
    rounds: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # per round: accepted + 1
    tree_nodes: list[int] = field(default_factory=list)  # per round, root excluded
    draft_s: float = 0.0
    tree_s: float = 0.0
    verify_s: float = 0.0
    upstream_calls: int = 0
    verify_prompt_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        if not self.acceptance_lengths:
            return 0.0
        return float(np.mean(self.acceptance_lengths))

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_lengths": list(self.acceptance_lengths),
            "mean_tree_nodes": float(np.mean(self.tree_nodes)) if self.tree_nodes else 0.0,
            "draft_s": round(self.draft_s, 6),
            "tree_s": round(self.tree_s, 6),
            "verify_s": round(self.verify_s, 6),
            "upstream_calls": self.upstream_calls,
            "verify_prompt_tokens": self.verify_prompt_tokens,
        }


@dataclass(frozen=True)
class Delta:
    """What one round adds to the output (possibly nothing, while text is held back)."""

    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    finish_reason: Literal["stop", "length"] | None = None


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats
    logprobs: list[float] | None = None


def resolve_depth(tree: TreeSettings, drafter: Drafter | None) -> int:
    """The depth a request will draft to; raises ValueError if the drafter cannot."""
    max_depth = drafter.max_depth if drafter is not None else None
    depth = tree.depth or max_depth or DEFAULT_DEPTH
    if max_depth is not None and depth > max_depth:
        raise ValueError(
            f"depth {depth} exceeds the {drafter.name} drafter's maximum of {max_depth}"
        )
    return depth


def _root_only(root_token: int) -> DraftTree:
    return DraftTree(
        token_ids=np.asarray([root_token], dtype=np.int64),
        depths=np.zeros(1, dtype=np.int64),
        parents=np.full(1, -1, dtype=np.int64),
        path_log_probs=np.zeros(1),
        children=({},),
    )


class _StopScanner:
    """Stop-string detection and the text that is safe to stream so far."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1

    def find(self, text: str, start: int) -> int:
        """Index of the earliest stop string in text[start:], or -1."""
        hits = [idx for s in self.stop if (idx := text.find(s, max(0, start))) >= 0]
        return min(hits, default=-1)

    def safe_len(self, text: str) -> int:
        """Length of the prefix that no later token can turn into a stop string or
        into a different character (a trailing U+FFFD is an unfinished UTF-8 byte run)."""
        end = len(text) - self.hold
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        return max(end, 0)


async def stream_generate(
    target: Target,
    drafter: Drafter | None,
    request: GenerationRequest,
    detokenize: Detokenize,
    stats: GenerationStats | None = None,
) -> AsyncIterator[Delta]:
    """Yield the output round by round; the last Delta carries the finish reason.

    `stats`, when given, is filled in as the generation runs (read it afterwards).
    """
    stats = stats if stats is not None else GenerationStats()
    settings = request.tree
    use_drafter = settings.kind != "none"
    if use_drafter and drafter is None:
        raise ValueError(f"tree kind {settings.kind!r} needs a drafter")
    depth_setting = resolve_depth(settings, drafter) if use_drafter else 0
    if len(request.prompt_ids) >= target.max_model_len:
        raise ValueError(
            f"prompt has {len(request.prompt_ids)} tokens; the target's limit is "
            f"{target.max_model_len} (prompt + output)"
        )
    stop_tokens = set(request.stop_token_ids)
    if not request.ignore_eos:
        stop_tokens.update(target.eos_token_ids)
    scanner = _StopScanner(request.stop)

    feature_layers = drafter.target_layer_ids if use_drafter else None
    session = await target.start(
        request.prompt_ids, request.sampling, feature_layers, want_logprobs=request.logprobs
    )
    try:
        draft_session = (
            drafter.start(request.prompt_ids, session.prompt_features) if use_drafter else None
        )
        committed = list(request.prompt_ids)
        generated: list[int] = []
        logprobs: list[float] | None = [] if request.logprobs else None
        text_tokens: list[int] = []  # generated tokens that count towards the text
        emitted_text = ""
        emitted_tokens = 0
        finish: Literal["stop", "length"] | None = None

        while finish is None:
            remaining = request.max_tokens - len(generated)
            depth = min(depth_setting, remaining - 1, target.max_model_len - len(committed) - 1)
            root = committed[-1]
            start = time.perf_counter()
            if depth >= 1 and draft_session is not None:
                top_k = 1 if settings.kind == "chain" else settings.budget
                # A model drafter computes for milliseconds: keep the event loop free.
                dist = await asyncio.to_thread(draft_session.propose, committed, depth, top_k)
                drafted = time.perf_counter()
                if settings.kind == "chain":
                    tree = build_chain(root, dist, depth)
                else:
                    tree = build_tree(root, dist, settings.budget, depth)
            else:
                drafted = start
                tree = _root_only(root)
            built = time.perf_counter()
            verification = await session.verify(committed, tree)
            result = walk(tree, verification.tokens)
            features = await session.accept(tree, result)
            verified = time.perf_counter()

            stats.rounds += 1
            stats.acceptance_lengths.append(result.acceptance_length)
            stats.tree_nodes.append(tree.num_nodes)
            stats.draft_s += drafted - start
            stats.tree_s += built - drafted
            stats.verify_s += verified - built
            stats.upstream_calls = session.counters.upstream_calls
            stats.verify_prompt_tokens = session.counters.verify_prompt_tokens

            new_tokens = result.committed_tokens
            new_logprobs = None
            if verification.logprobs is not None:
                rows = [0, *result.accepted_nodes]
                new_logprobs = [float(verification.logprobs[row]) for row in rows]
            committed.extend(new_tokens)
            if draft_session is not None:
                draft_session.advance(committed, features)

            prev_text_len = len(text_tokens)
            for offset, token in enumerate(new_tokens):
                generated.append(token)
                if logprobs is not None and new_logprobs is not None:
                    logprobs.append(new_logprobs[offset])
                if token in stop_tokens:
                    finish = "stop"
                    break
                text_tokens.append(token)
                if len(generated) >= request.max_tokens:
                    finish = "length"
                    break
            if finish is None and len(committed) >= target.max_model_len:
                finish = "length"

            text = await detokenize(text_tokens)
            if request.stop:
                stop_at = scanner.find(text, len(emitted_text) - scanner.hold)
                if stop_at >= 0:
                    # Keep tokens up to the one that completed the stop string (a stop
                    # token after it is dropped too: generated == text_tokens + [stop]).
                    keep = len(text_tokens)
                    for candidate in range(prev_text_len + 1, len(text_tokens)):
                        if scanner.find(await detokenize(text_tokens[:candidate]), 0) >= 0:
                            keep = candidate
                            break
                    del text_tokens[keep:]
                    generated = list(text_tokens)
                    if logprobs is not None:
                        del logprobs[len(generated) :]
                    text = text[:stop_at]
                    finish = "stop"
            safe = len(text) if finish is not None else scanner.safe_len(text)
            delta_text = text[len(emitted_text) : max(safe, len(emitted_text))]
            emitted_text += delta_text
            delta_tokens = generated[emitted_tokens:]
            delta_logprobs = logprobs[emitted_tokens:] if logprobs is not None else None
            emitted_tokens = len(generated)
            yield Delta(
                token_ids=delta_tokens,
                text=delta_text,
                logprobs=delta_logprobs,
                finish_reason=finish,
            )
    finally:
        await session.aclose()


async def generate(
    target: Target,
    drafter: Drafter | None,
    request: GenerationRequest,
    detokenize: Detokenize,
) -> GenerationResult:
    """Run a generation to the end and collect it."""
    stats = GenerationStats()
    token_ids: list[int] = []
    logprobs: list[float] | None = [] if request.logprobs else None
    text = ""
    finish = "length"
    async for delta in stream_generate(target, drafter, request, detokenize, stats):
        token_ids.extend(delta.token_ids)
        text += delta.text
        if logprobs is not None and delta.logprobs is not None:
            logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            finish = delta.finish_reason
    return GenerationResult(
        token_ids=token_ids, text=text, finish_reason=finish, stats=stats, logprobs=logprobs
    )
