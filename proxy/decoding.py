"""The one decoding loop, shared by engine mode, proxy mode, the CLI, the server and the
benchmarks.

`stream_generate` starts a target session and a draft session, then runs rounds
(`proxy.round.speculate`: draft -> build -> verify -> walk -> commit) and hands each
round's tokens to the output processor (`proxy.output.OutputProcessor`: stop rules,
text, logprobs), yielding one `Delta` per round until the output finishes. The loop
knows nothing about HTTP or models: it sees a `Target` and a `Drafter`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from proxy.adaptive import AdaptiveState, Controller
from proxy.adaptive.controller import SHADOW_EVERY
from proxy.backend.base import SessionOptions, Target, TargetError, TargetSession
from proxy.drafter.base import Drafter, DraftError, DraftSession
from proxy.output import WINDOW_TOKENS, Delta, Detokenize, OutputProcessor
from proxy.round import RoundShape, RoundStats, draft_tree, speculate
from proxy.sampling import SamplingParams

DEFAULT_DEPTH = 8  # used when the drafter has no block limit of its own

TreeKind = Literal["ddtree", "chain", "none"]
BudgetPolicy = Literal["adaptive", "fixed"]


class TreeSettings(BaseModel):
    """How each round's draft tree is shaped."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: TreeKind = Field(
        "ddtree", description="ddtree: best-first tree; chain: rank-0 path; none: no drafting"
    )
    budget: int = Field(16, ge=1, le=4096, description="tree nodes per round (ddtree)")
    depth: int | None = Field(
        None, ge=1, le=256, description="levels per round; default: the drafter's maximum, else 8"
    )
    policy: BudgetPolicy = Field(
        "adaptive",
        description="adaptive: per round, the nodes (up to budget) or plain generation with "
        "the most expected tokens per second; fixed: always the budget",
    )


class PromptError(ValueError):
    """The prompt itself is unusable (the HTTP layer names the prompt field)."""


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
    strategy: str | None = None  # how the target verifies a tree; None = its default
    # The client reads the output as it comes (a stream). If not, plain generation's
    # tokens are handed on in pieces (fewer detokenizations).
    stream: bool = True
    # Text is decoded by a server, each decode an HTTP call (no tokenizer file on this
    # host): one decode of the whole output per round, and plain generation's tokens in
    # pieces even for a stream -- never a call per token.
    remote_text: bool = False
    # The sampling fields the client set, as it set them (vLLM's names): a remote target
    # sends these and no others, so its server applies its own defaults to the rest.
    # None: `sampling` is the whole rule (sent in full).
    sampling_fields: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise PromptError("prompt is empty: at least one token is needed")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


@dataclass
class GenerationStats:
    """A request's rounds, summed (`add` one round at a time)."""

    rounds: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # per round: accepted + 1
    tree_nodes: list[int] = field(default_factory=list)  # per round, root excluded
    draft_s: float = 0.0
    tree_s: float = 0.0
    verify_s: float = 0.0
    upstream_calls: int = 0
    verify_prompt_tokens: int = 0
    plain_tokens: int = 0  # tokens from plain generation (the adaptive policy's fallback)
    plain_calls: int = 0  # plain streams opened (not counted in upstream_calls)
    switches_to_plain: int = 0
    switches_to_speculation: int = 0
    draft_calls: int = 0  # calls to a draft server (served drafters)
    draft_failures: int = 0  # rounds that went on without a draft (DraftError)

    def add(self, stats: RoundStats) -> None:
        self.verify_prompt_tokens += stats.verify_prompt_tokens
        self.switches_to_plain += stats.switches_to_plain
        self.switches_to_speculation += stats.switches_to_speculation
        if stats.kind == "plain":
            self.plain_tokens += stats.num_tokens
            self.plain_calls += stats.upstream_calls
            self.verify_s += stats.verify_s
            return
        self.upstream_calls += stats.upstream_calls
        self.rounds += 1
        self.acceptance_lengths.append(stats.num_tokens)
        self.tree_nodes.append(stats.num_nodes)
        self.draft_s += stats.draft_s
        self.tree_s += stats.tree_s
        self.verify_s += stats.verify_s
        self.draft_calls += stats.draft_calls
        self.draft_failures += stats.draft_error is not None

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
            "plain_tokens": self.plain_tokens,
            "plain_calls": self.plain_calls,
            "switches_to_plain": self.switches_to_plain,
            "switches_to_speculation": self.switches_to_speculation,
            "draft_calls": self.draft_calls,
            "draft_failures": self.draft_failures,
        }


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: int | str | None
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


