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
from typing import Callable, Literal

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


async def draft_tree(
    draft_session: DraftSession, committed: list[int], shape: RoundShape
) -> tuple[DraftTree, float]:
    """The tree of this round's shape the drafter proposes after `committed` (whose last
    token is the root), and the seconds the drafter took (the rest is the build).
    Raises DraftError when the draft cannot be had."""
    chain = shape.kind == "chain"
    top_k = 1 if chain else shape.budget
    start = time.perf_counter()
    dist = await draft_session.propose(committed, shape.depth, top_k)
    draft_s = time.perf_counter() - start
    if chain:
        return build_chain(committed[-1], dist, shape.depth), draft_s
    return build_tree(committed[-1], dist, shape.budget, shape.depth), draft_s


async def speculate(
    session: TargetSession,
    draft_session: DraftSession | None,
    committed: list[int],
    shape: RoundShape,
    choose: Callable[[DraftTree], int] | None = None,
) -> Round:
    """Run one round and append its tokens to `committed` (whose last token is the root).

    `choose`, when given, says how many of the built tree's nodes to verify (the tree
    is built at the full budget; its first n nodes are the budget-n tree)."""
    calls_before = session.counters.upstream_calls
    tokens_before = session.counters.verify_prompt_tokens
    root = committed[-1]
    draft_calls_before = draft_session.draft_calls if draft_session is not None else 0
    draft_error = None
    start = time.perf_counter()
    draft_s = 0.0
    tree = root_only(root)
    if shape.depth >= 1 and draft_session is not None and shape.kind != "none":
        try:
            tree, draft_s = await draft_tree(draft_session, committed, shape)
        except DraftError as exc:
            draft_error = exc.kind  # plain decoding this round; the drafter reports it
            draft_s = time.perf_counter() - start
        if choose is not None and draft_error is None:
            tree = tree.prefix(choose(tree))
    built = time.perf_counter()

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
        draft_s=draft_s,
        tree_s=built - start - draft_s,
        verify_s=verified - built,
        upstream_calls=session.counters.upstream_calls - calls_before,
        verify_prompt_tokens=session.counters.verify_prompt_tokens - tokens_before,
        draft_calls=(draft_session.draft_calls if draft_session is not None else 0)
        - draft_calls_before,
        draft_error=draft_error,
    )
    return Round(
        tokens=list(round_tokens),
        logprobs=logprobs,
        stats=stats,
        tree=tree,
        accepted_nodes=result.accepted_nodes,
    )
