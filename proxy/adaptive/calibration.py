"""How often a drafted node is really accepted, as a function of the path probability
the drafter gave it.

Drafters are over- or under-confident (an n-gram table's "probabilities" are counts;
a distilled drafter is trained on the target's argmax). Every verified node is one
observation: (its path probability p = exp(path_log_prob), whether the walk accepted
it). Observations are binned by log p; each bin holds a Beta(1, 1)-smoothed, forgetting
acceptance rate, and a node's calibrated acceptance is its bin's rate. Shadow rounds
(trees the drafter proposes while plain generation runs, walked along the tokens that
really came) feed it too.
"""

from __future__ import annotations

import threading

import numpy as np

# Bin edges over log p: p in (e^-1, 1], (e^-2, e^-1], ... , (0, e^-_NUM_BINS+1].
_NUM_BINS = 12
_DECAY = 0.999  # per observed round: old evidence fades over a few thousand nodes


class Calibration:
    def __init__(self) -> None:
        self._accepted = np.zeros(_NUM_BINS)
        self._seen = np.zeros(_NUM_BINS)
        self._lock = threading.Lock()

    @staticmethod
    def _bins(path_log_probs: np.ndarray) -> np.ndarray:
        return np.clip(np.floor(-path_log_probs), 0, _NUM_BINS - 1).astype(np.int64)

    def acceptance(self, path_log_probs: np.ndarray) -> np.ndarray:
        """[n] calibrated acceptance probabilities of nodes with these path log-probs.

        An unseen bin starts at the drafter's own probability (trust it until shown
        otherwise); evidence pulls it towards the observed rate."""
        bins = self._bins(path_log_probs)
        prior = np.exp(path_log_probs)
        with self._lock:
            accepted, seen = self._accepted[bins], self._seen[bins]
        return (accepted + 2 * prior) / (seen + 2)

    def observe(self, path_log_probs: np.ndarray, accepted: np.ndarray) -> None:
        """One round's nodes: their path log-probs [n] and whether each was accepted [n]."""
        bins = self._bins(path_log_probs)
        with self._lock:
            self._accepted *= _DECAY
            self._seen *= _DECAY
            np.add.at(self._accepted, bins, accepted.astype(np.float64))
            np.add.at(self._seen, bins, 1.0)

    def table(self) -> list[tuple[float, float, float]]:
        """(upper path probability of the bin, observed acceptance, weight) per seen bin."""
        with self._lock:
            return [
                (float(np.exp(-idx)), float(self._accepted[idx] / self._seen[idx]), float(w))
                for idx, w in enumerate(self._seen)
                if w > 0.5
            ]
