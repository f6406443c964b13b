"""Shadow evaluation: what other drafters and budgets would have done on the traffic
answered directly, without serving one request differently.

A finished output is all a replay needs. Each round drafts at the committed prefix and
builds the tree exactly as a served round does (`proxy.round.draft`), then walks it
along the tokens that really followed (`proxy.adaptive.policy.target_tokens_along`, the
policy's shadow walker, and `proxy.tree.walk`) and commits the accepted tokens plus the
bonus: the tokens a verification would have returned. For greedy output those are the
target's own choices, so the acceptance lengths are exactly those a DDTree run with the
same drafter, budget and `policy: fixed` would have had. For sampled output the real
tokens are one draw from the target, and walking a tree along a draw accepts a node
exactly when the target's draw at its parent equals it -- which is how a DDTree round
accepts, node by node with the target's own draws -- so the lengths are a draw from the
same distribution.

The one difference: the last round ends with the output. Where it ended by a stop token
or string, the real round may have accepted tokens past it; the replay cannot know
them, and counts the round up to the end.

Once the upstream's costs are known (`Pricing`), each replayed round also emulates the
adaptive policy's choice between speculating and plain decoding (`_emulate`): the
predicted speed of the policy a user would deploy, not of speculating every round.

Replays run one at a time off the request's path, from a bounded queue, busy at most
a set share of the time (`--shadow-busy`: replays run on the proxy's host, whose cores
a local upstream also uses): under load new work is dropped (counted), never waited for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from proxy.ab.measure import MAX_RECORDS
from proxy.adaptive.estimates import HALF_LIFE_S, Calibration, LinearCost
from proxy.adaptive.policy import RoundCost, round_estimates, target_tokens_along
from proxy.backend.base import SessionOptions, Target, TargetError
from proxy.decoding import TreeSettings, resolve_depth
from proxy.drafter.base import Drafter
from proxy.round import RoundShape, draft
from proxy.tree import DraftTree, walk

logger = logging.getLogger("ddtree_proxy.shadow")


@dataclass(frozen=True)
class Pricing:
    """What the upstream charges now: a verification round, and a plain token."""

    round_seconds: RoundCost  # vectorized over tree sizes
    token_seconds: float  # the direct arm's median inter-token latency


@dataclass
class Emulated:
    """The adaptive policy's choice emulated at replayed rounds (`_emulate`): the
    tokens and predicted seconds of the rounds, and of them the speculated ones."""

    rounds: int = 0
    tokens: int = 0
    seconds: float = 0.0
    speculated_rounds: int = 0
    speculated_tokens: int = 0
    speculated_nodes: int = 0  # verified nodes, summed

    def add(self, other: Emulated) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class Replay:
    """The rounds a DDTree run would have had on one output."""

    acceptance_lengths: list[int] = field(default_factory=list)  # per round
    draft_calls: int = 0  # calls to a draft server (served drafters)
    # The first round with a drafted node: its committed prefix and tree (a probe call
    # verifies it for real to time a round; `Prober`).
    sample: tuple[list[int], DraftTree] | None = None
    emulated: Emulated = field(default_factory=Emulated)  # with `replay`'s `pricing`


async def replay(
    drafter: Drafter,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    *,
    budget: int,
    max_depth: int,
    max_tokens: int,
    max_model_len: int,
    pricing: Pricing | None = None,
    calibration: Calibration | None = None,
    first_token_s: float | None = None,
) -> Replay:
    """The rounds a DDTree run of `drafter` at `budget` would have had on this output
    (the loop's depth rule: at most `max_depth`, never past `max_tokens` or the
    context). With `pricing` and `calibration`, each round also emulates the adaptive
    policy's choice (`_emulate`), and the calibration learns from the round's walk; the
    emulated seconds then include what the direct answer's first token took beyond one
    plain token (`first_token_s`, where known: the prompt's prefill and any queueing,
    the same work in either arm and not in the fitted call)."""
    session = drafter.start(list(prompt_ids), None)
    committed = list(prompt_ids)
    out = Replay()
    emitted = 0
    unseen = len(committed)  # context the target has not processed (the loop's rule)
    while emitted < len(output_ids):
        room = max_model_len - len(committed)
        depth = min(max_depth, max_tokens - emitted - 1, room - 1)
        drafted = await draft(session, committed, RoundShape("ddtree", budget, depth))
        tree = drafted.tree
        actual = output_ids[emitted : emitted + max(depth, 0) + 1]
        if out.sample is None and tree.num_nodes:
            out.sample = (list(committed), tree)
        accepted = walk(tree, target_tokens_along(tree, actual)).accepted_nodes
        by_size = committed_by_size(accepted, tree.num_nodes, len(actual))
        if pricing is not None and calibration is not None:
            unseen = _emulate(out.emulated, tree, by_size, unseen, pricing, calibration)
            calibration.observe(tree, accepted)
        num_tokens = int(by_size[-1])
        committed.extend(actual[:num_tokens])
        session.advance(committed, None)
        emitted += num_tokens
        out.acceptance_lengths.append(num_tokens)
        out.draft_calls += drafted.draft_calls
        # An in-process drafter, the walk and the bookkeeping never wait on anything:
        # without this a whole replay would hold the event loop, and every request with it.
        await asyncio.sleep(0)
    if pricing is not None and first_token_s is not None and out.emulated.rounds:
        out.emulated.seconds += max(0.0, first_token_s - pricing.token_seconds)
    return out


def _emulate(
    out: Emulated,
    tree: DraftTree,
    by_size: np.ndarray,
    unseen: int,
    pricing: Pricing,
    calibration: Calibration,
) -> int:
    """The adaptive policy's rule at one replayed round (`docs/POLICY.md`), without its
    hysteresis and re-measurements: the tree size n with the best predicted rate (the
    calibrated expected tokens over the priced round) is speculated if that rate beats
    plain decoding's, and then commits what its first n nodes really accept; otherwise
    the round's tokens come plainly, at the direct arm's inter-token latency. Adds the
    round to `out`; returns the context the next round's prompts leave unprocessed."""
    seconds, rates = round_estimates(tree, calibration, unseen, pricing.round_seconds)
    best = int(np.argmax(rates))
    out.rounds += 1
    if rates[best] * pricing.token_seconds > 1.0:
        tokens = int(by_size[best])
        out.tokens += tokens
        out.seconds += float(seconds[best])
        out.speculated_rounds += 1
        out.speculated_tokens += tokens
        out.speculated_nodes += best
        return tokens
    tokens = int(by_size[-1])
    out.tokens += tokens
    out.seconds += tokens * pricing.token_seconds
    return 1  # a plain stream leaves the target holding the context


