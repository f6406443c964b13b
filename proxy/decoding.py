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
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from proxy.adaptive.policy import (
    Decision,
    Finished,
    Plain,
    PlainTokens,
    Policy,
    RequestPolicy,
    RoundResult,
    Speculate,
)
from proxy.backend.base import (
    PlainGeneration,
    PlainStreamLost,
    SessionOptions,
    Target,
    TargetError,
)
from proxy.drafter.base import Drafter, DraftSession
from proxy.output import WINDOW_TOKENS, Delta, Detokenize, FinishReason, OutputProcessor
from proxy.round import RoundShape, RoundStats, draft, speculate
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
class Relayed:
    """What a relayed answer brought (`HandOver.outcome`)."""

    tokens: list[int]  # output token ids the client received
    seconds: float  # from the hand-over to the last event
    first: tuple[int, float] | None  # (tokens, seconds) of the first event with tokens
    # The answer went out whole (its finish reason, if it had one); else it broke after
    # `tokens`, and `text` is what the client got of them: the loop goes on from there.
    complete: bool
    finish_reason: FinishReason | None
    text: str = ""


@dataclass
class HandOver:
    """The rest of a request handed to the target whole: the policy left every token to
    it from the first, so the server sends the client's own request to the upstream
    (`relay`) and its answer to the client as it comes -- vLLM's own bytes, at the cost
    of a relay -- then sets `outcome` (None: the relay did not open, nothing was sent)
    and asks the loop for its next delta: the loop records the stretch and, if the
    answer broke, goes on from the tokens the client has."""

    relay: Callable[[str, bytes, dict[str, str]], Awaitable[Any]]  # `TargetSession.relay`
    sent: float  # time.perf_counter() at the hand-over
    outcome: Relayed | None = None


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
    # The server can relay the client's own request to the target (`HandOver`): when the
    # policy leaves the whole output to the target from the first token, the loop hands
    # it over instead of reading a plain stream itself.
    hand_over: bool = False

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
    policy: Policy | None = None,
) -> AsyncIterator[Delta]:
    """Yield the output step by step; the last Delta carries the finish reason.

    Each step drafts a tree at the end of the committed tokens; the policy (shared by a
    runtime's requests) decides to verify some of its nodes (a round) or to let the
    target generate on its own (plain generation, while a plain stream is open it
    decides every few tokens). A request that it leaves to the target from the first
    token to the end, with no decision on the way, is handed over where the request
    says the server can relay it (`HandOver`: one Delta carries it, then the relayed
    tokens come back as one Delta marked `relayed`). Without a policy, or with policy
    "fixed", every round verifies the whole tree."""
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
        stop_at_eos=not request.ignore_eos,
        sampling_fields=request.sampling_fields,
    )
    session = await target.start(request.prompt_ids, options)
    decisions: RequestPolicy | None = None
    if policy is not None and use_drafter and settings.policy == "adaptive":
        decisions = policy.request(
            can_plain=session.plain is not None,
            seeded=request.sampling.seed is not None,
            client_streams=request.stream,
            remote_text=request.remote_text,
            replica=lambda: session.replica,
        )
    stretch: _PlainStretch | None = None
    try:
        draft_session = (
            drafter.start(request.prompt_ids, session.prompt_features) if use_drafter else None
        )
        committed = list(request.prompt_ids)
        unseen_tokens = len(committed)  # context the target has not processed yet
        last_kind = None  # the previous step's kind, to count switches
        while output.finish_reason is None:
            step_started = time.perf_counter()
            room = target.max_model_len - len(committed)
            depth = min(max_depth, output.remaining - 1, room - 1)
            shape = RoundShape(kind=settings.kind, budget=settings.budget, depth=depth)
            drafted = await draft(draft_session, committed, shape)
            decision: Decision = Speculate(drafted.tree.num_nodes, "fixed")
            if decisions is not None:
                decision = decisions.decide(
                    drafted.tree,
                    position=len(committed),
                    unseen_tokens=unseen_tokens,
                    remaining=output.remaining,
                    max_depth=depth,
                )
            if isinstance(decision, Plain):
                assert session.plain is not None and decisions is not None
                whole = request.hand_over and _whole(decision, output.remaining)
                if whole and last_kind is None and session.relay is not None:
                    handed = HandOver(session.relay, time.perf_counter())
                    sent_tokens = len(committed)  # the prompt: the relay's call sends it
                    # No call counted yet: a relay that does not open sent nothing.
                    yield Delta([], "", round=_plain_stats(0, 0.0, 0), hand_over=handed)
                    came = handed.outcome
                    tokens = [] if came is None else came.tokens
                    committed.extend(tokens)
                    if draft_session is not None and tokens:
                        draft_session.advance(committed, None)
                    decisions.record(
                        PlainTokens(
                            committed=committed,
                            stretch_tokens=len(tokens),
                            seconds=0.0 if came is None else came.seconds,
                            ended=True,
                            # Whole but with no finish reason: vLLM sent an error event.
                            failed=came is None or came.finish_reason is None,
                            first=None if came is None else came.first,
                        )
                    )
                    if came is None:
                        continue  # nothing went out: a round follows (`plain_failed`)
                    last_kind, unseen_tokens = "plain", 1
                    stats = _plain_stats(len(tokens), came.seconds, sent_tokens)
                    if came.complete:
                        finish = came.finish_reason
                        yield Delta(tokens, "", finish_reason=finish, round=stats, relayed=True)
                        return
                    # The answer broke: its tokens are the target's, the text the client
                    # has of them is vLLM's; the output goes on from both.
                    yield await output.resume(tokens, came.text, stats)
                    continue
                if stretch is None:
                    max_tokens = min(decision.max_tokens, room)
                    stretch = _PlainStretch(session.plain, committed, max_tokens, decision.stream)
                else:  # a decision on the open stream: its host time prices the next
                    stretch.rechecks += 1
                    stretch.recheck_seconds += time.perf_counter() - step_started
                pieces = stretch.read(
                    decision.recheck_after, committed, draft_session, output, decisions,
                    per_event=request.stream and not request.remote_text,
                    max_model_len=target.max_model_len,
                    switched=last_kind == "speculative",
                )  # fmt: skip
                async for delta in pieces:
                    yield delta
                last_kind = "plain"
                if stretch.ended:
                    stretch = None
                unseen_tokens = 1  # the stream left the target holding the context
                continue
            if stretch is not None:
                await stretch.close(committed, decisions)
                stretch = None
            done = await speculate(session, draft_session, committed, drafted, decision.num_nodes)
            if decisions is not None:
                tree, stats = done.tree, done.stats
                num_prompts = tree.num_nodes + 1
                decisions.record(
                    RoundResult(
                        tree=tree,
                        accepted_nodes=done.accepted_nodes,
                        num_tokens=len(done.tokens),
                        seconds=stats.draft_s + stats.tree_s + stats.verify_s,
                        call_seconds=stats.verify_s,
                        num_prompts=num_prompts,
                        computed_tokens=num_prompts * unseen_tokens + int(tree.depths.sum()),
                    )
                )
            unseen_tokens = len(done.tokens)
            stats = done.stats
            if last_kind == "plain":
                stats = dataclasses.replace(stats, switches_to_speculation=1)
            last_kind = "speculative"
            yield await output.add(
                done.tokens,
                done.logprobs,
                at_context_limit=len(committed) >= target.max_model_len,
                stats=stats,
            )
    finally:
        if stretch is not None:
            await stretch.close(committed, decisions)
        if decisions is not None:
            decisions.record(Finished())
        await session.aclose()


