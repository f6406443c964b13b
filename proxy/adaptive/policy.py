"""The policy: at each step of a request, verify some of the drafted tree's nodes
(`Speculate`) or let the target generate on its own (`Plain`). docs/POLICY.md states the
rule with the numbers that decide it; in short:

* speculation's rate for this request = the best, over n, of the expected tokens of the
  tree's first n nodes (1 + their calibrated acceptance, the pooled calibration scaled
  by the request's own record: `RequestAcceptance`) over the round's predicted time
  (the fitted call latency for n + 1 prompts, the measured host time per round, and
  the round's work beyond a one-prompt call once for each other request in flight:
  they share the engine's steps);
* plain generation's rate = the tokens the request still needs over the fitted time of a
  plain stretch that long at the present load (its opening counted unless a stream is
  already open), timed on stretches with no shadow drafted beside them (`record`);
* a request changes side only when the other side is faster by BAND;
* every estimate fades with one half-life (`Policy.half_life_s`), and when one side's
  estimate is a half-life older than the other's, one request re-measures it: two rounds
  inside an answer (a whole tree, then at most half its nodes), or a plain stretch of
  SHADOW_EVERY tokens.
  Ages count only time with requests in flight (`Policy.busy_time`): an idle proxy
  learns nothing, so a pause makes no estimate staler than the other.

Exceptions: a target that cannot generate plainly (engine mode) always speculates,
choosing n (0: the root alone, one plain step); a seeded request is generated plainly in
one call, since a switch would make its output depend on timing; before plain generation
was ever measured, requests start plain (it is never slower than the target alone); after
a plain stretch that broke (or gave nothing), one round follows (rounds are retried).

While plain, the drafter proposes a tree every `shadow_spacing` tokens: the policy decides
on it, and if it stays plain, walks it along the tokens that come (a *shadow* round),
which keeps the calibration current.

The decoding loop asks `RequestPolicy.decide` before each step and tells
`RequestPolicy.record` what happened; it keeps no policy state.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from proxy.adaptive.estimates import (
    HALF_LIFE_S,
    Calibration,
    Clock,
    Fading,
    LinearCost,
    PlainCost,
    RequestAcceptance,
)
from proxy.tree import DraftTree, walk

# The other side must be this much faster (relative) before a request switches: rates
# are predictions, and a switch costs (a stream to open, or an uncached tail to
# recompute).
BAND = 0.1
# The most plain tokens between two decisions while plain (each drafts a tree: a
# shadow), and the length of a plain re-measurement: short enough to return to
# speculation soon, long enough that a stream's opening is not all it measures.
SHADOW_EVERY = 8
# The host time the plain streams' rechecks may take, relative to a stream's time per
# token (`Policy.shadow_spacing`): on a host shared with the engine that time is taken
# from the engine.
SHADOW_SHARE = 0.05

logger = logging.getLogger("ddtree_proxy.policy")


@dataclass(frozen=True)
class Speculate:
    """Verify the tree's first `num_nodes` nodes (0: the root alone)."""

    num_nodes: int
    reason: str


@dataclass(frozen=True)
class Plain:
    """Ask the target for up to `max_tokens` tokens of its own, streamed (closable, with
    decisions on the way) or as one answer."""

    max_tokens: int
    stream: bool
    # Tokens after which the loop drafts a tree and asks `decide` again (the stream
    # stays open unless it says Speculate); None: not before this plain stretch ends.
    recheck_after: int | None
    reason: str


Decision = Speculate | Plain


@dataclass(frozen=True)
class RoundResult:
    """A verified round."""

    tree: DraftTree  # what was verified
    accepted_nodes: list[int]
    num_tokens: int  # committed: accepted + the bonus token
    seconds: float  # the whole round: draft, build, verify, walk
    call_seconds: float  # of which the verification call(s)
    num_prompts: int
    computed_tokens: int  # tokens the target had not processed, summed over the prompts


