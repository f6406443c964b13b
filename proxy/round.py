"""One speculation round: draft -> build -> verify -> walk -> commit.

The terms (root, node, accepted tokens, bonus token, acceptance length) are defined in
`proxy.tree.tree`. A round with depth 0 or no drafter verifies the root alone, which is
one step of plain decoding through the same code. So is a round whose drafter fails
(`DraftError`: its server is down or slow): the draft is the drafter's business, the
request goes on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import numpy as np

from proxy.backend.base import TargetSession
from proxy.drafter.base import DraftError, DraftSession
from proxy.tree import DraftTree, build_chain, build_tree, walk


@dataclass(frozen=True)
class RoundShape:
    """How this round's tree is drawn."""

    kind: Literal["ddtree", "chain", "none"]
    budget: int  # tree nodes (ddtree)
    depth: int  # levels below the root; 0 = verify the root alone


@dataclass(frozen=True)
class RoundStats:
    # Tokens committed: a round's acceptance length (accepted drafted tokens + 1 bonus
    # token), or a piece of plain generation's token count.
    num_tokens: int
    num_nodes: int  # tree nodes, root excluded
    draft_s: float
    tree_s: float
    verify_s: float  # verify + walk + keep the accepted path
    upstream_calls: int  # HTTP calls this round made (0 in engine mode)
    verify_prompt_tokens: int  # tokens this round sent to the target
    # "plain": not a round but a piece of plain generation (no tree); "speculative": a
    # verified tree.
    kind: Literal["speculative", "plain"] = "speculative"
    # The adaptive policy's switches since the previous step.
    switches_to_plain: int = 0
    switches_to_speculation: int = 0
    draft_calls: int = 0  # calls this round made to a draft server (served drafters)
    draft_error: str | None = None  # DraftError kind when the round went on without a draft


@dataclass(frozen=True)
class Round:
    tokens: list[int]  # committed this round: accepted tokens, then the bonus token
    logprobs: list[float] | None  # the target's log-prob of each, when asked for
    stats: RoundStats
    tree: DraftTree  # what was verified
    accepted_nodes: list[int]  # its node indices on the accepted path


def root_only(root_token: int) -> DraftTree:
    return DraftTree(
        token_ids=np.asarray([root_token], dtype=np.int64),
        depths=np.zeros(1, dtype=np.int64),
        parents=np.full(1, -1, dtype=np.int64),
        path_log_probs=np.zeros(1),
        children=({},),
    )


@dataclass(frozen=True)
class Drafted:
    """A step's tree: drafted and built at the step's full shape."""

    tree: DraftTree  # the root alone when nothing was drafted
    draft_s: float  # the drafter's time
    tree_s: float  # building the tree
    draft_calls: int  # calls to a draft server (served drafters)
    draft_error: str | None = None  # DraftError kind when the drafter failed


async def draft(
    draft_session: DraftSession | None, committed: list[int], shape: RoundShape
) -> Drafted:
    """The tree of this step's shape after `committed` (whose last token is the root):
    the root alone when there is no drafter or no depth, or when the drafter fails
    (`DraftError`: its server is down or slow; the request goes on)."""
    root = committed[-1]
    if draft_session is None or shape.depth < 1 or shape.kind == "none":
        return Drafted(root_only(root), 0.0, 0.0, 0)
    calls_before = draft_session.draft_calls
    chain = shape.kind == "chain"
    start = time.perf_counter()
    try:
        dist = await draft_session.propose(committed, shape.depth, 1 if chain else shape.budget)
    except DraftError as exc:
        seconds = time.perf_counter() - start
        calls = draft_session.draft_calls - calls_before
        return Drafted(root_only(root), seconds, 0.0, calls, exc.kind)
    drafted = time.perf_counter()
    if chain:
        tree = build_chain(root, dist, shape.depth)
    else:
        tree = build_tree(root, dist, shape.budget, shape.depth)
    calls = draft_session.draft_calls - calls_before
    return Drafted(tree, drafted - start, time.perf_counter() - drafted, calls)


async def speculate(
    session: TargetSession,
    draft_session: DraftSession | None,
    committed: list[int],
    drafted: Drafted,
    num_nodes: int,
) -> Round:
    """Verify the drafted tree's first `num_nodes` nodes (a best-first tree's prefix is
    the tree a budget of `num_nodes` would have built), walk it, and append the round's
    tokens to `committed` (whose last token is the root)."""
    calls_before = session.counters.upstream_calls
    tokens_before = session.counters.verify_prompt_tokens
    tree = drafted.tree.prefix(num_nodes)
    start = time.perf_counter()
    verification = await session.verify(committed, tree)
    result = walk(tree, verification.tokens)
    features = await session.accept(tree, result)
    verified = time.perf_counter()

    round_tokens = result.committed_tokens
    logprobs = None
    if verification.logprobs is not None:
        logprobs = [float(verification.logprobs[row]) for row in (0, *result.accepted_nodes)]
    committed.extend(round_tokens)
    if draft_session is not None:
        draft_session.advance(committed, features)
    stats = RoundStats(
        num_tokens=result.acceptance_length,
        num_nodes=tree.num_nodes,
        draft_s=drafted.draft_s,
        tree_s=drafted.tree_s,
        verify_s=verified - start,
        upstream_calls=session.counters.upstream_calls - calls_before,
        verify_prompt_tokens=session.counters.verify_prompt_tokens - tokens_before,
        draft_calls=drafted.draft_calls,
        draft_error=drafted.draft_error,
    )
    return Round(
        tokens=list(round_tokens),
        logprobs=logprobs,
        stats=stats,
        tree=tree,
        accepted_nodes=result.accepted_nodes,
    )
