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

Replays run one at a time off the request's path, from a bounded queue, busy at most
a set share of the time (`--shadow-busy`: replays run on the proxy's host, whose cores
a local upstream also uses): under load new work is dropped (counted), never waited for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from proxy.adaptive.estimates import LinearCost
from proxy.adaptive.policy import target_tokens_along
from proxy.backend.base import SessionOptions, Target, TargetError
from proxy.decoding import TreeSettings, resolve_depth
from proxy.drafter.base import Drafter
from proxy.round import RoundShape, draft
from proxy.tree import DraftTree, walk

logger = logging.getLogger("ddtree_proxy.shadow")
# (prompts per round, tokens computed per round) -> predicted seconds of a round
RoundCost = Callable[[float, float], float]


@dataclass
class Replay:
    """The rounds a DDTree run would have had on one output."""

    # Per round, [num_nodes + 1], at n = 0 .. the tree's nodes: the tokens the round
    # would have committed (accepted + bonus) and its nodes' depths summed, had it
    # verified only the tree's first n nodes (`DraftTree.prefix`, the tree sizes the
    # adaptive policy chooses from). The last entry is the round as drafted.
    tokens_by_size: list[np.ndarray] = field(default_factory=list)
    path_by_size: list[np.ndarray] = field(default_factory=list)
    draft_calls: int = 0  # calls to a draft server (served drafters)
    # The first round with a drafted node: its committed prefix and tree (a probe call
    # verifies it for real to time a round; `Prober`).
    sample: tuple[list[int], DraftTree] | None = None

    @property
    def acceptance_lengths(self) -> list[int]:
        return [int(tokens[-1]) for tokens in self.tokens_by_size]


async def replay(
    drafter: Drafter,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    *,
    budget: int,
    max_depth: int,
    max_tokens: int,
    max_model_len: int,
) -> Replay:
    """The rounds a DDTree run of `drafter` at `budget` would have had on this output
    (the loop's depth rule: at most `max_depth`, never past `max_tokens` or the
    context)."""
    session = drafter.start(list(prompt_ids), None)
    committed = list(prompt_ids)
    out = Replay()
    emitted = 0
    while emitted < len(output_ids):
        room = max_model_len - len(committed)
        depth = min(max_depth, max_tokens - emitted - 1, room - 1)
        drafted = await draft(session, committed, RoundShape("ddtree", budget, depth))
        tree = drafted.tree
        actual = output_ids[emitted : emitted + max(depth, 0) + 1]
        if out.sample is None and tree.num_nodes:
            out.sample = (list(committed), tree)
        tokens_by_size = committed_by_size(tree, actual)
        num_tokens = int(tokens_by_size[-1])
        committed.extend(actual[:num_tokens])
        session.advance(committed, None)
        emitted += num_tokens
        out.tokens_by_size.append(tokens_by_size)
        out.path_by_size.append(np.cumsum(tree.depths))
        out.draft_calls += drafted.draft_calls
        # An in-process drafter, the walk and the bookkeeping never wait on anything:
        # without this a whole replay would hold the event loop, and every request with it.
        await asyncio.sleep(0)
    return out


def committed_by_size(tree: DraftTree, actual: Sequence[int]) -> np.ndarray:
    """[num_nodes + 1] the tokens a round commits (accepted + bonus, at most
    len(actual)) when it verifies only the first n nodes of `tree` and the target's
    tokens are `actual`, n = 0 .. num_nodes. Parents precede children, so node indices
    increase along the accepted path: the first n nodes hold its nodes up to index n."""
    accepted = walk(tree, target_tokens_along(tree, actual)).accepted_nodes
    within = np.searchsorted(accepted, np.arange(tree.num_nodes + 1), side="right")
    return np.minimum(within + 1, len(actual))


@dataclass(frozen=True)
class ShadowJob:
    """A direct answer to replay."""

    prompt_ids: list[int]
    output_ids: list[int]
    max_tokens: int  # the request's limit (the loop's depth rule depends on it)