@dataclass(frozen=True)
class PlainTokens:
    """Plain tokens arrived (the end of `committed`)."""

    committed: Sequence[int]  # the request's tokens so far, prompt included
    stretch_tokens: int  # tokens this plain call has given so far
    seconds: float  # since this plain call was sent
    ended: bool  # the stretch is over (the stream ended or was closed, or the answer came)
    failed: bool = False  # ... because the call failed (a round follows: rounds are retried)
    # The stretch's first piece: (tokens, seconds since the call was sent); a stream's
    # first event times its opening, the rest its tokens, so one stream measures both.
    first: tuple[int, float] | None = None
    # Decisions taken on the open stream so far (`Plain.recheck_after`), and the host
    # seconds they took: drafting, deciding, handing on the piece each one cut.
    rechecks: int = 0
    recheck_seconds: float = 0.0


@dataclass(frozen=True)
class Finished:
    """The request has ended, however it ended."""


Outcome = RoundResult | PlainTokens | Finished


@dataclass(frozen=True)
class _Shadow:
    tree: DraftTree
    start: int  # committed length when drafted (its root is committed[start - 1])


class Policy:
    """What the adaptive policy learns while serving, shared by the requests of one
    target and drafter."""

    def __init__(
        self,
        clock: Clock = time.monotonic,
        trace: Callable[[dict[str, Any]], None] | None = None,
        half_life_s: float = HALF_LIFE_S,
    ) -> None:
        self.clock = clock
        self.trace = trace  # gets one record per decision
        self.half_life_s = half_life_s  # of every estimate, and their staleness bound
        # verification: (prompts, computed tokens) -> s
        self.calls = LinearCost(2, clock, half_life_s=half_life_s)
        # A plain stretch: (tokens, requests in flight) -> s
        self.plain = PlainCost(clock, half_life_s)
        # host time per round outside the call: (s, n)
        self.overhead = Fading(2, clock, half_life_s)
        # host time per decision on an open plain stream (a recheck): (s, n)
        self.recheck = Fading(2, clock, half_life_s)
        # The rounds' work beyond a one-prompt call, summed over every round timed, s:
        # each other request in flight waited for it (`round_seconds` charges it to the
        # round), so plain stretches are timed without what other requests' rounds
        # added while they ran (else the more requests speculate, the slower plain would
        # look, and more would). A round's call is learnt as it took, others' rounds
        # included: with the others speculating too, that is what a round costs. At load
        # the comparison so leans to plain, the side that is never slower than vLLM.
        self.rounds_extra = 0.0
        self.calibration = Calibration(clock, half_life_s)
        self.decisions: Counter[tuple[str, str]] = Counter()  # (kind, reason)
        self.prevailing: str = "plain"  # the side of the latest decision, for new requests
        # The last decision to speculate on a tree's predicted rate, and the last plain
        # request sent to look for such trees without one (`worth_drafting`), busy s.
        self.speculated_at = self._looked_at = -float("inf")
        # When each side was last measured or its re-measurement claimed, busy s.
        self._measured = {"speculate": -float("inf"), "plain": -float("inf")}
        self._next_request = 0
        self.in_flight = 0  # requests on this target begun and not Finished
        self._busy_s = 0.0  # busy time before the present busy spell
        self._busy_since: float | None = None  # clock when in_flight last left 0
        # Several upstream replicas: one policy each (their costs differ), by replica name.
        self.replicas: dict[str, Policy] = {}

    def for_replica(self, replica: str | None) -> Policy:
        """The policy of requests served by `replica` (one of several upstreams; made at
        its first request, tracing where this one does); this one for None (one target)."""
        if replica is None:
            return self
        if replica not in self.replicas:
            self.replicas[replica] = Policy(self.clock, self.trace, self.half_life_s)
        return self.replicas[replica]

    def request(
        self,
        *,
        can_plain: bool,
        seeded: bool,
        client_streams: bool,
        replica: Callable[[], str | None] = lambda: None,
        remote_text: bool = False,
    ) -> RequestPolicy:
        """A request's decisions. `can_plain`: its target session generates plainly
        (`TargetSession.plain`); `client_streams`: the client reads a stream; `replica`:
        the upstream replica serving the request now (a failover moves it), whose
        estimates (`for_replica`) decide and learn each step; `remote_text`: its text
        comes from vLLM's /detokenize, one call per plain piece (a piece ends at each
        decision), so a plain stream drafts only every SHADOW_EVERY tokens."""
        self._next_request += 1
        decisions = RequestPolicy(
            self, replica, self._next_request, can_plain, seeded, client_streams, remote_text
        )
        decisions._count_in_flight()
        return decisions

    # ----- the numbers ------------------------------------------------------------

    def rounds(
        self, tree: DraftTree, unseen_tokens: int, factor: float = 1.0
    ) -> tuple[np.ndarray, np.ndarray]:
        """[num_nodes + 1] predicted seconds and tokens per second of a round verifying
        the first n nodes, n = 0 .. num_nodes (`unseen_tokens`: context per prompt the
        target has not processed; `factor`: the request's own acceptance,
        `RequestAcceptance`)."""
        return round_estimates(tree, self.calibration, unseen_tokens, self.round_seconds, factor)

    def round_seconds(self, num_prompts: np.ndarray, computed_tokens: np.ndarray) -> np.ndarray:
        """Predicted seconds of a round: its call, the host's overhead, and what its
        extra work costs the other requests in flight. They share the engine's steps, so
        each waits for what the round asks beyond a one-prompt call (its other prompts
        and their tokens) -- time the round takes from the server, not only from its
        own request."""
        prompts, tokens = np.asarray(num_prompts), np.asarray(computed_tokens)
        others = max(0, self.in_flight - 1)
        extra = self.round_extra(prompts, tokens)
        return self.calls.seconds(prompts, tokens) + others * extra + (self.overhead.ratio() or 0.0)

    def round_extra(self, num_prompts: np.ndarray, computed_tokens: np.ndarray) -> np.ndarray:
        """Predicted seconds a verification call takes beyond a one-prompt call with as
        many tokens per prompt: what every other request in flight waits for."""
        per_prompt = np.asarray(computed_tokens) / np.asarray(num_prompts)
        return self.calls.seconds(num_prompts, computed_tokens) - self.calls.seconds(1, per_prompt)

    def speculation_ceiling(self, max_depth: int) -> float:
        """Tokens per second of a round in which a chain of `max_depth` nodes is all
        accepted: no tree of that depth does better (a round gives at most max_depth + 1
        tokens and verifies at least max_depth + 1 prompts)."""
        num_prompts = max_depth + 1
        computed = num_prompts + max_depth * (max_depth + 1) // 2  # one unseen token each
        seconds = float(self.round_seconds(np.asarray(num_prompts), np.asarray(computed)))
        return num_prompts / seconds if seconds > 0 else float("inf")

    def plain_rate(self, remaining: int, stream_open: bool) -> float:
        """Predicted tokens per second of plain generation for `remaining` tokens (an open
        stream has paid its opening: `stream_rate`)."""
        if stream_open:
            return self.stream_rate()
        seconds = self.plain.opening() + self.plain.per_token(self.in_flight) * remaining
        return float(remaining / seconds) if seconds > 0 else float("inf")

    def stream_rate(self) -> float:
        """Predicted tokens per second of an open plain stream, at the present load."""
        per_token = self.plain.per_token(self.in_flight)
        return 1.0 / per_token if per_token > 0 else float("inf")

    def shadow_spacing(self) -> int:
        """Plain tokens between two shadows: as few as keep their host time (a recheck's
        measured time each; before one was measured, a round's overhead) within
        SHADOW_SHARE of the time a stream takes for a token, at most SHADOW_EVERY. Every
        request in flight may be drafting on the one host meanwhile, so the share is
        split among them. Where a token takes long next to the host's drafting (a GPU's
        big model), every token, so a tree that would win is taken when the drafter
        first finds it."""
        per_token = self.plain.per_token(self.in_flight)
        overhead = self.recheck.ratio()
        if overhead is None:
            overhead = self.overhead.ratio()
        if overhead is None or per_token <= 0:
            return SHADOW_EVERY
        streams = max(1, self.in_flight)
        spacing = math.ceil(streams * overhead / (SHADOW_SHARE * per_token))
        return min(SHADOW_EVERY, max(1, spacing))

    def busy_time(self) -> float:
        """Seconds during which requests were in flight on this target: the clock of
        staleness. Wall-clock ages would make every request after a pause re-measure
        what nothing has changed -- with a request every 15 s, every other one."""
        if self._busy_since is None:
            return self._busy_s
        return self._busy_s + self.clock() - self._busy_since

    def enter(self) -> None:
        """A request is in flight here."""
        if self.in_flight == 0:
            self._busy_since = self.clock()
        self.in_flight += 1

    def leave(self) -> None:
        """A request here has finished (or moved to another replica)."""
        self.in_flight -= 1
        if self.in_flight == 0 and self._busy_since is not None:
            self._busy_s += self.clock() - self._busy_since
            self._busy_since = None

    def worth_drafting(self) -> bool:
        """Should a plain request that may take the rest as one answer stream instead,
        drafting as it goes? Yes if a request speculated on a tree's predicted rate
        within the last half-life; if none did, yes for one request per half-life (its
        trees re-measure the chance, as a stale estimate is re-measured); busy time."""
        now = self.busy_time()
        if now - self.speculated_at <= self.half_life_s:
            return True
        if now - self._looked_at <= self.half_life_s:
            return False
        self._looked_at = now
        return True

    def note_measured(self, side: str) -> None:
        """`side`'s estimate was measured just now."""
        self._measured[side] = self.busy_time()

    def measured_at(self, side: str) -> float:
        """When `side`'s estimate was last measured or a re-measurement claimed, busy s."""
        return self._measured[side]

    def claim(self, side: str) -> bool:
        """Is `side`'s estimate a half-life older than the other's? True for the one
        caller who then re-measures it."""
        other = "plain" if side == "speculate" else "speculate"
        if self.measured_at(other) - self.measured_at(side) <= self.half_life_s:
            return False
        self.note_measured(side)  # claimed: no other request re-measures it meanwhile
        return True

    def snapshot(self) -> dict[str, Any]:
        per_call, per_prompt, per_token = self.calls.coefficients()
        opening, _, per_load = self.plain.coefficients()
        return {
            "call_s": float(per_call),
            "call_per_prompt_s": float(per_prompt),
            "call_per_token_s": float(per_token),
            "round_overhead_s": float(self.overhead.ratio() or 0.0),
            "recheck_s": float(self.recheck.ratio() or 0.0),
            "plain_opening_s": float(opening),
            "plain_per_token_s": self.plain.per_token(self.in_flight),  # at the present load
            "plain_per_load_s": float(per_load),  # per token, per request in flight more
            "calibration": self.calibration.table(),
            "decisions": dict(self.decisions),
        }


