"""How often a drafted node is really accepted, learnt from the drafter's own
probabilities and what the target really accepted.

Drafters are over- or under-confident (an n-gram table's "probabilities" are counts: a
chain it is sure of gets probability 1 at every depth; a distilled drafter is trained on
the target's argmax). The unit of evidence is one *edge*: a node whose parent was
accepted (the root always is), with the drafter's conditional probability q of its token
given the parent, q = exp(path_log_prob[node] - path_log_prob[parent]); the observation
is whether the walk accepted it. Edges are binned by log q; each bin holds a smoothed,
forgetting acceptance rate, prior the drafter's own q with the weight of `_PRIOR`
observations. A node is accepted exactly when every edge on its path is, so its
calibrated acceptance is the product of its edges' rates. (Calibrating whole-path
probabilities instead would give every node of a sure n-gram chain the same rate, however
deep: measured at budget 8 on the GPU-profile shim, that predicted twice the tokens a
round really returned.) Shadow rounds (trees the drafter proposes while plain generation
runs, walked along the tokens that really came) feed it too.
"""

from __future__ import annotations

import threading

import numpy as np

from proxy.tree import DraftTree

# Bins over -log q, 0.5 wide: q in (e^-0.5, 1], (e^-1, e^-0.5], ..., the last open-ended.
_BIN_WIDTH = 0.5
_NUM_BINS = 16
_PRIOR = 2.0  # the drafter's own probability counts as this many observations
_DECAY = 0.999  # per observed round: old evidence fades over a few thousand edges


def edge_log_probs(tree: DraftTree) -> np.ndarray:
    """[num_nodes] the drafter's conditional log-probability of each node given its parent."""
    return tree.path_log_probs[1:] - tree.path_log_probs[tree.parents[1:]]


class Calibration:
    def __init__(self) -> None:
        self._accepted = np.zeros(_NUM_BINS)
        self._seen = np.zeros(_NUM_BINS)
        self._lock = threading.Lock()

    @staticmethod
    def _bins(log_q: np.ndarray) -> np.ndarray:
        return np.clip(np.floor(-log_q / _BIN_WIDTH), 0, _NUM_BINS - 1).astype(np.int64)

    def edge_acceptance(self, log_q: np.ndarray) -> np.ndarray:
        """[n] calibrated acceptance of edges with these conditional log-probs (an unseen
        bin: the drafter's own probability; evidence pulls it to the observed rate)."""
        bins = self._bins(log_q)
        with self._lock:
            accepted, seen = self._accepted[bins], self._seen[bins]
        return (accepted + _PRIOR * np.exp(log_q)) / (seen + _PRIOR)

    def acceptance(self, tree: DraftTree) -> np.ndarray:
        """[num_nodes] calibrated probability that each node of `tree` is accepted."""
        edges = self.edge_acceptance(edge_log_probs(tree))
        path = np.ones(tree.num_nodes + 1)
        parents = tree.parents
        for node in range(1, tree.num_nodes + 1):  # parents precede children
            path[node] = path[parents[node]] * edges[node - 1]
        return path[1:]

    def observe(self, tree: DraftTree, accepted_nodes: list[int]) -> None:
        """One walked tree and the nodes its walk accepted."""
        if not tree.num_nodes:
            return
        accepted = np.zeros(tree.num_nodes + 1, dtype=bool)
        accepted[0] = True
        accepted[np.asarray(accepted_nodes, dtype=np.int64)] = True
        reached = accepted[tree.parents[1:]]  # edges whose parent was accepted
        bins = self._bins(edge_log_probs(tree))[reached]
        with self._lock:
            self._accepted *= _DECAY
            self._seen *= _DECAY
            np.add.at(self._accepted, bins, accepted[1:][reached].astype(np.float64))
            np.add.at(self._seen, bins, 1.0)

    def table(self) -> list[tuple[float, float, float]]:
        """(upper edge probability of the bin, observed acceptance, weight) per seen bin."""
        with self._lock:
            return [
                (float(np.exp(-idx * _BIN_WIDTH)), float(self._accepted[idx] / w), float(w))
                for idx, w in enumerate(self._seen)
                if w > 0.5
            ]
