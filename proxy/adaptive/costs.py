"""The online cost model of one target.

A verification call's latency is fitted, by least squares over the last `_WINDOW`
calls (so the fit follows load; non-negative, columns scaled, a touch of ridge), to

    seconds = per_call + per_prompt * prompts + per_token * new_tokens

where `prompts` = tree nodes + 1 (the root) and `new_tokens` = the tokens the target
has not seen before this round, summed over prompts (each prompt's share of the
context committed since the last round, plus its path). On vLLM the per-prompt term
also absorbs the recomputed tail of each prompt's last partial cache block. This is
the form the benchmark report fitted offline (33 ms + 4.3 ms per prompt + 0.14 ms per
token on the CPU rows); here it is refitted while serving. (The first version used
recursive least squares with exponential forgetting: after 3,600 calls of nearly one
size -- plain streams' openings, one prompt each -- its covariance had wound up along
the unexcited direction and the fit read 4e12 s per prompt. A window re-solved from
its rows cannot wind up; where it cannot tell two terms apart, the ridge splits them,
and predictions near the sizes it has seen stay right.)

Plain generation is described by its first-token latency (a stream's set-up: one
prefill of the uncached tail; exponentially weighted) and its inter-token latency:
each stream's mean gap moves the estimate by its share of `_PLAIN_MEMORY_GAPS` gaps (a
stream that long replaces it: plain speed changes with load, and the newest stream is
the best witness).

The plain estimate is only refreshed while plain generation runs; `claim_plain_probe`
tells a speculating request when it has gone stale (`rounds_since_plain` real rounds,
all requests together, without a plain token) so that one request takes a short plain
stream to measure it again.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

_FORGETTING = 0.97  # per real round, for the prediction sums: ~33 rounds of memory
_WINDOW = 64  # verification calls the fit is solved over
_RIDGE = 1e-4  # on the scaled columns: only decides what the data cannot
_EWMA = 0.1
_PLAIN_MEMORY_GAPS = 4  # a plain stream with this many gaps replaces the estimate
_FIRST_TOKEN_EWMA = 0.3  # weight of the newest stream's first-token wait


@dataclass(frozen=True)
class CostSnapshot:
    per_call_s: float
    per_prompt_s: float
    per_token_s: float
    num_calls: int
    plain_first_token_s: float | None
    plain_token_s: float | None
    num_plain_tokens: int
    round_overhead_s: float
    prediction_ratio: float


class CostModel:
    def __init__(self) -> None:
        self._calls: deque[tuple[float, float, float, float]] = deque(maxlen=_WINDOW)
        self._theta = np.zeros(3)  # [per_call, per_prompt, per_token]
        self._stale = False  # calls arrived since _theta was solved
        self._num_calls = 0
        self._first_token_s: float | None = None
        self._token_s: float | None = None
        self._num_plain_tokens = 0
        self._overhead_s = 0.0  # drafting + tree building per round
        self._round_rate: float | None = None  # tokens per second of recent rounds
        self._rounds_since_plain = 0
        self._plain_tokens_since_round = 0
        self._plain_probe_after: int | None = None  # rounds; set by the first claim
        # Forgetting sums over real rounds: [predicted tokens, tokens, predicted s, s].
        self._prediction = np.zeros(4)
        self._lock = threading.Lock()

    def observe_call(self, num_prompts: int, new_tokens: int, seconds: float) -> None:
        with self._lock:
            self._calls.append((1.0, float(num_prompts), float(new_tokens), float(seconds)))
            self._stale = True
            self._num_calls += 1

    def _coefficients(self) -> np.ndarray:
        """[per_call, per_prompt, per_token], re-solved when calls came since."""
        with self._lock:
            if self._stale:
                self._theta = _nonnegative_ridge(np.asarray(self._calls))
                self._stale = False
            return self._theta

    def observe_plain(self, first_token_s: float | None, token_s: list[float]) -> None:
        """One plain stream: the wait for its first token (None if it was not timed) and
        the gaps between later tokens."""
        with self._lock:
            if first_token_s is not None:
                self._first_token_s = _ewma(self._first_token_s, first_token_s, _FIRST_TOKEN_EWMA)
            if token_s:
                mean_gap = float(np.mean(token_s))
                weight = min(1.0, len(token_s) / _PLAIN_MEMORY_GAPS)
                previous = mean_gap if self._token_s is None else self._token_s
                self._token_s = (1 - weight) * previous + weight * mean_gap
                self._rounds_since_plain = 0
            self._num_plain_tokens += len(token_s)
            self._plain_tokens_since_round += len(token_s) + (first_token_s is not None)

    def claim_plain_probe(self, first: int, most: int) -> bool:
        """Is the plain estimate stale -- `first` real rounds without plain generation,
        doubling after each probe that plain lost, up to `most`? True for one caller,
        who then measures plain generation again."""
        with self._lock:
            after = first if self._plain_probe_after is None else self._plain_probe_after
            if self._token_s is None or self._rounds_since_plain < after:
                return False
            self._rounds_since_plain = 0
            self._plain_probe_after = min(2 * after, most)
            return True

    def plain_won_probe(self, first: int) -> None:
        """A plain probe found plain faster: the next one comes soon again."""
        with self._lock:
            self._plain_probe_after = first

    def observe_round(self, num_tokens: int, seconds: float, overhead_s: float) -> None:
        """A whole speculative round: tokens committed, wall time, host-side overhead."""
        with self._lock:
            self._rounds_since_plain += 1
            self._plain_tokens_since_round = 0
            self._overhead_s = _ewma(self._overhead_s or None, overhead_s)
            if seconds > 0:
                self._round_rate = _ewma(self._round_rate, num_tokens / seconds)

    def observe_prediction(
        self, predicted_tokens: float, predicted_s: float, num_tokens: int, seconds: float
    ) -> None:
        """A real round against what the controller predicted for it."""
        with self._lock:
            self._prediction = _FORGETTING * self._prediction + np.array(
                [predicted_tokens, num_tokens, predicted_s, seconds]
            )

    def prediction_ratio(self) -> float:
        """Real rounds' rate over the predicted rate (tokens and time, summed over recent
        rounds): the calibration and the fit each miss something (the drafter's
        correlations between siblings, host time outside the call); 1 before any round."""
        predicted_tokens, tokens, predicted_s, seconds = self._prediction
        if predicted_tokens <= 0 or seconds <= 0:
            return 1.0
        return float((tokens / predicted_tokens) * (predicted_s / seconds))

    def round_overhead_s(self) -> float:
        return self._overhead_s

    @property
    def plain_tokens_since_round(self) -> int:
        """Plain tokens (all requests) since the last real round: how old the round rate is."""
        return self._plain_tokens_since_round

    def recent_round_rate(self) -> float:
        return self._round_rate if self._round_rate is not None else float("inf")

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def call_seconds(self, num_prompts: np.ndarray, new_tokens: np.ndarray) -> np.ndarray:
        """Predicted latency of verification calls ([n] prompts and new tokens)."""
        per_call, per_prompt, per_token = self._coefficients()
        return per_call + per_prompt * num_prompts + per_token * new_tokens

    def plain_seconds(self, num_tokens: int) -> float | None:
        """Predicted time for a plain stream of `num_tokens`; None before one was seen."""
        if self._token_s is None:
            return None
        first = self._first_token_s if self._first_token_s is not None else self._token_s
        return first + (num_tokens - 1) * self._token_s

    def snapshot(self) -> CostSnapshot:
        per_call, per_prompt, per_token = (float(v) for v in self._coefficients())
        return CostSnapshot(
            per_call_s=per_call,
            per_prompt_s=per_prompt,
            per_token_s=per_token,
            num_calls=self._num_calls,
            plain_first_token_s=self._first_token_s,
            plain_token_s=self._token_s,
            num_plain_tokens=self._num_plain_tokens,
            round_overhead_s=self._overhead_s,
            prediction_ratio=self.prediction_ratio(),
        )


def _nonnegative_ridge(rows: np.ndarray) -> np.ndarray:
    """Least squares of rows [n, 4] = (1, prompts, tokens, seconds) for the three
    coefficients, none negative (a negative cost is refitted without that term), with
    the columns scaled to unit RMS and a small ridge."""
    x, y = rows[:, :3], rows[:, 3]
    theta = np.zeros(3)
    active = [0, 1, 2]
    while active:
        cols = x[:, active]
        scale = np.sqrt(np.mean(cols**2, axis=0))
        scale[scale == 0] = 1.0
        design = np.vstack([cols / scale, np.sqrt(_RIDGE * len(y)) * np.eye(len(active))])
        target = np.concatenate([y, np.zeros(len(active))])
        solved = np.linalg.lstsq(design, target, rcond=None)[0] / scale
        if (solved >= 0).all():
            theta[active] = solved
            break
        active = [idx for idx, value in zip(active, solved, strict=True) if value >= 0]
    return theta


def _ewma(mean: float | None, value: float, weight: float = _EWMA) -> float:
    return value if mean is None else (1 - weight) * mean + weight * value