class ShadowTotals:
    """One drafter x budget's replays, summed per tree size n = 0 .. budget (rounds
    whose tree had fewer nodes count as their whole tree at every larger n)."""

    def __init__(self, budget: int) -> None:
        self.requests = 0
        self.rounds = 0
        self.draft_calls = 0
        self.tokens = np.zeros(budget + 1)  # [n] committed tokens, summed over rounds
        self.prompts = np.zeros(budget + 1)  # [n] verification prompts (nodes + root)
        self.path_tokens = np.zeros(budget + 1)  # [n] node depths, summed

    @property
    def tau(self) -> float:
        """Tokens per round of the budget's whole trees (the exact replay)."""
        return float(self.tokens[-1] / self.rounds) if self.rounds else 0.0

    def add(self, replayed: Replay) -> None:
        self.requests += 1
        self.rounds += len(replayed.tokens_by_size)
        self.draft_calls += replayed.draft_calls
        sizes = np.arange(len(self.tokens))
        for tokens, path in zip(replayed.tokens_by_size, replayed.path_by_size, strict=True):
            cut = np.minimum(sizes, len(tokens) - 1)
            self.tokens += tokens[cut]
            self.prompts += cut + 1
            self.path_tokens += path[cut]

    def predicted_rate(self, round_seconds: RoundCost) -> tuple[float, int] | None:
        """(tokens per second, tree size n) of the tree size whose mean round is
        predicted fastest, as the adaptive policy sizes its trees; None when no size
        has a positive predicted time."""
        best = None
        for size in range(len(self.tokens)):
            tau = self.tokens[size] / self.rounds
            num_prompts = self.prompts[size] / self.rounds
            # Every prompt recomputes the previous round's tokens (tau on average),
            # plus its own path.
            computed = num_prompts * tau + self.path_tokens[size] / self.rounds
            seconds = round_seconds(num_prompts, computed)
            if seconds > 0 and (best is None or tau / seconds > best[0]):
                best = (float(tau / seconds), size)
        return best


class Prober:
    """Probe calls: a replayed round's tree (`Replay.sample`) verified for real on the
    upstream and timed, which fits the upstream's cost of a round (`calls`, the policy's
    model: seconds from prompts and tokens computed) where the DDTree arm measured none
    (`needed`). At most `share` of the upstream calls: a probe goes out only while the
    probes so far stay within `share` of the direct answers offered to the shadow (each
    answer was at least one call). Each probe takes the next pair's tree in turn, so
    the fit sees calls of several sizes."""

    def __init__(self, target: Target, share: float, needed: Callable[[], bool]) -> None:
        self.target = target
        self.share = share
        self.needed = needed
        self.calls = LinearCost(2, time.monotonic)
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
    ):
        self.drafters = drafters
        self.prober = prober
        self.budgets = tuple(budgets)
        self.max_model_len = max_model_len
        self.busy_share = busy_share  # of wall time the worker may spend replaying
        self.max_depths = {
            name: resolve_depth(TreeSettings(depth=depth), drafter)
            for name, drafter in drafters.items()
        }
        self.queue: asyncio.Queue[ShadowJob] = asyncio.Queue(max_queue)
        self.totals = {
            (name, budget): ShadowTotals(budget) for name in drafters for budget in budgets
        }
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
        for name, drafter in self.drafters.items():
            for budget in self.budgets:
                replayed = await replay(
                    drafter, job.prompt_ids, job.output_ids, budget=budget,
                    max_depth=self.max_depths[name], max_tokens=job.max_tokens,
                    max_model_len=self.max_model_len,
                )  # fmt: skip
                self.totals[name, budget].add(replayed)
                if replayed.sample is not None:
                    samples.append(replayed.sample)
        if self.prober is not None and samples:
            await self.prober.maybe(samples, self.num_offered)

    def table(self, round_seconds: RoundCost | None = None) -> list[dict]:
        """One row per drafter x budget; with `round_seconds` (the predicted seconds of
        a round verifying n prompts with c tokens to compute), the predicted tokens per
        second of its best tree size up to the budget (`ShadowTotals.predicted_rate`)."""
        rows = []
        for (name, budget), t in self.totals.items():
            row = {"drafter": name, "budget": budget, "requests": t.requests, "rounds": t.rounds,
                   "tau": round(t.tau, 4), "draft_calls": t.draft_calls,
                   "predicted_tokens_per_s": None, "predicted_nodes": None}  # fmt: skip
            predicted = t.predicted_rate(round_seconds) if round_seconds and t.rounds else None
            if predicted is not None:
                row["predicted_tokens_per_s"] = round(predicted[0], 2)
                row["predicted_nodes"] = predicted[1]
            rows.append(row)
        return rows
