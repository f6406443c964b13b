"""What the adaptive policy measures while serving. Every estimate fades with one
wall-clock half-life: evidence `age` seconds old weighs 2^(-age / half-life), so after
a change of load or of text the new evidence outweighs the old within seconds, and a
side not measured for a while keeps its last value (the policy re-measures it when it is
stale: `Policy.measured_at`).

* `LinearCost` -- a latency linear in what a call asks for, a non-negative least-squares
  fit over the recent calls (`nonnegative_ridge`): a verification call's
  seconds = per_call + per_prompt * prompts + per_token * computed (prompts = tree
  nodes + 1, the root; computed = tokens the target had not processed, summed over the
  prompts); a plain stretch's (`PlainCost`) seconds = opening + per_token(load) * tokens.
* `Fading` -- faded sums: a rate (tokens, seconds) or a mean (sum, count).
* `Calibration` -- how often a drafted node is really accepted, per bin of the drafter's
  own conditional probability of it.

No HTTP, no models: numbers in, numbers out, on the clock they are given.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np

from proxy.tree import DraftTree

Clock = Callable[[], float]

# Seconds after which evidence weighs half: long enough to average many rounds or
# stream events (a GPU round takes tens of ms), short enough to follow a change of
# load or text within a few seconds. It is also the staleness bound of the policy.
# The default of `--policy-half-life` (an upstream whose clock runs slower, as the
# benchmarks' GPU simulator's does, needs it stretched alike).
HALF_LIFE_S = 10.0
# Ridge weight on the fit's scaled coefficients, per unit of evidence: it only decides
# what the calls cannot (e.g. per-call vs per-prompt cost when every call had the same
# size).
RIDGE = 1e-3
# Observations a fit keeps (at the decay above, older ones weigh nearly nothing on a
# busy server; the cap bounds the work of one fit).
MAX_CALLS = 256
# Calibration bins over -log q, q the drafter's conditional probability of a node: bin
# b holds q in (e^-(b+1)w, e^-bw]; 0.5 splits q = 1 .. 0.6 .. 0.37 .. 0.22 ...
BIN_WIDTH = 0.5
# The drafter's own probability counts as this many observations of its bin; and the
# calibration's word, as this many of a request's own edges (`RequestAcceptance`).
PRIOR_WEIGHT = 2.0
# A request's own evidence halves with each tree walked after it: its last few walks
# decide (acceptance runs in streaks -- text the drafter matches, then text it does not).
WALK_FADE = 0.5


def decay(age_s: float, half_life_s: float = HALF_LIFE_S) -> float:
    """The weight of evidence `age_s` seconds old."""
    return 2.0 ** (-age_s / half_life_s)


class Fading:
    """Sums [size] that fade with the half-life."""

    def __init__(self, size: int, clock: Clock, half_life_s: float = HALF_LIFE_S) -> None:
        self._clock = clock
        self.half_life_s = half_life_s
        self._sums = np.zeros(size)
        self._at: float | None = None  # the clock the sums are faded to

    def _fade_to(self, now: float) -> None:
        if self._at is not None:
            self._sums *= decay(now - self._at, self.half_life_s)
        self._at = now

    def add(self, *values: float) -> None:
        now = self._clock()
        self._fade_to(now)
        self._sums += values

    def sums(self) -> np.ndarray:
        self._fade_to(self._clock())
        return self._sums.copy()

    def ratio(self) -> float | None:
        """sums[0] / sums[1] (a rate, or a mean), None before any positive denominator."""
        numerator, denominator = self.sums()[:2]
        return float(numerator / denominator) if denominator > 0 else None


def nonnegative_ridge(
    rows: np.ndarray, weights: np.ndarray, ridged: np.ndarray | None = None
) -> np.ndarray:
    """[k] non-negative coefficients minimizing the weighted squared error of
    rows [n, k + 1] = (features..., seconds), on feature columns scaled to unit weighted
    RMS, with RIDGE * sum(weights) on the squared scaled coefficients (those `ridged`
    marks; default all).

    The least-squares problem with the ridge rows appended is solved exactly: its
    non-negative optimum is the unconstrained optimum on some subset of the columns, so
    every subset whose solution is non-negative is tried and the smallest residual kept
    (seven subsets for three columns). Each is solved on the k x k normal equations
    (columns scaled, ridge on the diagonal), where its residual is |target|^2 minus
    solution . moment: a fit in ~80 us of CPU instead of ~200 with numpy's solvers on
    the rows, and the policy refits after every request it records."""
    design, scale, target = ridge_system(rows, weights, ridged)
    gram, moment = (design.T @ design).tolist(), (design.T @ target).tolist()
    num_cols = len(moment)
    best, best_gain = np.zeros(num_cols), 0.0  # no column: the residual is |target|^2
    for size in range(1, num_cols + 1):
        for cols in itertools.combinations(range(num_cols), size):
            solved = _solve([[gram[i][j] for j in cols] for i in cols], [moment[i] for i in cols])
            # A singular subset (a feature never seen) is skipped: whatever it fits, a
            # linearly independent part of it fits as well, with coefficients >= 0.
            if solved is None or min(solved) < 0:
                continue
            gain = sum(x * moment[i] for x, i in zip(solved, cols, strict=True))
            if gain > best_gain:
                best, best_gain = np.zeros(num_cols), gain
                best[list(cols)] = solved
    return best / scale


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """x with matrix @ x = rhs (a few unknowns: Gaussian elimination with partial
    pivoting, in floats -- numpy's per-call overhead is larger than the work); None if
    the matrix is singular to 1e-12 of its largest diagonal entry."""
    size = len(rhs)
    rows = [row[:] + [value] for row, value in zip(matrix, rhs, strict=True)]
    tiny = 1e-12 * max(abs(rows[i][i]) for i in range(size))
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) <= tiny:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, size):
            factor = rows[r][col] / rows[col][col]
            rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col], strict=True)]
    solved = [0.0] * size
    for r in reversed(range(size)):
        known = sum(rows[r][c] * solved[c] for c in range(r + 1, size))
        solved[r] = (rows[r][size] - known) / rows[r][r]
    return solved


def ridge_system(
    rows: np.ndarray, weights: np.ndarray, ridged: np.ndarray | None = None
) -> tuple[np.ndarray, ...]:
    """(design [n + k, k], column scale [k], target [n + k]) of `nonnegative_ridge`:
    the weighted rows with scaled columns, then sqrt(RIDGE * sum(weights)) * I (its
    rows of unridged columns zero)."""
    num_cols = rows.shape[1] - 1
    root = np.sqrt(weights)
    x, y = rows[:, :num_cols] * root[:, None], rows[:, num_cols] * root
    scale = np.sqrt(np.sum(x**2, axis=0) / np.sum(weights))
    scale[scale == 0] = 1.0
    ridge = math.sqrt(RIDGE * float(np.sum(weights))) * np.eye(num_cols)
    if ridged is not None:
        ridge *= np.asarray(ridged, dtype=float)[:, None]
    return np.vstack([x / scale, ridge]), scale, np.concatenate([y, np.zeros(num_cols)])


class LinearCost:
    """seconds = coefficients . (1, features...), fitted over the recent observations
    (`nonnegative_ridge`, each row weighted by its age's `decay`; `ridged`: the
    coefficients the ridge holds down, default all)."""

    def __init__(
        self,
        num_features: int,
        clock: Clock,
        ridged: tuple[bool, ...] | None = None,
        half_life_s: float = HALF_LIFE_S,
    ) -> None:
        self._clock = clock
        self.half_life_s = half_life_s
        self._num_cols = num_features + 1
        self._ridged = None if ridged is None else np.asarray(ridged, dtype=bool)
        # The latest MAX_CALLS observations (t, features..., seconds), a ring: row
        # `_count % MAX_CALLS` is written next (a fit does not depend on their order).
        self._rows = np.empty((MAX_CALLS, 1 + self._num_cols))
        self._count = 0  # observations so far
        self._latest = 0.0  # the clock of the last one
        self._theta: np.ndarray | None = None

    def observe(self, *features_and_seconds: float) -> None:
        assert len(features_and_seconds) == self._num_cols, features_and_seconds
        self._latest = self._clock()
        self._rows[self._count % MAX_CALLS] = (self._latest, *features_and_seconds)
        self._count += 1
        self._theta = None

    @property
    def num_rows(self) -> int:
        """The observations the fit holds."""
        return min(self._count, MAX_CALLS)

    def coefficients(self) -> np.ndarray:
        """[1 + features] seconds per unit of each; zeros before any observation.
        (Fading scales every row's weight alike as time passes, so the fit changes only
        when a row is added.)"""
        if self._theta is None:
            if not self._count:
                return np.zeros(self._num_cols)
            data = self._rows[: self.num_rows]
            # `decay` of each row's age, at once.
            weights = 2.0 ** ((data[:, 0] - self._latest) / self.half_life_s)
            self._theta = nonnegative_ridge(self._design(data[:, 1:], weights), weights, self._ridged)
        return self._theta

    def _design(self, observed: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """The fit's rows [n, 1 + features + 1] = (1, features..., seconds) from the
        observations [n, features + 1]."""
        return np.column_stack([np.ones(len(observed)), observed])

    def seconds(self, *features: np.ndarray | float) -> np.ndarray:
        theta = self.coefficients()
        return theta[0] + sum(c * np.asarray(f) for c, f in zip(theta[1:], features, strict=True))


class PlainCost(LinearCost):
    """A plain stretch's seconds = opening + tokens * per_token(load), observed as
    (tokens, load, seconds): `load` the requests in flight on the engine meanwhile, which
    share its steps. per_token(load) = per_token + per_load * (load - the observed mean
    load), both non-negative: measured at one load, the load column is zero and the fit
    is the load-blind one; once stretches span loads, a stretch is predicted at the
    present load, not at the mean of the last half-life's (after a drop from 16 requests
    to 4, plain would otherwise look 16-request slow for a half-life). Outside the loads
    observed, see `per_token`. What stretches cannot tell apart (all of one length) is
    charged to the opening, not the tokens: extrapolated to a longer stretch, plain then
    looks fast, and plain is never slower than the target alone."""

    def __init__(self, clock: Clock, half_life_s: float = HALF_LIFE_S) -> None:
        super().__init__(2, clock, ridged=(False, True, True), half_life_s=half_life_s)
        self._mean_load = 0.0
        self._loads = (0.0, 0.0)  # the least and most observed

    def _design(self, observed: np.ndarray, weights: np.ndarray) -> np.ndarray:
        tokens, load, seconds = observed.T
        # Centred so that the load column is orthogonal to the tokens column (weighted):
        # per_token is the time at the mean load whatever per_load comes out.
        self._mean_load = float(np.average(load, weights=weights * tokens**2))
        self._loads = (float(load.min()), float(load.max()))
        return np.column_stack(
            [np.ones(len(tokens)), tokens, tokens * (load - self._mean_load), seconds]
        )

    def opening(self) -> float:
        return float(self.coefficients()[0])

    def per_token(self, load: float) -> float:
        """Seconds per token at `load` requests in flight (0 before any observation).
        Outside the loads observed, the fastest plain could be -- plain is never slower
        than the target alone, so where unsure it is the side to favour: an engine step
        of more sequences is never faster (above: as at the most observed), and one of
        fewer takes no less than its share of a step of more (below: in proportion)."""
        _, per_token, per_load = self.coefficients()
        least, most = self._loads
        seconds = float(per_token + per_load * (min(max(load, least), most) - self._mean_load))
        return seconds * load / least if 0 < load < least else seconds


def edge_log_probs(tree: DraftTree) -> np.ndarray:
    """[num_nodes] the drafter's conditional log-probability of each node given its parent."""
    return tree.path_log_probs[1:] - tree.path_log_probs[tree.parents[1:]]