@dataclass
class RequestPolicy:
    """One request's decisions."""

    root: Policy  # the runtime's policy (`Policy.request`)
    replica: Callable[[], str | None]
    request_id: int
    can_plain: bool
    seeded: bool
    client_streams: bool
    remote_text: bool = False
    side: str = ""  # "speculate" or "plain": where the request is now
    _stream_open: bool = False
    _plain_failed: bool = False
    _after_plain: bool = False  # the last step was a plain stretch (it has ended)
    _second_round: int | None = None  # nodes of a re-measurement's second round, when due
    _after_tree: bool = False  # the last decision verified a tree with nodes
    _decided_on: str | None = None  # the replica serving the request at the last decision
    _counted_on: Policy | None = None  # the replica policy whose in_flight counts it
    _shadows: list[_Shadow] = field(default_factory=list)
    # The open plain stretch drafts shadows as it goes (`_plain`): it times plain with
    # the proxy's drafting beside it, not what stepping aside costs (`record`).
    _drafting: bool = False
    _rechecks_seen: tuple[int, float] = (0, 0.0)  # of the stretch now open
    # (the replica's Policy, its rounds_extra, the requests then in flight) when the
    # plain stretch began (`_slowed`)
    _stretch_from: tuple[Policy, float, int] | None = None
    _first_slowed: float | None = None  # what others' rounds added by the first piece
    _acceptance: RequestAcceptance = field(default_factory=RequestAcceptance)

    def __post_init__(self) -> None:
        self.side = self.policy.prevailing

    @property
    def policy(self) -> Policy:
        """The estimates of the replica serving the request now."""
        return self.root.for_replica(self.replica())

    def _count_in_flight(self) -> None:
        """Count the request in the in-flight requests of the replica serving it (a
        failover moves the count with it)."""
        policy = self.policy
        if self._counted_on is not policy:
            if self._counted_on is not None:
                self._counted_on.leave()
            policy.enter()
            self._counted_on = policy

    def decide(
        self,
        tree: DraftTree,
        *,
        position: int,
        unseen_tokens: int,
        remaining: int,
        max_depth: int,
    ) -> Decision:
        """The next step, given the tree just drafted at the request's end (its root is
        the last committed token, at `position` - 1), the context per prompt the target
        has not processed, the tokens the request may still produce, and the depth the
        drafter may reach (the tree just drafted may be shallower)."""
        self._count_in_flight()
        decision, numbers = self._decide(tree, unseen_tokens, remaining, max_depth)
        policy = self.policy
        self._decided_on = self.replica()
        kind = "plain" if isinstance(decision, Plain) else "speculate"
        policy.decisions[kind, decision.reason] += 1
        if kind != self.side:
            logger.debug("request %d: %s -> %s (%s) %s", self.request_id, self.side, kind,
                         decision.reason, numbers)  # fmt: skip
        self.side = policy.prevailing = kind
        self._after_tree = kind == "speculate" and tree.num_nodes > 0
        if isinstance(decision, Plain):
            self._stream_open = decision.stream
            if self._stretch_from is None:  # a plain call is sent
                self._stretch_from = (policy, policy.rounds_extra, policy.in_flight)
                self._first_slowed = None
            if tree.num_nodes:
                self._shadows.append(_Shadow(tree, position))
        if policy.trace is not None:
            if isinstance(decision, Plain):
                numbers |= {"stream": decision.stream, "recheck_after": decision.recheck_after}
            else:
                numbers["best_nodes"] = decision.num_nodes
            self._trace(decision=kind, reason=decision.reason, nodes=tree.num_nodes,
                        remaining=remaining, in_flight=policy.in_flight, **numbers)
        return decision

    def _decide(
        self, tree: DraftTree, unseen_tokens: int, remaining: int, max_depth: int
    ) -> tuple[Decision, dict[str, Any]]:
        policy = self.policy
        if not self.can_plain:
            if policy.calls.num_rows == 0:
                return Speculate(tree.num_nodes, "speculation_unmeasured"), {}
            factor = self._acceptance.factor()
            rates = policy.rounds(tree, unseen_tokens, factor)[1]
            best = int(np.argmax(rates))
            numbers = {"spec_rate": float(rates[best]), "own_acceptance": factor}
            return Speculate(best, "no_plain_generation"), numbers
        if self._plain_failed:
            self._plain_failed = False
            return Speculate(tree.num_nodes, "plain_failed"), {}
        if self.seeded:
            return Plain(remaining, self.client_streams, None, "seeded"), {}
        if policy.plain.num_rows == 0:
            return self._plain(remaining, "plain_unmeasured"), {}
        ages = self._ages()
        # A re-measurement of speculation is two rounds in a row, a whole tree and then at
        # most half as many nodes: calls of two sizes at the present load tell the
        # per-call cost from the per-prompt one, which calls of one size (after an idle
        # gap, the fit's only recent rows) leave to the ridge. An empty tree is a
        # one-prompt call and tells neither: the re-measurement waits for a tree with nodes.
        # It also waits for a tree inside an answer (no more unseen context than a round
        # commits): at a prompt's end every prompt of the round computes the whole uncached
        # prompt, a round that costs several plain requests and that no later round repeats.
        if self._second_round is not None:
            nodes, self._second_round = min(self._second_round, tree.num_nodes), None
            return Speculate(nodes, "remeasure_speculation"), ages
        inside = unseen_tokens <= max_depth + 1
        if tree.num_nodes and inside and policy.claim("speculate"):
            self._second_round = tree.num_nodes // 2
            return Speculate(tree.num_nodes, "remeasure_speculation"), ages
        if not self._stream_open and policy.claim("plain"):
            plain = Plain(min(SHADOW_EVERY, remaining), True, None, "remeasure_plain")
            return plain, ages
        if policy.calls.num_rows == 0:
            # Another request's round is measuring speculation; with no call timed yet
            # a round's predicted cost is zero (an infinite rate), so nothing to compare.
            return self._plain(remaining, "speculation_unmeasured"), ages
        if tree.num_nodes == 0 and self._after_tree:
            # The drafter matched nothing at this one token, right after a tree it did
            # match: one miss says little of the next tree. The root alone commits one
            # token (a plain step) where going plain would commit SHADOW_EVERY.
            return Speculate(0, "empty_after_tree"), {}
        factor = self._acceptance.factor()
        seconds, rates = policy.rounds(tree, unseen_tokens, factor)
        best = int(np.argmax(rates))
        spec_rate = float(rates[best])
        plain_rate = policy.plain_rate(remaining, self._stream_open)
        numbers = {"spec_rate": spec_rate, "plain_rate": plain_rate, "best_nodes": best,
                   "own_acceptance": factor}  # fmt: skip
        if policy.trace is not None:  # the round compared, as predicted
            prompts = np.asarray(best + 1)
            computed = prompts * unseen_tokens + int(np.sum(tree.depths[1 : best + 1]))
            numbers |= {"round_s": float(seconds[best]),
                        "call_s": float(policy.calls.seconds(prompts, computed)),
                        "extra_s": float(policy.round_extra(prompts, computed)),
                        "unseen": unseen_tokens}  # fmt: skip
        if self.side == "speculate":
            go_plain = plain_rate > (1 + BAND) * spec_rate
        else:
            go_plain = not spec_rate > (1 + BAND) * plain_rate
        if go_plain:
            numbers["ceiling"] = ceiling = policy.speculation_ceiling(max_depth)
            return self._plain(remaining, "plain_faster", ceiling), numbers
        policy.speculated_at = policy.busy_time()
        return Speculate(best, "speculation_faster"), numbers

    def _ages(self) -> dict[str, float]:
        """How old each side's estimate is, busy s (None: never measured)."""
        now = self.policy.busy_time()
        ages = {side: now - self.policy.measured_at(side) for side in ("speculate", "plain")}
        return {f"{side}_age_s": None if math.isinf(age) else age for side, age in ages.items()}

    def _plain(self, remaining: int, reason: str, ceiling: float = float("inf")) -> Plain:
        """Plain generation; `ceiling`: the fastest speculation could be (unknown: inf).
        A stream, read `shadow_spacing` tokens at a time, while a tree could still beat
        plain by BAND (this tree lost, a later one may not); else a half-life's worth of
        tokens at a time (the estimates are stale by then). For a client that does not
        stream, one answer -- it cannot be closed early, but costs both hosts one event
        where a stream costs one per token -- unless a tree could win and trees have
        lately won (`Policy.worth_drafting`). Plain is the rate the decision compared:
        for the rest of the request, its opening counted unless a stream is open (plain
        timed only as answers of one length cannot tell the opening from the tokens, and
        a stream not yet open would look free)."""
        policy = self.policy
        stream_rate = policy.stream_rate()
        could_win = ceiling > (1 + BAND) * policy.plain_rate(remaining, self._stream_open)
        streaming = self._stream_open or self.client_streams
        if could_win and (streaming or policy.worth_drafting()):
            self._drafting = True
            spacing = SHADOW_EVERY if self.remote_text else policy.shadow_spacing()
            return Plain(remaining, True, spacing, reason)
        if not streaming:
            return Plain(remaining, False, None, reason)
        if math.isinf(stream_rate):  # never measured: no spacing to go by
            return Plain(remaining, True, None, reason)
        recheck = max(SHADOW_EVERY, int(policy.half_life_s * stream_rate))
        return Plain(remaining, True, recheck, reason)

    def record(self, outcome: Outcome) -> None:
        policy = self.policy
        if isinstance(outcome, RoundResult):
            # A round that a failover moved timed two replicas and the failure between
            # them: its acceptance is real, its cost is neither replica's.
            if self.replica() == self._decided_on:
                prompts, tokens = outcome.num_prompts, outcome.computed_tokens
                if policy.trace is not None:
                    predicted = policy.calls.num_rows and policy.calls.seconds(prompts, tokens)
                    self._trace(outcome="round", tokens=outcome.num_tokens,
                                seconds=outcome.call_seconds,
                                predicted_s=float(predicted), prompts=prompts,
                                computed_tokens=tokens)  # fmt: skip
                # An engine that has decoded plain answers the next round slower than a
                # round after a round: a cost of switching once, which the band covers, not
                # a cost of every round in the run it starts.
                if outcome.call_seconds > 0 and not self._after_plain:
                    policy.calls.observe(prompts, tokens, outcome.call_seconds)
                    policy.note_measured("speculate")
                policy.overhead.add(max(0.0, outcome.seconds - outcome.call_seconds), 1.0)
                policy.rounds_extra += max(0.0, float(policy.round_extra(prompts, tokens)))
            self._after_plain = False
            self._acceptance.add(*policy.calibration.observe(outcome.tree, outcome.accepted_nodes))
        elif isinstance(outcome, PlainTokens):
            self._walk_shadows(outcome.committed)
            counted, seconds = self._rechecks_seen
            if outcome.rechecks > counted:
                policy.recheck.add(outcome.recheck_seconds - seconds, outcome.rechecks - counted)
            self._rechecks_seen = (outcome.rechecks, outcome.recheck_seconds)
            slowed = self._slowed(self._stretch_from)
            if outcome.first is not None and self._first_slowed is None:
                self._first_slowed = slowed
            if outcome.ended:
                # The requests in flight over the stretch: the mean of its start and now.
                began, load = self._stretch_from, float(policy.in_flight)
                if began is not None and began[0] is policy:
                    load = (began[2] + load) / 2
                self._rechecks_seen = (0, 0.0)
                self._stream_open = False
                self._stretch_from = None
                self._plain_failed = outcome.failed or outcome.stretch_tokens == 0
                self._after_plain = not self._plain_failed
                # Plain's rate is what stepping aside costs. A stretch the proxy drafted
                # beside is slower by its drafting (on a host shared with the engine, by
                # more than the drafting's own time): counted, it would make plain look
                # slow enough that drafting beside it seemed worth it, and so on.
                drafted, self._drafting = self._drafting, False
                if policy.trace is not None:
                    num = outcome.stretch_tokens
                    plain = policy.plain
                    predicted = plain.num_rows and plain.opening() + plain.per_token(load) * num
                    self._trace(outcome="plain", tokens=num, seconds=outcome.seconds,
                                slowed=slowed, predicted_s=float(predicted), load=load,
                                drafted=drafted, failed=outcome.failed)  # fmt: skip
                if not outcome.failed and outcome.stretch_tokens > 0:
                    # The first piece came before any drafting beside the stream. Where
                    # the fit puts no time on the tokens (plain timed only as answers of
                    # one length), a drafted stream's first piece is the only split of
                    # the opening there is: else an open stream would look free.
                    first = outcome.first
                    split = not drafted or policy.plain.per_token(load) <= 0
                    if split and first is not None and 0 < first[0] < outcome.stretch_tokens:
                        seconds = first[1] - (self._first_slowed or 0.0)
                        if seconds > 0:
                            policy.plain.observe(first[0], load, seconds)
                    if not drafted and outcome.seconds - slowed > 0:
                        policy.plain.observe(outcome.stretch_tokens, load, outcome.seconds - slowed)
                        policy.note_measured("plain")
        else:
            self._shadows = []
            if self._counted_on is not None:
                self._counted_on.leave()
                self._counted_on = None

    def _trace(self, **fields: Any) -> None:
        """One trace line of this request: a decision, or a timed round or plain stretch
        beside what the estimates predicted for it before they learnt from it (0 before
        any was timed)."""
        policy = self.policy
        assert policy.trace is not None
        policy.trace({"t": policy.clock(), "request": self.request_id, **fields})

    def _slowed(self, began: tuple[Policy, float, int] | None) -> float:
        """Seconds that other requests' rounds added to a plain stretch that began at
        `began` (a failover moved the request since: unknown, 0)."""
        if began is None or began[0] is not self.policy:
            return 0.0
        return self.policy.rounds_extra - began[1]

    def _walk_shadows(self, committed: Sequence[int]) -> None:
        waiting = []
        for shadow in self._shadows:
            span = shadow.tree.max_depth + 1
            if len(committed) < shadow.start + span:
                waiting.append(shadow)
                continue
            actual = committed[shadow.start : shadow.start + span]
            result = walk(shadow.tree, target_tokens_along(shadow.tree, actual))
            self._acceptance.add(
                *self.policy.calibration.observe(shadow.tree, result.accepted_nodes)
            )
        self._shadows = waiting


