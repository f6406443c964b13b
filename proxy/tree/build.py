"""Tree builders: DDTree's best-first heap and the plain chain baseline.

A node at depth d that uses the rank-r token of depth d has weight = the sum of the
chosen log-probabilities along its path. The heap pops the heaviest frontier node;
popping adds it to the tree and pushes (a) its next sibling (rank r+1 at depth d,
same parent) and (b) its first child (rank 0 at depth d+1). Because ranks are sorted
and log-probabilities are <= 0, a pushed node is never heavier than the node that
pushed it, so nodes come out in non-increasing weight and parents before children.
Candidates whose log-probability is -inf (a drafter with fewer than top_k
candidates at that depth) are never pushed.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from proxy.tree.tree import DraftDistribution, DraftTree


def _validate(dist: DraftDistribution, max_depth: int) -> None:
    if max_depth < 1:
        raise ValueError(f"depth must be >= 1, got {max_depth}")
    if max_depth > dist.max_depth:
        raise ValueError(
            f"depth {max_depth} exceeds the {dist.max_depth} depths the drafter proposed"
        )


def _freeze(
    root_token: int,
    token_ids: list[int],
    depths: list[int],
    parents: list[int],
    weights: list[float],
) -> DraftTree:
    children: list[dict[int, int]] = [{} for _ in token_ids]
    for node_idx in range(1, len(token_ids)):
        siblings = children[parents[node_idx]]
        assert token_ids[node_idx] not in siblings, "duplicate token among siblings"
        siblings[token_ids[node_idx]] = node_idx
    return DraftTree(
        token_ids=np.asarray([root_token, *token_ids[1:]], dtype=np.int64),
        depths=np.asarray(depths, dtype=np.int64),
        parents=np.asarray(parents, dtype=np.int64),
        path_log_probs=np.asarray(weights, dtype=np.float64),
        children=tuple(children),
    )


def build_tree(
    root_token: int, dist: DraftDistribution, budget: int, max_depth: int
) -> DraftTree:
    """Best-first DDTree of at most `budget` nodes and `max_depth` levels."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    _validate(dist, max_depth)
    token_table = dist.token_ids
    logp_table = np.asarray(dist.log_probs, dtype=np.float64)
    top_k = dist.top_k

    token_ids, depths, parents, weights = [root_token], [0], [-1], [0.0]
    # Entries: (-weight, push order, depth, rank, parent node index). The push order
    # breaks ties deterministically (first pushed, first popped).
    heap: list[tuple[float, int, int, int, int]] = []
    push_count = 0

    def push(weight: float, depth: int, rank: int, parent_idx: int) -> None:
        nonlocal push_count
        if math.isinf(weight):
            return
        heapq.heappush(heap, (-weight, push_count, depth, rank, parent_idx))
        push_count += 1

    push(float(logp_table[0, 0]), 1, 0, 0)
    while heap and len(token_ids) <= budget:
        neg_weight, _, depth, rank, parent_idx = heapq.heappop(heap)
        weight = -neg_weight
        node_idx = len(token_ids)
        token_ids.append(int(token_table[depth - 1, rank]))
        depths.append(depth)
        parents.append(parent_idx)
        weights.append(weight)
        if rank + 1 < top_k:
            sibling_weight = weights[parent_idx] + float(logp_table[depth - 1, rank + 1])
            push(sibling_weight, depth, rank + 1, parent_idx)
        if depth < max_depth:
            push(weight + float(logp_table[depth, 0]), depth + 1, 0, node_idx)
    return _freeze(root_token, token_ids, depths, parents, weights)


def build_chain(root_token: int, dist: DraftDistribution, max_depth: int) -> DraftTree:
    """The plain DFlash baseline: the rank-0 token at every depth, one path."""
    _validate(dist, max_depth)
    token_ids, depths, parents, weights = [root_token], [0], [-1], [0.0]
    for depth in range(1, max_depth + 1):
        log_prob = float(dist.log_probs[depth - 1, 0])
        if math.isinf(log_prob):
            break
        token_ids.append(int(dist.token_ids[depth - 1, 0]))
        depths.append(depth)
        parents.append(depth - 1)
        weights.append(weights[-1] + log_prob)
    return _freeze(root_token, token_ids, depths, parents, weights)