async def stream_generate(
    target: Target,
    drafter: Drafter | None,
    request: GenerationRequest,
    detokenize: Detokenize,
    adaptive: AdaptiveState | None = None,
) -> AsyncIterator[Delta]:
    """Yield the output round by round; the last Delta carries the finish reason.

    `adaptive`: what the adaptive policy has learnt (shared by a runtime's requests);
    without it, or with policy "fixed", every round verifies the full budget."""
    settings = request.tree
    use_drafter = settings.kind != "none"
    if use_drafter and drafter is None:
        raise ValueError(f"tree kind {settings.kind!r} needs a drafter")
    max_depth = resolve_depth(settings, drafter) if use_drafter else 0
    if len(request.prompt_ids) >= target.max_model_len:
        raise PromptError(
            f"prompt has {len(request.prompt_ids)} tokens; the target's limit is "
            f"{target.max_model_len} (prompt + output)"
        )
    output = OutputProcessor(
        detokenize,
        max_tokens=request.max_tokens,
        stop_token_ids=request.stop_token_ids,
        eos_token_ids=target.eos_token_ids,
        ignore_eos=request.ignore_eos,
        stop=request.stop,
        logprobs=request.logprobs,
        window_tokens=None if request.remote_text else WINDOW_TOKENS,
    )
    options = SessionOptions(
        sampling=request.sampling,
        feature_layer_ids=drafter.target_layer_ids if use_drafter else None,
        want_logprobs=request.logprobs,
        strategy=request.strategy,
        stop_token_ids=request.stop_token_ids,
        sampling_fields=request.sampling_fields,
    )
    session = await target.start(request.prompt_ids, options)
    controller: Controller | None = None
    try:
        if adaptive is not None and use_drafter and settings.policy == "adaptive":
            controller = adaptive.controller(
                can_stream=session.plain is not None, seeded=request.sampling.seed is not None
            )
            controller.start()  # `finish` below balances it
        draft_session = (
            drafter.start(request.prompt_ids, session.prompt_features) if use_drafter else None
        )
        committed = list(request.prompt_ids)
        unseen_tokens = len(committed)  # context the target has not seen yet
        reported = (0, 0)  # the controller's switch counts already reported
        while output.finish_reason is None:
            depth = min(max_depth, output.remaining - 1, target.max_model_len - len(committed) - 1)
            shape = RoundShape(kind=settings.kind, budget=settings.budget, depth=depth)
            if controller is not None and controller.next_is_plain():
                assert adaptive is not None and draft_session is not None
                chunk = _plain_stream(
                    session, draft_session, committed, output, controller, adaptive, shape,
                    target.max_model_len, request.stream, opening=len(committed) == unseen_tokens,
                    per_event=request.stream and not request.remote_text,
                )  # fmt: skip
                async for delta in chunk:
                    yield delta
                unseen_tokens = 1  # the stream left the target's cache holding the context
                continue
            choose = None
            if controller is not None:
                choose = functools.partial(controller.choose_nodes, new_tokens=unseen_tokens)
            done = await speculate(session, draft_session, committed, shape, choose)
            stats = done.stats
            if controller is not None and adaptive is not None:
                _learn(controller, adaptive, done, unseen_tokens)
                counts = (controller.num_switches_to_plain, controller.num_switches_to_speculation)
                stats = dataclasses.replace(
                    stats,
                    switches_to_plain=counts[0] - reported[0],
                    switches_to_speculation=counts[1] - reported[1],
                )
                reported = counts
            unseen_tokens = len(done.tokens)
            yield await output.add(
                done.tokens,
                done.logprobs,
                at_context_limit=len(committed) >= target.max_model_len,
                stats=stats,
            )
    finally:
        if controller is not None:
            controller.finish()
        await session.aclose()


def _learn(controller: Controller, adaptive: AdaptiveState, done, unseen_tokens: int) -> None:
    """Feed a verified round to the calibration and the cost model."""
    tree, stats = done.tree, done.stats
    controller.observe_round(tree, done.accepted_nodes)
    num_prompts = tree.num_nodes + 1
    adaptive.costs.observe_call(
        num_prompts, num_prompts * unseen_tokens + int(tree.depths.sum()), stats.verify_s
    )
    overhead = stats.draft_s + stats.tree_s
    adaptive.costs.observe_round(len(done.tokens), overhead + stats.verify_s, overhead)
    controller.observe_rate(len(done.tokens), overhead + stats.verify_s)


