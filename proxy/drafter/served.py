"""A draft model served by a second, unmodified vLLM: `--drafter vllm:URL[,OPTION=VALUE...]`.

Each round asks the draft server for the greedy continuation of the committed tokens
with the top-k log-probs at every position (`proxy.drafter.vllm_client`: one
/v1/completions call, token-id prompt, `temperature: 0`, `logprobs: k`). Those are the
per-depth distributions an in-process autoregressive drafter computes (log-softmax over
the full vocabulary, top-k per depth along its own greedy path), so on the same model
files both propose the same drafts. Drafting is greedy whatever the request samples
with; verification decides what is committed, so the output does not depend on it.

Options (after the URL, comma-separated):

* ``model=NAME``: the served draft model (default: the server's first);
* ``top_k=N``: most log-probs asked per position (default 20, vLLM's default
  ``--max-logprobs``); a larger tree budget is clamped to it, ranks beyond carry -inf.
  Start the draft server with ``--max-logprobs N`` to raise it;
* ``overlap=1``: while a round's tree is verified, draft the next round from the root
  it will have if the target accepts the whole greedy path and its bonus token is the
  draft model's next greedy token (the call drafts one position more to know it). On
  a hit the next round waits for no call; a miss wastes one draft-server call. Off by
  default (0): then every round makes exactly one call;
* ``timeout=S``: seconds a draft call may take (default 2.0).

Failures are the drafter's, never the request's: a call that fails or times out raises
`DraftError`, the round goes on without a draft (one step of plain decoding), and the
drafter backs off (0.5 s, doubling to 10 s) before it tries the server again. /health
and /metrics report calls, failures and the back-off state.

At start-up (`connect`) the draft server must tokenize like the target (probe texts
through both servers' /tokenize, and a sweep of ids through both /detokenize) and accept
``logprobs=top_k``; otherwise the proxy refuses to start, naming the problem.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from proxy.backend.base import TargetError
from proxy.drafter.base import DraftError, TargetInfo
from proxy.drafter.vllm_client import GreedyDraft, VLLMDraftServer
from proxy.tree import DraftDistribution

if TYPE_CHECKING:
    import torch

    from proxy.tokens import Tokens

DEFAULT_TOP_K = 20  # vLLM's default --max-logprobs
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
# Texts both servers must tokenize alike: code, prose, unicode, whitespace runs.
TOKENIZER_PROBES = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "The quick brown fox jumps over the lazy dog. 1234567890",
    "naïve café — 漢字 😀 \t\t  \n\n",
    "<|endoftext|><|im_start|>user\nhi<|im_end|>",
)
MAX_SWEEP_IDS = 4096  # ids detokenized by both servers at start-up


@dataclass(frozen=True)
class ServedOptions:
    url: str
    model: str | None = None
    top_k: int = DEFAULT_TOP_K
    overlap: int = 0  # 1: draft the next round during this round's verification
    timeout_s: float = 2.0

    @classmethod
    def parse(cls, spec: str | None) -> ServedOptions:
        """'URL[,model=NAME][,top_k=N][,overlap=0|1][,timeout=S]'."""
        if not spec:
            raise ValueError(
                "the vllm drafter needs the draft server's URL: --drafter vllm:http://HOST:PORT"
            )
        url, *options = spec.split(",")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"vllm drafter URL must start with http:// or https://, got {url!r}")
        values: dict[str, Any] = {"url": url.rstrip("/")}
        for option in options:
            key, sep, value = option.partition("=")
            try:
                if not sep:
                    raise ValueError("expected KEY=VALUE")
                if key == "model":
                    values["model"] = value
                elif key in ("top_k", "overlap"):
                    values[key] = int(value)
                elif key == "timeout":
                    values["timeout_s"] = float(value)
                else:
                    raise ValueError("valid options: model, top_k, overlap, timeout")
            except ValueError as exc:
                raise ValueError(f"bad vllm drafter option {option!r}: {exc}") from None
        parsed = cls(**values)
        if parsed.top_k < 1 or parsed.overlap not in (0, 1) or parsed.timeout_s <= 0:
            raise ValueError(f"vllm drafter needs top_k >= 1, overlap 0 or 1, timeout > 0: {spec}")
        return parsed


class ServedSession:
    """One request's drafts: one call per round, or none when an overlapped call made
    during the previous round's verification guessed this round's root."""

    def __init__(self, drafter: ServedDrafter):
        self.drafter = drafter
        self.draft_calls = 0  # calls this request made to the draft server
        self.prefetch_hits = 0  # rounds served by an overlapped call
        self._prefetch: tuple[list[int], asyncio.Task[GreedyDraft]] | None = None

    async def propose(self, committed: Sequence[int], depth: int, top_k: int) -> DraftDistribution:
        committed = [int(t) for t in committed]
        drafter = self.drafter
        asked_k = min(top_k, drafter.options.top_k)
        got = await self._take_prefetch(committed, depth, asked_k)
        if got is None:
            room = drafter.server_max_len - len(committed)
            if room < 1:
                drafter.failures["context"] += 1
                raise DraftError("context is as long as the draft model's max_model_len", "context")
            drafter.check_available()
            # With overlap, one position more: the draft model's guess of the bonus token.
            num_positions = min(depth + drafter.options.overlap, room)
            self.draft_calls += 1
            got = await drafter.call(committed, num_positions, asked_k)
        else:
            self.prefetch_hits += 1
        if drafter.options.overlap and got.greedy.shape[0] > depth:
            self._start_prefetch(committed + got.greedy[: depth + 1].tolist(), depth, asked_k)
        return self._rows(got, depth, top_k)

    def _start_prefetch(self, prompt: list[int], depth: int, top_k: int) -> None:
        """Draft from the root the next round has if the target accepts the whole greedy
        path and its bonus token is the draft model's guess -- while this round's tree is
        verified. A miss costs the draft server one call, not the request any time."""
        room = self.drafter.server_max_len - len(prompt)
        if room < 1 or self.drafter.backing_off:
            return
        self.draft_calls += 1
        task = asyncio.get_running_loop().create_task(
            self.drafter.call(prompt, min(depth + 1, room), top_k, count_failure=False)
        )
        self.drafter.keep(task)
        self._prefetch = (prompt, task)

    async def _take_prefetch(
        self, committed: list[int], depth: int, top_k: int
    ) -> GreedyDraft | None:
        if self._prefetch is None:
            return None
        prompt, task = self._prefetch
        self._prefetch = None
        if prompt != committed:
            task.cancel()  # the guess missed: its answer is of no use
            return None
        try:
            got = await task
        except DraftError:
            return None  # a fresh call decides whether the server is really down
        if got.greedy.shape[0] < depth or got.token_ids.shape[1] < top_k:
            return None
        return got

    def _rows(self, got: GreedyDraft, depth: int, top_k: int) -> DraftDistribution:
        """The call's first `depth` positions as a [depth, top_k] distribution; ranks and
        depths it did not cover carry -inf, as do ids beyond the target's vocabulary (a
        draft model may pad its vocabulary)."""
        token_ids = np.zeros((depth, top_k), dtype=np.int64)
        log_probs = np.full((depth, top_k), -np.inf)
        rows = min(depth, got.greedy.shape[0])
        cols = min(top_k, got.token_ids.shape[1])
        token_ids[:rows, :cols] = got.token_ids[:rows, :cols]
        log_probs[:rows, :cols] = got.log_probs[:rows, :cols]
        log_probs[token_ids >= self.drafter.target_vocab_size] = -np.inf
        return DraftDistribution(token_ids=token_ids, log_probs=log_probs)

    def advance(self, committed: Sequence[int], target_features: torch.Tensor | None) -> None:
        return None


class ServedDrafter:
    """The draft server, shared by every request; it holds the back-off state and the
    process-wide counters."""

    name = "vllm"
    max_depth: int | None = None
    target_layer_ids: tuple[int, ...] | None = None

    def __init__(self, options: ServedOptions, target_vocab_size: int):
        self.options = options
        self.target_vocab_size = target_vocab_size
        self.server: VLLMDraftServer | None = None
        self.calls = 0
        self.failures: Counter[str] = Counter()
        self.last_error: str | None = None
        self._failures_in_row = 0
        self._retry_at = 0.0  # time.monotonic() before which no call is made
        self._background: set[asyncio.Task] = set()  # overlapped calls in flight

    @classmethod
    def load(cls, path: str | None, target: TargetInfo) -> ServedDrafter:
        return cls(ServedOptions.parse(path), target.vocab_size)

    @property
    def server_max_len(self) -> int:
        assert self.server is not None, "connect() the vllm drafter before drafting"
        return self.server.max_model_len

    async def connect(self, target_tokens: Tokens) -> None:
        """Reach the draft server and check it against the target; ValueError if it
        tokenizes differently or refuses logprobs=top_k."""
        options = self.options
        try:
            server = await VLLMDraftServer.connect(
                options.url, options.model, timeout_s=options.timeout_s
            )
        except TargetError as exc:
            raise ValueError(f"cannot reach the draft vLLM at {options.url}: {exc}") from exc
        try:
            await _check_same_tokenizer(server, target_tokens, self.target_vocab_size)
            try:
                await server.greedy_topk([0], 1, options.top_k, timeout_s=30.0)
            except TargetError as exc:
                if exc.kind != "http":
                    raise ValueError(f"the draft vLLM at {options.url} failed: {exc}") from exc
                raise ValueError(
                    f"the draft vLLM at {options.url} refuses logprobs={options.top_k} ({exc}); "
                    f"start it with --max-logprobs {options.top_k} or higher, or pass "
                    "top_k=N in --drafter vllm:URL,top_k=N"
                ) from exc
        except BaseException:
            await server.aclose()
            raise
        self.server = server

    def check_available(self) -> None:
        """DraftError("unavailable") while backing off after failures."""
        wait = self._retry_at - time.monotonic()
        if wait > 0:
            self.failures["unavailable"] += 1
            raise DraftError(
                f"draft server backing off for {wait:.2f} s after: {self.last_error}", "unavailable"
            )

    @property
    def backing_off(self) -> bool:
        return self._retry_at > time.monotonic()

    def keep(self, task: asyncio.Task) -> None:
        """Hold an overlapped call until it ends (the loop keeps only weak references);
        its outcome is read, so a failure never surfaces as an unretrieved exception."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda done: done.cancelled() or done.exception())

    async def call(
        self, prompt: list[int], num_positions: int, top_k: int, count_failure: bool = True
    ) -> GreedyDraft:
        """One draft call. A failure raises DraftError and starts the back-off;
        count_failure=False (an overlapped call) leaves it out of the rounds-without-draft
        count, since no round waited for it."""
        assert self.server is not None, "connect() the vllm drafter before drafting"
        self.calls += 1
        try:
            got = await self.server.greedy_topk(prompt, num_positions, top_k)
        except TargetError as exc:
            if count_failure:
                self.failures[exc.kind] += 1
            self.last_error = str(exc)[:300]
            self._failures_in_row += 1
            backoff = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (self._failures_in_row - 1))
            self._retry_at = time.monotonic() + backoff
            raise DraftError(str(exc), exc.kind) from exc
        self._failures_in_row = 0
        return got

    def counters(self) -> dict[str, Any]:
        """calls: draft calls made; failures: rounds that went on without a draft, by
        cause (a failed call's kind, "unavailable" while backing off, "context")."""
        return {"calls": self.calls, "failures": dict(self.failures)}

    async def health(self) -> dict[str, Any]:
        server_ok, details = await self.server.health() if self.server is not None else (False, {})
        backing_off = self.backing_off
        return {
            "kind": self.name,
            "url": self.options.url,
            "model": self.server.model if self.server is not None else None,
            "status": "ok" if server_ok and not backing_off else "degraded",
            "server": details,
            "calls": self.calls,
            "failures": dict(self.failures),
            "last_error": self.last_error,
        }

    def start(
        self, prompt_ids: Sequence[int], prompt_features: torch.Tensor | None
    ) -> ServedSession:
        return ServedSession(self)

    async def aclose(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self.server is not None:
            await self.server.aclose()
            self.server = None


async def _check_same_tokenizer(
    server: VLLMDraftServer, target_tokens: Tokens, target_vocab_size: int
) -> None:
    """ValueError unless the draft server tokenizes and detokenizes like the target."""
    where = f"the draft vLLM at {server.http.base_url} ({server.model})"
    for text in TOKENIZER_PROBES:
        want = await target_tokens.encode(text, add_special_tokens=False)
        got = await server.tokens.encode(text, add_special_tokens=False)
        if got != want:
            raise ValueError(
                f"{where} tokenizes differently from the target ({text!r:.40}: {got[:8]} vs "
                f"{want[:8]}): the drafter must share the target's tokenizer"
            )
    vocab = min(target_vocab_size, 2**20)  # unknown target vocab: the probes' ids only
    step = max(1, vocab // MAX_SWEEP_IDS)
    sweep = list(range(0, vocab, step)) if target_vocab_size < 2**31 - 1 else []
    if sweep:
        try:
            got_text = await server.tokens.decode(sweep, skip_special_tokens=False)
        except TargetError as exc:
            raise ValueError(
                f"{where} cannot detokenize the target's token ids ({exc}): the drafter must "
                "share the target's tokenizer"
            ) from exc
        want_text = await target_tokens.decode(sweep, skip_special_tokens=False)
        if got_text != want_text:
            raise ValueError(
                f"{where} detokenizes the target's token ids differently: the drafter must "
                "share the target's tokenizer"
            )
