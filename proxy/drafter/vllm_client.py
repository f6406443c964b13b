"""Draft proposals from a second, unmodified vLLM serving a small draft model.

One ``/v1/completions`` call per draft: the committed tokens as a token-id prompt,
``max_tokens = M``, greedy (``temperature: 0``), ``logprobs: k`` with
``return_tokens_as_token_ids`` (top-k entries come back keyed ``"token_id:123"``),
``ignore_eos``. The answer holds, at each of the M positions along the draft model's
greedy path, its top-k log-probs -- by default vLLM's raw log-softmax over the full
vocabulary before any sampling transform (``--logprobs-mode raw_logprobs``), which is
what an in-process autoregressive drafter computes. The draft server's prefix cache
keeps the shared context between rounds, its own batching serves concurrent requests.

vLLM refuses ``logprobs`` above its ``--max-logprobs`` (default 20): start the draft
server with at least the largest tree budget, or let the drafter clamp top-k.

This module only talks HTTP; what a failure means for a round is the drafter's
business (`proxy.drafter.served`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Sequence

import httpx
import numpy as np

from proxy.backend.base import TargetError
from proxy.backend.vllm import RetryPolicy, VLLMHttp, max_model_len_of
from proxy.backend.vllm_tokens import VLLMTokens

TOKEN_ID_PREFIX = "token_id:"  # how vLLM names a token with return_tokens_as_token_ids
VLLM_NEG_INF = -9999.0  # vLLM writes -inf log-probs as this (JSON has no -inf)


@dataclass(frozen=True)
class GreedyDraft:
    """The draft model's greedy continuation of a prompt, with its top-k per position.

    Row m is the distribution after ``prompt + greedy[:m]``.
    """

    greedy: np.ndarray  # [M] int64: the token the draft model chose at each position
    token_ids: np.ndarray  # [M, k] int64: top-k ids, best first
    log_probs: np.ndarray  # [M, k] float64: their log-probs; -inf where vLLM gave fewer


class VLLMDraftServer:
    """A vLLM server serving the draft model. Build with `await VLLMDraftServer.connect()`."""

    def __init__(
        self, http: VLLMHttp, model: str, max_model_len: int, timeout_s: float = 2.0
    ) -> None:
        self.http = http
        self.model = model
        self.max_model_len = max_model_len
        self.timeout_s = timeout_s  # a draft call's deadline (start-up calls get longer)
        self.tokens = VLLMTokens(http, model)

    @classmethod
    async def connect(
        cls,
        url: str,
        model: str | None = None,
        *,
        timeout_s: float = 2.0,
        startup_timeout_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> VLLMDraftServer:
        """Read the served model and its max_model_len from /v1/models. No retries on
        draft calls: by the time a retry answered, the round is better off without it.
        timeout_s bounds each draft call; startup_timeout_s every other call."""
        http = VLLMHttp(
            url,
            # Draft calls are bounded by asyncio.timeout(timeout_s) in greedy_topk.
            connect_timeout=min(startup_timeout_s, 5.0),
            read_timeout=startup_timeout_s,
            retry=RetryPolicy(max_retries=0),
            transport=transport,
        )
        try:
            entries = await http.served_models()
            model = model or next(iter(entries))
            if model not in entries:
                raise ValueError(
                    f"draft model {model!r} not served at {url}; served: {list(entries)}"
                )
            return cls(http, model, max_model_len_of(entries[model], url), timeout_s)
        except BaseException:
            await http.aclose()
            raise

    async def greedy_topk(
        self, prompt: Sequence[int], max_tokens: int, top_k: int, timeout_s: float | None = None
    ) -> GreedyDraft:
        """One call: `max_tokens` greedy tokens after `prompt`, top-`top_k` at each,
        within `timeout_s` (default: the drafting deadline)."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": [int(t) for t in prompt],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            # Neutral values override the server's generation_config defaults: the
            # greedy path must be the model's own argmax chain.
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "ignore_eos": True,
            "logprobs": top_k,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        deadline = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(deadline):
                answer = await self.http.request_json("POST", "/v1/completions", body, retry=False)
        except TimeoutError as exc:
            raise TargetError(
                f"draft vLLM {self.http.base_url}: no answer within {deadline:g} s", "timeout"
            ) from exc
        return parse_greedy_draft(answer, max_tokens, top_k)

    async def health(self) -> tuple[bool, dict[str, Any]]:
        return await self.http.health()

    async def aclose(self) -> None:
        await self.http.aclose()


def parse_greedy_draft(answer: Any, max_tokens: int, top_k: int) -> GreedyDraft:
    """The draft from a /v1/completions answer; TargetError if it does not fit."""
    try:
        (choice,) = answer["choices"]
        greedy = [int(t) for t in choice["token_ids"]]
        top_logprobs = choice["logprobs"]["top_logprobs"]
        if len(greedy) != max_tokens or len(top_logprobs) != max_tokens:
            raise TargetError(
                f"draft vLLM returned {len(greedy)} tokens / {len(top_logprobs)} logprob "
                f"entries for max_tokens={max_tokens}"
            )
        token_ids = np.zeros((max_tokens, top_k), dtype=np.int64)
        log_probs = np.full((max_tokens, top_k), -np.inf)
        for position, entries in enumerate(top_logprobs):
            # vLLM lists the chosen token first, then the top-k; sort by log-prob (the
            # chosen greedy token is the top-1, so it appears once).
            ranked = sorted(
                ((_token_id(name), float(logprob)) for name, logprob in entries.items()),
                key=lambda item: -item[1],
            )[:top_k]
            for rank, (token_id, logprob) in enumerate(ranked):
                token_ids[position, rank] = token_id
                log_probs[position, rank] = -np.inf if logprob <= VLLM_NEG_INF else logprob
    except TargetError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise TargetError(
            f"unexpected draft /v1/completions answer ({type(exc).__name__}: {exc}): "
            f"{answer!r:.300}"
        ) from exc
    return GreedyDraft(
        greedy=np.asarray(greedy, dtype=np.int64), token_ids=token_ids, log_probs=log_probs
    )


def _token_id(name: str) -> int:
    if not name.startswith(TOKEN_ID_PREFIX):
        raise ValueError(f"top-logprob key {name!r} is not {TOKEN_ID_PREFIX}N")
    return int(name[len(TOKEN_ID_PREFIX) :])
