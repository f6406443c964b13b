"""The draft tree value and the walk that accepts a path of it.

Terms, defined once here and used everywhere:

* **root** -- the last committed token. It is decided, but the target has not yet
  produced the token that follows it. Node index 0 is always the root.
* **node** -- a drafted token, index 1..num_nodes, at depth >= 1 below the root.
* **target token at a node** -- the token the target emits after the root's context
  plus the path to that node (argmax when greedy, a draw when sampling).
* **accepted tokens** -- the drafted tokens on the longest root-to-node path whose
  every step equals the target's token at its parent.
* **bonus token** -- the target's token at the last accepted node (or at the root
  when nothing was accepted). It is always correct and always committed.
* **acceptance length** (tau for one round) = len(accepted) + 1.

Worked example: root r, nodes 1:'a'(parent 0), 2:'b'(parent 0), 3:'c'(parent 1).
If the target says 'a' at the root, 'c' at node 1 and 'z' at node 3, the walk goes
0 -> 1 -> 3, accepted = ['a', 'c'], bonus = 'z', acceptance length 3.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DraftDistribution:
    """A drafter's per-depth top-k proposal for the positions after the root.

    Row d-1 describes depth d (the d-th token after the root). Ranks are sorted by
    log-probability, best first.
    """

    token_ids: np.ndarray  # [max_depth, top_k] int64
    log_probs: np.ndarray  # [max_depth, top_k] float64, non-increasing along axis 1

    def __post_init__(self) -> None:
        assert self.token_ids.ndim == 2, self.token_ids.shape
        assert self.token_ids.shape == self.log_probs.shape, (
            self.token_ids.shape,
            self.log_probs.shape,
        )

    @property
    def max_depth(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.token_ids.shape[1])


@dataclass(frozen=True)
class DraftTree:
    """A built tree. Every array is indexed by node index; index 0 is the root.

    Nodes are stored in the order they were popped from the best-first heap, so
    a parent always precedes its children.
    """

    token_ids: np.ndarray  # [num_nodes + 1] int64; [0] is the root token
    depths: np.ndarray  # [num_nodes + 1] int64; [0] == 0
    parents: np.ndarray  # [num_nodes + 1] int64; [0] == -1
    path_log_probs: np.ndarray  # [num_nodes + 1] float64; [0] == 0.0
    children: tuple[dict[int, int], ...]  # [num_nodes + 1] token id -> child node index

    def __post_init__(self) -> None:
        size = self.token_ids.shape[0]
        assert self.token_ids.ndim == 1 and size >= 1
        assert self.depths.shape == (size,) and self.parents.shape == (size,)
        assert self.path_log_probs.shape == (size,) and len(self.children) == size
        assert self.parents[0] == -1 and self.depths[0] == 0

    @property
    def num_nodes(self) -> int:
        """Drafted nodes, the root excluded."""
        return int(self.token_ids.shape[0]) - 1

    @functools.cached_property
    def max_depth(self) -> int:
        # Cached: a plain stream's shadows ask for it on every event.
        return int(self.depths.max())

    def prefix(self, num_nodes: int) -> DraftTree:
        """The tree of its first `num_nodes` nodes. A best-first tree's prefix is the
        tree that a budget of `num_nodes` would have built (same pops, same order)."""
        assert 0 <= num_nodes <= self.num_nodes, (num_nodes, self.num_nodes)
        size = num_nodes + 1
        children = tuple(
            {token: idx for token, idx in kids.items() if idx < size}
            for kids in self.children[:size]
        )
        return DraftTree(
            token_ids=self.token_ids[:size],
            depths=self.depths[:size],
            parents=self.parents[:size],
            path_log_probs=self.path_log_probs[:size],
            children=children,
        )

    def path(self, node_idx: int) -> list[int]:
        """Node indices from the first node below the root down to `node_idx`."""
        path: list[int] = []
        while node_idx > 0:
            path.append(node_idx)
            node_idx = int(self.parents[node_idx])
        path.reverse()
        return path

    def path_tokens(self, node_idx: int) -> list[int]:
        """Drafted tokens from the root (excluded) down to `node_idx` (included)."""
        return [int(self.token_ids[idx]) for idx in self.path(node_idx)]

    def ancestor_mask(self) -> np.ndarray:
        """[num_nodes + 1, num_nodes + 1] bool: row i is True at i and its ancestors.

        This is the attention pattern of a tree-verification forward: a node may
        attend to itself and the nodes on its path up to (and including) the root.
        """
        size = self.num_nodes + 1
        mask = np.zeros((size, size), dtype=bool)
        mask[0, 0] = True
        for node_idx in range(1, size):
            # Parents precede children, so the parent's row is complete already.
            mask[node_idx] = mask[self.parents[node_idx]]
            mask[node_idx, node_idx] = True
        return mask


@dataclass(frozen=True)
class WalkResult:
    accepted_nodes: list[int]  # node indices on the accepted path, root excluded
    accepted_tokens: list[int]  # their tokens
    bonus_token: int  # the target's token at the last accepted node

    @property
    def acceptance_length(self) -> int:
        return len(self.accepted_tokens) + 1

    @property
    def committed_tokens(self) -> list[int]:
        """What this round commits: the accepted tokens, then the bonus token."""
        return [*self.accepted_tokens, self.bonus_token]


def walk(tree: DraftTree, target_tokens: np.ndarray) -> WalkResult:
    """Follow the target's choices down the tree (see the module docstring).

    target_tokens: [num_nodes + 1] int64, the target's token at the root and each node.
    """
    assert target_tokens.shape == (tree.num_nodes + 1,), (target_tokens.shape, tree.num_nodes)
    accepted_nodes: list[int] = []
    node_idx = 0
    while True:
        target_token = int(target_tokens[node_idx])
        child_idx = tree.children[node_idx].get(target_token)
        if child_idx is None:
            break
        accepted_nodes.append(child_idx)
        node_idx = child_idx
    return WalkResult(
        accepted_nodes=accepted_nodes,
        accepted_tokens=[int(tree.token_ids[idx]) for idx in accepted_nodes],
        bonus_token=int(target_tokens[node_idx]),
    )