# (prompts per round, tokens computed per round) -> predicted seconds of a round, for
# arrays of both (one entry per tree size)
RoundCost = Callable[[np.ndarray, np.ndarray], np.ndarray]


def round_estimates(
    tree: DraftTree,
    calibration: Calibration,
    unseen_tokens: int,
    round_seconds: RoundCost,
    factor: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """[num_nodes + 1] predicted seconds and tokens per second of a round verifying the
    first n nodes, n = 0 .. num_nodes: n + 1 prompts, each computing the `unseen_tokens`
    of context the target has not processed plus its path; its expected tokens are the
    calibrated acceptance of those nodes plus the bonus token (a free round: inf)."""
    tokens = 1.0 + np.concatenate([[0.0], np.cumsum(calibration.acceptance(tree, factor))])
    num_prompts = np.arange(1, tree.num_nodes + 2)
    path_tokens = np.concatenate([[0], np.cumsum(tree.depths[1:])])
    seconds = round_seconds(num_prompts, num_prompts * unseen_tokens + path_tokens)
    seconds = np.asarray(seconds, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return seconds, np.where(seconds > 0, tokens / seconds, np.inf)


def target_tokens_along(tree: DraftTree, actual: Sequence[int]) -> np.ndarray:
    """[num_nodes + 1] target tokens for walking `tree` along the tokens that really
    followed its root (`actual`, up to max_depth + 1 of them): at each node on that path
    the next actual token, elsewhere -1 (those nodes were never reached)."""
    tokens = np.full(tree.num_nodes + 1, -1, dtype=np.int64)
    node_idx = 0
    for depth, token in enumerate(actual):
        tokens[node_idx] = token
        child = tree.children[node_idx].get(int(token))
        if child is None or depth + 1 >= len(actual):
            break
        node_idx = child
    return tokens