async def _plain_stream(
    session: TargetSession,
    draft_session: DraftSession,
    committed: list[int],
    output: OutputProcessor,
    controller: Controller,
    adaptive: AdaptiveState,
    shape: RoundShape,
    max_model_len: int,
    streaming: bool,
    opening: bool,
    per_event: bool,
) -> AsyncIterator[Delta]:
    """Plain generation from the target until the output ends or the controller closes
    the stream; shadow rounds (trees the drafter proposes on the way, walked once the
    tokens they predict arrive) tell the controller when speculation pays again.

    The target streams even when the client does not (`streaming` False): a stream can
    be closed the moment speculation pays again, where one answer could not (measured
    on vLLM-CPU, 96 tokens per request: 1.7 % slower at 1 client, no difference at 4).
    For such a client, events are passed on in pieces of `SHADOW_EVERY` tokens at least
    (fewer detokenizations; stops are found within a piece all the same) -- and where
    the stretch would not be closed anyway, it comes as one answer
    (`Controller.plain_in_one_answer`).

    `opening`: the request's first call (the target has not seen the prompt): its time
    holds the prompt's prefill, which speculation's first round pays as well (see
    `CostModel.observe_plain`). `per_event`: pass each event on as it comes (a
    streaming client whose text is decoded locally); else in pieces."""
    one_answer = controller.plain_in_one_answer(streaming)
    num_tokens = controller.plain_length(
        min(output.remaining, max_model_len - len(committed)), one_answer
    )
    started = last = piece_start = time.perf_counter()
    received = 0
    since_shadow = controller.shadow_every  # a shadow right at the start
    calls, sent = 1, len(committed)  # the stream's call and prompt, with its first piece
    pending: list[int] = []
    pending_logprobs: list[float] = []
    assert session.plain is not None  # the controller goes plain only where it can
    stream = session.plain(list(committed), num_tokens, stream=not one_answer)
    try:
        while True:
            if since_shadow >= controller.shadow_every and shape.depth >= 1 and not one_answer:
                await _add_shadow(draft_session, committed, controller, shape, since_shadow)
                since_shadow = 0
            tokens: list[int] = []
            ended = leave = False
            try:
                tokens, logprobs = await anext(stream)
            except StopAsyncIteration:
                ended = True
            except TargetError:
                # Plain generation that broke (a stream cannot be resumed as it was), but
                # every token so far is the target's: go on with verification rounds,
                # which are retried (and fail the request only if the upstream keeps
                # failing).
                controller.stop_plain()
                ended = True
            now = time.perf_counter()
            if tokens:
                received += len(tokens)
                last = now
                committed.extend(tokens)
                draft_session.advance(committed, None)
                leave = controller.observe_plain_tokens(committed, len(tokens))
                since_shadow += len(tokens)
                pending.extend(tokens)
                pending_logprobs.extend(logprobs or ())
            if pending and (per_event or ended or leave or len(pending) >= SHADOW_EVERY):
                stats = RoundStats(
                    num_tokens=len(pending),
                    num_nodes=0,
                    draft_s=0.0,
                    tree_s=0.0,
                    verify_s=now - piece_start,
                    upstream_calls=calls,
                    verify_prompt_tokens=sent,
                    kind="plain",
                )
                calls, sent, piece_start = 0, 0, now
                delta = await output.add(
                    pending,
                    pending_logprobs if output.want_logprobs else None,
                    at_context_limit=len(committed) >= max_model_len,
                    stats=stats,
                )
                pending, pending_logprobs = [], []
                yield delta
                if output.finish_reason is not None:
                    break
            if ended or leave:
                break
    finally:
        await stream.aclose()
    adaptive.costs.observe_plain(received, last - started, resumed=not opening)


async def _add_shadow(
    draft_session: DraftSession,
    committed: list[int],
    controller: Controller,
    shape: RoundShape,
    unseen_tokens: int,
) -> None:
    try:
        tree, _ = await draft_tree(draft_session, committed, shape)
    except DraftError:
        return  # no shadow this time: the drafter reports its own failures
    controller.add_shadow(tree, len(committed), unseen_tokens)


async def generate(
    target: Target,
    drafter: Drafter | None,
    request: GenerationRequest,
    detokenize: Detokenize,
    adaptive: AdaptiveState | None = None,
) -> GenerationResult:
    """Run a generation to the end and collect it."""
    stats = GenerationStats()
    token_ids: list[int] = []
    logprobs: list[float] | None = [] if request.logprobs else None
    text = ""
    finish, stop_reason = "length", None
    async for delta in stream_generate(target, drafter, request, detokenize, adaptive):
        stats.add(delta.round)
        token_ids.extend(delta.token_ids)
        text += delta.text
        if logprobs is not None and delta.logprobs is not None:
            logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            finish, stop_reason = delta.finish_reason, delta.stop_reason
    return GenerationResult(token_ids, text, finish, stop_reason, stats, logprobs)