def committed_by_size(accepted_nodes: Sequence[int], num_nodes: int, span: int) -> np.ndarray:
    """[num_nodes + 1] the tokens a round commits (accepted + bonus, at most `span`,
    the tokens left to check) when it verifies only the first n nodes of its tree,
    n = 0 .. num_nodes, given the nodes its whole tree's walk accepted. Parents precede
    children, so node indices increase along the accepted path: the first n nodes hold
    its nodes up to index n."""
    nodes = np.asarray(accepted_nodes, dtype=np.int64)
    return np.minimum(np.searchsorted(nodes, np.arange(num_nodes + 1), side="right") + 1, span)


@dataclass(frozen=True)
class ShadowJob:
    """A direct answer to replay."""

    prompt_ids: list[int]
    output_ids: list[int]
    max_tokens: int  # the request's limit (the loop's depth rule depends on it)
    # The direct answer's time to its first token where it streamed (a JSON answer's
    # first token is its whole answer): what the emulation adds for the prompt.
    first_token_s: float | None = None


@dataclass
class ShadowTotals:
    """One drafter x budget's replays, summed, and the latest priced replays' predicted
    tokens/s, one per request."""

    requests: int = 0
    rounds: int = 0
    tokens: int = 0  # summed acceptance lengths
    draft_calls: int = 0
    emulated: Emulated = field(default_factory=Emulated)
    rates: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_RECORDS))

    @property
    def tau(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    def add(self, replayed: Replay) -> None:
        self.requests += 1
        self.rounds += len(replayed.acceptance_lengths)
        self.tokens += sum(replayed.acceptance_lengths)
        self.draft_calls += replayed.draft_calls
        emulated = replayed.emulated
        self.emulated.add(emulated)
        if emulated.seconds > 0:
            self.rates.append(emulated.tokens / emulated.seconds)


class Prober:
    """Probe calls: a replayed round's tree (`Replay.sample`) verified for real on the
    upstream and timed, which fits the upstream's cost of a round (`calls`, the policy's
    model: seconds from prompts and tokens computed) where the DDTree arm measured none
    (`needed`). At most `share` of the upstream calls: a probe goes out only while the
    probes so far stay within `share` of the direct answers offered to the shadow (each
    answer was at least one call). Each probe takes the next pair's tree in turn, so
    the fit sees calls of several sizes. Its fit fades with the policy's half-life
    (`--policy-half-life`)."""

    def __init__(
        self,
        target: Target,
        share: float,
        needed: Callable[[], bool],
        half_life_s: float = HALF_LIFE_S,
    ) -> None:
        self.target = target
        self.share = share
        self.needed = needed
        self.calls = LinearCost(2, time.monotonic, half_life_s=half_life_s)
        self.num_probes = 0
        self.num_failed = 0
        self._turn = 0

    async def maybe(self, samples: Sequence[tuple[list[int], DraftTree]], num_answers: int) -> None:
        if self.num_probes + self.num_failed + 1 > self.share * num_answers or not self.needed():
            return
        committed, tree = samples[self._turn % len(samples)]
        self._turn += 1
        session = await self.target.start(committed, SessionOptions())
        try:
            start = time.perf_counter()
            await session.verify(committed, tree)
            seconds = time.perf_counter() - start
        except TargetError as exc:
            self.num_failed += 1
            logger.info("probe call failed: %s", exc)
            return
        finally:
            await session.aclose()
        self.num_probes += 1
        num_prompts = tree.num_nodes + 1
        # The context is the finished answer's prefix, in the upstream's prefix cache:
        # each prompt computes its root and its path, as after a plain stretch.
        self.calls.observe(num_prompts, num_prompts + int(tree.depths.sum()), seconds)


class Shadow:
    """Replays every queued answer through each drafter x budget, one job at a time."""

    def __init__(
        self,
        drafters: dict[str, Drafter],
        budgets: Sequence[int],
        depth: int | None,
        max_queue: int,
        max_model_len: int,
        busy_share: float = 1.0,
        prober: Prober | None = None,
        pricing: Callable[[], Pricing | None] = lambda: None,
    ):
        self.drafters = drafters
        self.prober = prober
        self.pricing = pricing  # the upstream's costs now, once known (`_emulate`)
        self.budgets = tuple(budgets)
        self.max_model_len = max_model_len
        self.busy_share = busy_share  # of wall time the worker may spend replaying
        self.max_depths = {
            name: resolve_depth(TreeSettings(depth=depth), drafter)
            for name, drafter in drafters.items()
        }
        self.queue: asyncio.Queue[ShadowJob] = asyncio.Queue(max_queue)
        pairs = [(name, budget) for name in drafters for budget in budgets]
        self.totals = {pair: ShadowTotals() for pair in pairs}
        # Each pair's acceptance per drafter probability, learnt from its replays (the
        # policy's own is the serving drafter's, learnt from served rounds). Its clock
        # stands still: the evidence does not fade, as the totals are since start.
        self.calibrations = {pair: Calibration(lambda: 0.0) for pair in pairs}
        self.num_offered = 0
        self.num_dropped = 0
        self.num_replayed = 0
        self.num_failed = 0
        self._worker: asyncio.Task | None = None

    def offer(self, job: ShadowJob) -> bool:
        """Queue `job`; False (and counted) when the queue is full."""
        self.num_offered += 1
        try:
            self.queue.put_nowait(job)
        except asyncio.QueueFull:
            self.num_dropped += 1
            return False
        return True

    def start(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None

    async def _run(self) -> None:
        while True:
            job = await self.queue.get()
            start = time.perf_counter()
            try:
                await self.replay_job(job)
                self.num_replayed += 1
            except Exception:  # a replay is advice: it must never stop the worker
                self.num_failed += 1
                logger.exception("shadow replay failed")
            finally:
                self.queue.task_done()
            # Paced: busy at most busy_share of the time; meanwhile the queue fills and
            # new work is dropped.
            await asyncio.sleep((time.perf_counter() - start) * (1 / self.busy_share - 1))

    async def replay_job(self, job: ShadowJob) -> None:
        samples = []
        pricing = self.pricing()
        for name, drafter in self.drafters.items():
            for budget in self.budgets:
                replayed = await replay(
                    drafter, job.prompt_ids, job.output_ids, budget=budget,
                    max_depth=self.max_depths[name], max_tokens=job.max_tokens,
                    max_model_len=self.max_model_len, pricing=pricing,
                    calibration=self.calibrations[name, budget],
                    first_token_s=job.first_token_s,
                )  # fmt: skip
                self.totals[name, budget].add(replayed)
                if replayed.sample is not None:
                    samples.append(replayed.sample)
        if self.prober is not None and samples:
            await self.prober.maybe(samples, self.num_offered)

    def table(self) -> list[dict]:
        """One row per drafter x budget: its replays' tau, and where rounds were priced
        (`Pricing`), the adaptive policy emulated on them (`_emulate`): the median
        request's predicted tokens per second (the statistic the report compares the
        arms by), the share of tokens it would have speculated, and the mean nodes of
        its speculated rounds."""
        rows = []
        for (name, budget), t in self.totals.items():
            e = t.emulated
            row = {"drafter": name, "budget": budget, "requests": t.requests, "rounds": t.rounds,
                   "tau": round(t.tau, 4), "draft_calls": t.draft_calls,
                   "priced_rounds": e.rounds, "predicted_tokens_per_s": None,
                   "speculated_share": None, "speculated_nodes": None}  # fmt: skip
            if t.rates:
                row["predicted_tokens_per_s"] = round(float(np.median(t.rates)), 2)
            if e.seconds > 0:
                row["speculated_share"] = round(e.speculated_tokens / e.tokens, 3)
            if e.speculated_rounds:
                row["speculated_nodes"] = round(e.speculated_nodes / e.speculated_rounds, 2)
            rows.append(row)
        return rows
