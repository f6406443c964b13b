"""The online cost model of one target.

A verification call's latency is fitted, by recursive least squares with exponential
forgetting (recent calls weigh most, so the fit follows load), to

    seconds = per_call + per_prompt * prompts + per_token * new_tokens

where `prompts` = tree nodes + 1 (the root) and `new_tokens` = the tokens the target
has not seen before this round, summed over prompts (each prompt's share of the
context committed since the last round, plus its path). On vLLM the per-prompt term
also absorbs the recomputed tail of each prompt's last partial cache block. This is
the form the benchmark report fitted offline (33 ms + 4.3 ms per prompt + 0.14 ms per
token on the CPU rows); here it is refitted while serving.

Plain generation is described by its first-token latency (a stream's set-up: one
prefill of the uncached tail) and its inter-token latency, both exponentially
weighted means over plain streams.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

_FORGETTING = 0.97  # weight of the past per new call: ~33 calls of memory
_EWMA = 0.1


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


class CostModel:
    def __init__(self) -> None:
        self._theta = np.zeros(3)  # [per_call, per_prompt, per_token]
        self._cov = np.eye(3) * 1e2  # large: the first calls decide
        self._num_calls = 0
        self._first_token_s: float | None = None
        self._token_s: float | None = None
        self._num_plain_tokens = 0
        self._overhead_s = 0.0  # drafting + tree building per round
        self._round_rate: float | None = None  # tokens per second of recent rounds
        self._lock = threading.Lock()

    def observe_call(self, num_prompts: int, new_tokens: int, seconds: float) -> None:
        x = np.array([1.0, float(num_prompts), float(new_tokens)])
        with self._lock:
            cov_x = self._cov @ x
            gain = cov_x / (_FORGETTING + x @ cov_x)
            self._theta = self._theta + gain * (seconds - x @ self._theta)
            self._cov = (self._cov - np.outer(gain, cov_x)) / _FORGETTING
            self._num_calls += 1

    def observe_plain(self, first_token_s: float | None, token_s: list[float]) -> None:
        """One plain stream: the wait for its first token (None if it was not timed) and
        the gaps between later tokens."""
        with self._lock:
            if first_token_s is not None:
                self._first_token_s = _ewma(self._first_token_s, first_token_s)
            for gap in token_s:
                self._token_s = _ewma(self._token_s, gap)
            self._num_plain_tokens += len(token_s)

    def observe_round(self, num_tokens: int, seconds: float, overhead_s: float) -> None:
        """A whole speculative round: tokens committed, wall time, host-side overhead."""
        with self._lock:
            self._overhead_s = _ewma(self._overhead_s or None, overhead_s)
            if seconds > 0:
                self._round_rate = _ewma(self._round_rate, num_tokens / seconds)

    def round_overhead_s(self) -> float:
        return self._overhead_s

    def recent_round_rate(self) -> float:
        return self._round_rate if self._round_rate is not None else float("inf")

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def call_seconds(self, num_prompts: np.ndarray, new_tokens: np.ndarray) -> np.ndarray:
        """Predicted latency of verification calls ([n] prompts and new tokens)."""
        per_call, per_prompt, per_token = np.maximum(self._theta, 0.0)
        return per_call + per_prompt * num_prompts + per_token * new_tokens

    def plain_seconds(self, num_tokens: int) -> float | None:
        """Predicted time for a plain stream of `num_tokens`; None before one was seen."""
        if self._token_s is None:
            return None
        first = self._first_token_s if self._first_token_s is not None else self._token_s
        return first + (num_tokens - 1) * self._token_s

    def snapshot(self) -> CostSnapshot:
        per_call, per_prompt, per_token = (float(v) for v in np.maximum(self._theta, 0.0))
        return CostSnapshot(
            per_call_s=per_call,
            per_prompt_s=per_prompt,
            per_token_s=per_token,
            num_calls=self._num_calls,
            plain_first_token_s=self._first_token_s,
            plain_token_s=self._token_s,
            num_plain_tokens=self._num_plain_tokens,
            round_overhead_s=self._overhead_s,
        )


def _ewma(mean: float | None, value: float) -> float:
    return value if mean is None else (1 - _EWMA) * mean + _EWMA * value