def _whole(decision: Plain, remaining: int) -> bool:
    """The decision leaves every remaining token to one plain stream, with no decision
    on the way."""
    recheck = decision.recheck_after
    no_recheck = recheck is None or recheck >= remaining
    return decision.stream and decision.max_tokens >= remaining and no_recheck


def _plain_stats(num_tokens: int, seconds: float, prompt_tokens: int) -> RoundStats:
    """A relayed answer's stats: its call (`prompt_tokens` sent; 0: no call) and its
    tokens."""
    return RoundStats(
        num_tokens=num_tokens,
        num_nodes=0,
        draft_s=0.0,
        tree_s=0.0,
        verify_s=seconds,
        upstream_calls=int(prompt_tokens > 0),
        verify_prompt_tokens=prompt_tokens,
        kind="plain",
    )


class _PlainStretch:
    """One plain-generation call (a stream, or one answer) and what it has given."""

    def __init__(
        self, plain: PlainGeneration, committed: list[int], max_tokens: int, stream: bool
    ) -> None:
        self.events = plain(list(committed), max_tokens, stream=stream)
        self.sent = time.perf_counter()
        self.num_tokens = 0
        self.first: tuple[int, float] | None = None  # (tokens, seconds) of the first piece
        self.ended = False
        self.failed = False
        self.rechecks = 0  # decisions taken on the open call (`PlainTokens.rechecks`)
        self.recheck_seconds = 0.0
        self._unreported = (1, len(committed))  # (calls, prompt tokens) not yet in stats

    async def read(
        self,
        recheck_after: int | None,
        committed: list[int],
        draft_session: DraftSession | None,
        output: OutputProcessor,
        decisions: RequestPolicy,
        *,
        per_event: bool,
        max_model_len: int,
        switched: bool,
    ) -> AsyncIterator[Delta]:
        """Tokens until `recheck_after` more have come (None: until the call ends) or the
        output finishes, appended to `committed` and handed to the output processor:
        event by event when `per_event` (a streaming client whose text is decoded
        here), else in one piece (fewer detokenizations)."""
        started = last = time.perf_counter()
        got = 0
        pending: list[int] = []
        pending_logprobs: list[float] = []
        while not self.ended and (recheck_after is None or got < recheck_after):
            try:
                tokens, logprobs = await anext(self.events)
            except StopAsyncIteration:
                tokens, logprobs = [], None
                self.ended = True
            except PlainStreamLost:
                raise
            except TargetError:
                # A plain call that broke cannot be resumed as it was, but every token
                # so far is the target's: the policy goes on with a round, which is
                # retried (and fails the request only if the upstream keeps failing).
                tokens, logprobs = [], None
                self.ended = self.failed = True
            if tokens:
                if self.first is None:
                    self.first = len(tokens), time.perf_counter() - self.sent
                got += len(tokens)
                self.num_tokens += len(tokens)
                committed.extend(tokens)
                if draft_session is not None:
                    draft_session.advance(committed, None)
                pending.extend(tokens)
                pending_logprobs.extend(logprobs or ())
                last = time.perf_counter()
            decisions.record(self._progress(committed))
            # A piece only the recheck cuts is part of the recheck's host time.
            recheck_only = recheck_after is not None and got >= recheck_after
            recheck_only &= not (per_event or self.ended)
            if pending and (per_event or self.ended or recheck_only):
                cut = time.perf_counter()
                piece = await self._piece(
                    pending, pending_logprobs, output, last - started, max_model_len,
                    committed, switched,
                )  # fmt: skip
                if recheck_only:
                    self.recheck_seconds += time.perf_counter() - cut
                yield piece
                switched = False
                started = last
                pending, pending_logprobs = [], []
                if output.finish_reason is not None:
                    return

    def _progress(self, committed: list[int]) -> PlainTokens:
        return PlainTokens(
            committed=committed,
            stretch_tokens=self.num_tokens,
            seconds=time.perf_counter() - self.sent,
            ended=self.ended,
            failed=self.failed,
            first=self.first,
            rechecks=self.rechecks,
            recheck_seconds=self.recheck_seconds,
        )

    async def _piece(
        self,
        tokens: list[int],
        logprobs: list[float],
        output: OutputProcessor,
        seconds: float,
        max_model_len: int,
        committed: list[int],
        switched: bool,
    ) -> Delta:
        calls, sent = self._unreported
        self._unreported = (0, 0)
        stats = RoundStats(
            num_tokens=len(tokens),
            num_nodes=0,
            draft_s=0.0,
            tree_s=0.0,
            verify_s=seconds,
            upstream_calls=calls,
            verify_prompt_tokens=sent,
            kind="plain",
            switches_to_plain=int(switched),
        )
        return await output.add(
            tokens,
            logprobs if output.want_logprobs else None,
            at_context_limit=len(committed) >= max_model_len,
            stats=stats,
        )

    async def close(self, committed: list[int], decisions: RequestPolicy | None) -> None:
        """End the call (vLLM aborts a closed stream) and report the stretch."""
        await self.events.aclose()
        if not self.ended:
            self.ended = True
            if decisions is not None:
                decisions.record(self._progress(committed))


async def generate(
    target: Target,
    drafter: Drafter | None,
    request: GenerationRequest,
    detokenize: Detokenize,
    policy: Policy | None = None,
) -> GenerationResult:
    """Run a generation to the end and collect it."""
    stats = GenerationStats()
    token_ids: list[int] = []
    logprobs: list[float] | None = [] if request.logprobs else None
    text = ""
    finish, stop_reason = "length", None
    async for delta in stream_generate(target, drafter, request, detokenize, policy):
        stats.add(delta.round)
        token_ids.extend(delta.token_ids)
        text += delta.text
        if logprobs is not None and delta.logprobs is not None:
            logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            finish, stop_reason = delta.finish_reason, delta.stop_reason
    return GenerationResult(token_ids, text, finish, stop_reason, stats, logprobs)