class RequestAcceptance:
    """How a request's drafted edges fare against the shared calibration: the ratio of
    its accepted to its expected edges, the last walks weighing most (WALK_FADE), with
    PRIOR_WEIGHT edges at the calibration's word. The calibration pools every request;
    within one, acceptance runs in streaks (after a round that accepted nothing the next
    accepts far less than the pool says, after a whole chain far more)."""

    def __init__(self) -> None:
        self._accepted = 0.0
        self._expected = 0.0

    def add(self, accepted: float, expected: float) -> None:
        self._accepted = WALK_FADE * self._accepted + accepted
        self._expected = WALK_FADE * self._expected + expected

    def factor(self) -> float:
        return (self._accepted + PRIOR_WEIGHT) / (self._expected + PRIOR_WEIGHT)


class Calibration:
    """Acceptance of a drafted node by the target, learnt per *edge*: a node whose parent
    was accepted (the root always is), with the drafter's conditional probability q of
    its token. A node is accepted when every edge on its path is, so its calibrated
    acceptance is the product of its edges' rates. (Whole-path calibration would give
    every node of a sure n-gram chain one rate however deep.)"""

    def __init__(self, clock: Clock, half_life_s: float = HALF_LIFE_S) -> None:
        self._clock = clock
        self.half_life_s = half_life_s
        self._accepted = np.zeros(0)  # [num_bins] faded counts
        self._seen = np.zeros(0)
        self._at: float | None = None

    @staticmethod
    def _bins(log_q: np.ndarray) -> np.ndarray:
        return np.floor(np.maximum(-log_q, 0.0) / BIN_WIDTH).astype(np.int64)

    def _fade_to_now(self) -> None:
        now = self._clock()
        if self._at is not None:
            factor = decay(now - self._at, self.half_life_s)
            self._accepted *= factor
            self._seen *= factor
        self._at = now

    def edge_acceptance(self, log_q: np.ndarray) -> np.ndarray:
        """[n] calibrated acceptance of edges with these conditional log-probs: the
        drafter's own q, pulled towards the observed rate of its bin by the evidence."""
        self._fade_to_now()
        # A bin without evidence yet reads the appended zero.
        bins = np.minimum(self._bins(log_q), len(self._seen))
        accepted = np.append(self._accepted, 0.0)[bins]
        seen = np.append(self._seen, 0.0)[bins]
        return (accepted + PRIOR_WEIGHT * np.exp(log_q)) / (seen + PRIOR_WEIGHT)

    def acceptance(self, tree: DraftTree, factor: float = 1.0) -> np.ndarray:
        """[num_nodes] calibrated probability that each node of `tree` is accepted, every
        edge's rate scaled by `factor` (a request's own, `RequestAcceptance`; at most 1)."""
        edges = np.minimum(factor * self.edge_acceptance(edge_log_probs(tree)), 1.0)
        path = np.ones(tree.num_nodes + 1)
        for node in range(1, tree.num_nodes + 1):  # parents precede children
            path[node] = path[tree.parents[node]] * edges[node - 1]
        return path[1:]

    def observe(self, tree: DraftTree, accepted_nodes: list[int]) -> tuple[float, float]:
        """One walked tree and the nodes its walk accepted. Returns (edges accepted,
        edges expected accepted before this walk taught the calibration), over the edges
        the walk reached (their parent accepted)."""
        if not tree.num_nodes:
            return 0.0, 0.0
        accepted = np.zeros(tree.num_nodes + 1, dtype=bool)
        accepted[0] = True
        accepted[np.asarray(accepted_nodes, dtype=np.int64)] = True
        reached = accepted[tree.parents[1:]]  # edges whose parent was accepted
        log_q = edge_log_probs(tree)[reached]
        expected = float(self.edge_acceptance(log_q).sum())
        hits = accepted[1:][reached]
        bins = self._bins(log_q)
        if bins.size and bins.max() >= len(self._seen):
            grow = int(bins.max()) + 1 - len(self._seen)
            self._accepted = np.concatenate([self._accepted, np.zeros(grow)])
            self._seen = np.concatenate([self._seen, np.zeros(grow)])
        np.add.at(self._accepted, bins, hits.astype(np.float64))
        np.add.at(self._seen, bins, 1.0)
        return float(hits.sum()), expected

    def table(self) -> list[tuple[float, float, float]]:
        """(upper edge probability of the bin, observed acceptance, weight) per bin with
        evidence."""
        self._fade_to_now()
        return [
            (math.exp(-idx * BIN_WIDTH), float(self._accepted[idx] / weight), float(weight))
            for idx, weight in enumerate(self._seen)
            if weight > 0
        ]
