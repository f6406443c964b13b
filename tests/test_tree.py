"""The tree builders and the walk: pure code, checked on hand cases and by property tests."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.tree import DraftDistribution, build_chain, build_tree, walk


def _dist(log_probs: np.ndarray, seed: int = 0) -> DraftDistribution:
    """Random distinct token ids per depth, ranks sorted by the given log-probs."""
    rng = np.random.default_rng(seed)
    depth, top_k = log_probs.shape
    token_ids = np.stack([rng.choice(1000, top_k, replace=False) for _ in range(depth)])
    return DraftDistribution(token_ids=token_ids, log_probs=-np.sort(-log_probs, axis=1))


@st.composite
def distributions(draw):
    depth = draw(st.integers(1, 8))
    top_k = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**16))
    logits = np.random.default_rng(seed).normal(size=(depth, 1000)) * draw(st.floats(0.1, 5))
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    top = -np.sort(-log_probs, axis=1)[:, :top_k]
    return _dist(top, seed)


@settings(max_examples=200, deadline=None)
@given(dist=distributions(), budget=st.integers(1, 80), data=st.data())
def test_tree_properties(dist, budget, data):
    max_depth = data.draw(st.integers(1, dist.max_depth))
    tree = build_tree(7, dist, budget, max_depth)
    # Budget respected, and filled whenever the candidates allow it.
    assert tree.num_nodes == min(budget, sum(dist.top_k**d for d in range(1, max_depth + 1)))
    assert tree.depths[1:].max(initial=0) <= max_depth
    # Non-increasing path weight in pop order.
    assert np.all(np.diff(tree.path_log_probs[1:]) <= 1e-12)
    # Parents precede children, depth = parent's depth + 1, weights add up.
    for node_idx in range(1, tree.num_nodes + 1):
        parent = tree.parents[node_idx]
        assert 0 <= parent < node_idx
        assert tree.depths[node_idx] == tree.depths[parent] + 1
        depth = tree.depths[node_idx]
        rank = list(dist.token_ids[depth - 1]).index(tree.token_ids[node_idx])
        expected = tree.path_log_probs[parent] + dist.log_probs[depth - 1, rank]
        assert tree.path_log_probs[node_idx] == pytest.approx(expected)
        assert tree.children[parent][int(tree.token_ids[node_idx])] == node_idx
    # The mask is exactly the ancestor-or-self relation.
    mask = tree.ancestor_mask()
    for node_idx in range(tree.num_nodes + 1):
        ancestors = {0, *tree.path(node_idx)}
        assert set(np.nonzero(mask[node_idx])[0].tolist()) == ancestors


@settings(max_examples=100, deadline=None)
@given(dist=distributions(), budget=st.integers(1, 40))
def test_tree_is_the_heaviest_set(dist, budget):
    """Best-first = the `budget` heaviest paths: no node left out outweighs the lightest kept."""
    tree = build_tree(0, dist, budget, dist.max_depth)
    kept = {tuple(tree.path_tokens(n)) for n in range(1, tree.num_nodes + 1)}
    lightest = tree.path_log_probs[1:].min(initial=0.0)
    for path in kept:
        depth = len(path)
        if depth < dist.max_depth:
            child = (*path, int(dist.token_ids[depth, 0]))
            if child not in kept:
                child_weight = sum(
                    dist.log_probs[d, list(dist.token_ids[d]).index(tok)]
                    for d, tok in enumerate(child)
                )
                assert child_weight <= lightest + 1e-9


def test_chain_is_rank_zero_path():
    dist = _dist(np.log(np.array([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5]])))
    tree = build_chain(5, dist, 3)
    assert tree.token_ids.tolist() == [5, *dist.token_ids[:, 0].tolist()]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.depths.tolist() == [0, 1, 2, 3]


def test_hand_built_tree_and_walk():
    # depth 1: a (0.6), b (0.4); depth 2: c (0.7), d (0.3)
    dist = DraftDistribution(
        token_ids=np.array([[10, 11], [12, 13]]),
        log_probs=np.log(np.array([[0.6, 0.4], [0.7, 0.3]])),
    )
    tree = build_tree(99, dist, budget=4, max_depth=2)
    # Weights: a .6, a-c .42, b .4, b-c .28, a-d .18 -> the four heaviest.
    assert tree.token_ids.tolist() == [99, 10, 12, 11, 12]
    assert tree.parents.tolist() == [-1, 0, 1, 0, 3]
    # Target says b at root, c after b, 77 after b-c: accept b, c; bonus 77.
    target = np.array([11, 0, 0, 12, 77])
    result = walk(tree, target)
    assert result.accepted_nodes == [3, 4]
    assert result.accepted_tokens == [11, 12]
    assert result.bonus_token == 77
    assert result.acceptance_length == 3
    # Target disagrees at the root: nothing accepted, the bonus is the root's token.
    result = walk(tree, np.array([55, 0, 0, 0, 0]))
    assert result.committed_tokens == [55] and result.acceptance_length == 1


def test_minus_inf_candidates_are_never_used():
    dist = DraftDistribution(
        token_ids=np.array([[1, 2, 0], [3, 0, 0]]),
        log_probs=np.array([[-0.1, -1.0, -np.inf], [-0.2, -np.inf, -np.inf]]),
    )
    tree = build_tree(0, dist, budget=50, max_depth=2)
    assert tree.num_nodes == 4  # 1, 2, 1-3, 2-3
    assert build_chain(0, DraftDistribution(dist.token_ids, np.full((2, 3), -np.inf)), 2).num_nodes == 0


@pytest.mark.parametrize(
    "budget, depth, message",
    [(0, 1, "budget must be >= 1"), (4, 0, "depth must be >= 1"), (4, 3, "exceeds the 2 depths")],
)
def test_bad_arguments(budget, depth, message):
    dist = _dist(np.log(np.full((2, 2), 0.5)))
    with pytest.raises(ValueError, match=message):
        build_tree(0, dist, budget, depth)


@pytest.mark.parametrize("seed", range(5))
def test_prefix_of_a_best_first_tree_is_the_smaller_budget_tree(seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(6, 40))
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    order = np.argsort(-log_probs, axis=1)[:, :32]
    dist = DraftDistribution(order.astype(np.int64), np.take_along_axis(log_probs, order, 1))
    full = build_tree(3, dist, 32, 6)
    for budget in (1, 2, 5, 17, 32):
        small = build_tree(3, DraftDistribution(dist.token_ids[:, :budget], dist.log_probs[:, :budget]), budget, 6)
        prefix = full.prefix(budget)
        for field in ("token_ids", "depths", "parents", "path_log_probs"):
            assert np.array_equal(getattr(prefix, field), getattr(small, field)), field
        assert prefix.children == small.children
