"""From committed tokens to what a client sees: the output processor.

It owns every output rule, for the CLI, the server and the benchmarks alike:
stop tokens (EOS unless `ignore_eos`, plus `stop_token_ids`), stop strings, the
max_tokens cut, incremental detokenization, U+FFFD hold-back, logprob trimming and
the stop reason. The decoding loop hands it each round's tokens; it returns the
`Delta` to send.

Incremental detokenization decodes only a short window of the latest tokens per
round (the technique of vLLM's and TGI's detokenizers): with `prefix` =
decode(tokens[p:r]) and `window` = decode(tokens[p:]), the new text is
window[len(prefix):]. It is taken only when the window does not end in U+FFFD (an
unfinished UTF-8 sequence that a later token may complete), so r always sits where
the text is final, and the emitted text equals the decode of all tokens. The window
is re-anchored every few dozen tokens, so the work per round stays bounded and a
whole output costs time linear in its length -- except where each decode is a call to
a server (`window_tokens=None`): one call per round, the whole output each time, beats
a second call to re-anchor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, Literal

from proxy.backend.base import TargetError

if TYPE_CHECKING:
    from proxy.decoding import HandOver
    from proxy.round import RoundStats

Detokenize = Callable[[list[int]], Awaitable[str]]

REPLACEMENT = "\ufffd"
# Re-anchor the detokenization window once it spans this many tokens, keeping a few
# tokens of left context (tokenizers that drop a leading space at the start of a
# decode need one token before the new ones).
WINDOW_TOKENS = 48
_CONTEXT_TOKENS = 4

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Delta:
    """What one round adds to the output (possibly nothing, while text is held back)."""

    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    finish_reason: FinishReason | None = None
    # vLLM's stop_reason: the stop_token_id or stop string that ended the output; None
    # for EOS, the length limit, or while running.
    stop_reason: int | str | None = None
    round: RoundStats | None = None  # the round that produced it
    # The rest of the request is handed over: the server relays it (`HandOver`); no tokens.
    hand_over: HandOver | None = None
    # Tokens that went out in a relayed answer (counted, not sent again).
    relayed: bool = False


class IncrementalDetokenizer:
    """Text of a growing token list, decoding a bounded window per step (`window_tokens`;
    None: the whole list, never re-anchored)."""

    def __init__(self, detokenize: Detokenize, window_tokens: int | None = WINDOW_TOKENS):
        self.detokenize = detokenize
        self.window_tokens = window_tokens
        self.tokens: list[int] = []
        self.text = ""  # final text of tokens[:read]
        self._prefix_offset = 0  # p: where the window starts
        self._read_offset = 0  # r: tokens whose text is in self.text
        self._prefix_text = ""  # decode(tokens[p:r])

    async def pending(self, upto: int | None = None) -> str:
        """Text of tokens[read:upto] on top of self.text (may end in U+FFFD)."""
        if (len(self.tokens) if upto is None else upto) == self._read_offset:
            return ""
        window = await self.detokenize(self.tokens[self._prefix_offset : upto])
        return window[len(self._prefix_text) :]

    async def commit(self, new_text: str) -> None:
        """Take `new_text` (= `pending()`) as the final text of every token so far."""
        self.text += new_text
        self._prefix_text += new_text
        self._read_offset = len(self.tokens)
        window = self.window_tokens
        if window is not None and self._read_offset - self._prefix_offset > window:
            self._prefix_offset = self._read_offset - _CONTEXT_TOKENS
            self._prefix_text = await self.detokenize(
                self.tokens[self._prefix_offset : self._read_offset]
            )


class OutputProcessor:
    """One request's output: feed it each round's tokens with `add`."""

    def __init__(
        self,
        detokenize: Detokenize,
        max_tokens: int,
        stop_token_ids: tuple[int, ...] = (),
        eos_token_ids: tuple[int, ...] = (),
        ignore_eos: bool = False,
        stop: tuple[str, ...] = (),
        logprobs: bool = False,
        window_tokens: int | None = WINDOW_TOKENS,
    ):
        self.max_tokens = max_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.stop_tokens = self.stop_token_ids | (frozenset() if ignore_eos else set(eos_token_ids))
        self.stop = stop
        # Text that a later token could still turn into a stop string is held back.
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.want_logprobs = logprobs
        self.num_tokens = 0  # tokens emitted so far (a stop token included)
        self.finish_reason: FinishReason | None = None
        self._detok = IncrementalDetokenizer(detokenize, window_tokens)
        self._emitted_text = ""

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.num_tokens

    async def add(
        self,
        tokens: list[int],
        logprobs: list[float] | None = None,
        at_context_limit: bool = False,
        stats: RoundStats | None = None,
    ) -> Delta:
        """Take one round's tokens (and their log-probs); `at_context_limit`: the target
        has no room for another token."""
        assert self.finish_reason is None, "the output has already finished"
        detok = self._detok
        num_text_before = len(detok.tokens)
        kept: list[int] = []
        finish: FinishReason | None = None
        stop_reason: int | str | None = None
        for token in tokens:
            kept.append(token)
            if token in self.stop_tokens:
                finish = "stop"
                stop_reason = token if token in self.stop_token_ids else None
                break
            detok.tokens.append(token)
            if self.num_tokens + len(kept) >= self.max_tokens:
                finish = "length"
                break
        if finish is None and at_context_limit:
            finish = "length"

        pending = await detok.pending()
        text = detok.text + pending
        if self.stop:
            found = self._find_stop(text, max(0, len(self._emitted_text) - self._hold))
            if found is not None:
                stop_at, stop_reason = found
                # Keep tokens up to the one whose text completed the stop string (a stop
                # token after it is dropped too).
                keep = await self._tokens_through_stop(num_text_before)
                kept = kept[: keep - num_text_before]
                del detok.tokens[keep:]
                text = text[:stop_at]
                finish = "stop"
        if finish is None:
            if not pending.endswith(REPLACEMENT):
                await detok.commit(pending)
            safe = len(text) - self._hold
            while safe > 0 and text[safe - 1] == REPLACEMENT:
                safe -= 1
        elif finish == "stop" and isinstance(stop_reason, str):
            safe = len(text)
        else:
            # vLLM's detokenizer holds back a trailing U+FFFD (an unfinished UTF-8
            # sequence waits for the next token), and at the end no next token comes.
            text = text.rstrip(REPLACEMENT)
            safe = len(text)
        delta_text = text[len(self._emitted_text) : max(safe, len(self._emitted_text))]
        self._emitted_text += delta_text
        self.num_tokens += len(kept)
        self.finish_reason = finish
        delta_logprobs = None
        if self.want_logprobs:
            assert logprobs is not None, "the target gave no log-probs"
            delta_logprobs = logprobs[: len(kept)]
        return Delta(
            token_ids=kept,
            text=delta_text,
            logprobs=delta_logprobs,
            finish_reason=finish,
            stop_reason=stop_reason,
            round=stats,
        )

    async def resume(self, tokens: list[int], sent_text: str, stats: RoundStats) -> Delta:
        """Take the first tokens of the output, whose text went out elsewhere (a relayed
        answer that broke: vLLM's stream, `sent_text` its text), and go on from what the
        client has. The Delta is marked `relayed`; its text is what these rules release
        beyond `sent_text` (usually none: vLLM holds back as they do). TargetError if
        `sent_text` is not the start of the tokens' text, or if the tokens end the
        output where vLLM's stream had not: the request cannot go on as vLLM's would."""
        assert self.num_tokens == 0, "resume() takes the first tokens of the output"
        delta = await self.add(tokens, None, stats=stats)
        decoded = self._detok.text + await self._detok.pending()
        if delta.finish_reason is not None or not decoded.startswith(sent_text):
            raise TargetError(
                "a relayed answer broke after text this proxy cannot go on from "
                f"({len(tokens)} tokens, {len(sent_text)} characters sent)"
            )
        released = self._emitted_text
        self._emitted_text = max(released, sent_text, key=len)
        return Delta(tokens, released[len(sent_text) :], round=stats, relayed=True)

    def _find_stop(self, text: str, start: int) -> tuple[int, str] | None:
        """(index, stop string) of the earliest stop string in text[start:] (the first
        listed one among those starting there), or None."""
        hits = [(idx, s) for s in self.stop if (idx := text.find(s, start)) >= 0]
        return min(hits, key=lambda hit: hit[0], default=None)

    async def _tokens_through_stop(self, num_text_before: int) -> int:
        """The fewest text tokens whose text holds a stop string (at least one of this
        round's tokens: earlier rounds had none)."""
        detok = self._detok
        for count in range(num_text_before + 1, len(detok.tokens)):
            if self._find_stop(detok.text + await detok.pending(count), 0) is not None:
                return count
        return len(detok.tokens)


async def logprob_token_strings(
    decode: Detokenize, strings: list[str], token_ids: list[int], context_ids: list[int]
) -> list[str]:
    """The text vLLM reports for each token of a logprobs entry.

    `strings[i]` is token_ids[i] decoded alone; `context_ids` are the tokens emitted
    before token_ids[0]. A token whose own text ends in U+FFFD (part of a UTF-8
    sequence split across byte tokens) is re-decoded after up to 4 preceding emitted
    tokens, as vLLM's LogprobsProcessor does (vllm/v1/engine/logprobs.py,
    `_verify_tokens` / `_correct_decoded_token`): the token gets the text it completes,
    or "" while the sequence is still unfinished. Example (byte tokens): "é" is
    [0xC3, 0xA9] -> strings ["\ufffd", "\ufffd"] -> reported ["", "é"].
    """
    out: list[str] = []
    emitted = list(context_ids)
    for text, token_id in zip(strings, token_ids, strict=True):
        if text.endswith(REPLACEMENT):
            text = await _completed_text(decode, token_id, emitted[-4:])
        out.append(text)
        emitted.append(token_id)
    return out


async def _completed_text(decode: Detokenize, token_id: int, context: list[int]) -> str:
    for num_ctx in range(1, len(context) + 1):
        window = context[-num_ctx:]
        full = await decode(window + [token_id])
        if full.endswith(REPLACEMENT):
            continue
        # Context tokens that were themselves unfinished bytes reported "": their text
        # belongs to this token.
        clean_end = len(window)
        for idx in range(len(window) - 1, -1, -1):
            if (await decode([window[idx]])).endswith(REPLACEMENT):
                clean_end = idx
            else:
                break
        prefix = await decode(window[:clean_end]) if clean_end else ""
        if full.startswith(prefix):
            return full[len(prefix) :]
        common = 0
        for a, b in zip(prefix, full, strict=False):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""
