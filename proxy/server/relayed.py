"""A handed-over request's answer on its way to the client (`proxy.decoding.HandOver`):
vLLM's own server-sent events for the client's own request, relayed as they come.

The request went to vLLM with `return_token_ids`, so each event names its tokens: they
are counted and collected without parsing the event (the loop records the stretch
and, if the answer breaks, goes on from them), and the arrays are set to null as vLLM
writes them when the client did not ask for them. What is parsed: the last event (its
finish reason), the usage event (it goes out with the proxy's statistics), and the
events of an answer that broke (their text, to go on from).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from typing import Any, AsyncIterator, Callable

import httpx

from proxy.decoding import Relayed

# `token_ids":` appears in JSON only where a key ends (inside a string every quote is
# escaped, and the `s` is no backslash); the key is `token_ids` or `prompt_token_ids`
# where its opening quote comes right after the `{` or `,` before every key (a key
# such as `say "token_ids` has an escaped quote there). Each holds an array or null.
_KEY_END = b'token_ids":'
_ARRAY = re.compile(rb"\s*(\[[0-9,\s]*\])")
_DONE = b"data: [DONE]"
# The usage event (include_usage) is the one whose choices are empty: a key at its top.
_USAGE = b'"choices":[],'


def split_token_ids(raw: bytes, keep: bool = False) -> tuple[bytes, list[int]]:
    """(`raw` -- an answer of vLLM's or one event -- with each `token_ids` and
    `prompt_token_ids` array null, as vLLM writes it without `return_token_ids`, every
    other byte unchanged (with `keep`: `raw` itself); the output ids, the `token_ids`
    arrays' in order). Found without parsing: parsing and writing it again would change
    bytes (Python writes vLLM's -0.000012345 as -1.2345e-05), and costs more."""
    pieces, ids, end = [], [], 0
    at = raw.find(_KEY_END)
    while at >= 0:
        after = at + len(_KEY_END)
        output = _opens_key(raw, at - 1)
        prompt = not output and _opens_key(raw, at - 8, b'"prompt_')
        array = _ARRAY.match(raw, after) if output or prompt else None
        if array is not None:
            if output:
                ids += [int(token) for token in array.group(1)[1:-1].split(b",") if token.strip()]
            if not keep:
                pieces += [raw[end : array.start(1)], b"null"]
                end = array.end(1)
        at = raw.find(_KEY_END, after)
    if not pieces:
        return raw, ids
    pieces.append(raw[end:])
    return b"".join(pieces), ids


def _opens_key(raw: bytes, at: int, start: bytes = b'"') -> bool:
    """Does a key open at `at` with `start`: right after a `{` or `,` (and white space)?"""
    if at < 1 or raw[at : at + len(start)] != start:
        return False
    before = at - 1
    while before > 0 and raw[before] in b" \t\r\n":
        before -= 1
    return raw[before] in b"{,"


class RelayedAnswer:
    """vLLM's streaming answer to a handed-over request (status 200, headers read)."""

    def __init__(
        self,
        response: httpx.Response,
        handed_at: float,
        keep_ids: bool,
        on_tokens: Callable[[int], None] | None = None,
    ) -> None:
        self.response = response
        self.handed_at = handed_at  # time.perf_counter() of the hand-over
        self.keep_ids = keep_ids  # the client asked for token ids itself
        self.on_tokens = on_tokens  # each event's token count, as it goes out
        self.tokens: list[int] = []
        self.first: tuple[int, float] | None = None
        self.last = handed_at
        self.events: list[bytes] = []  # the data events sent, as sent
        # Held back for the caller to send: the usage event (it gets the proxy's
        # statistics) and [DONE] (after it).
        self.usage: dict[str, Any] | None = None
        self.done = False  # [DONE] came
        self._expired: asyncio.Task | None = None  # closing the answer at the deadline

    async def relay(self, deadline: float) -> AsyncIterator[bytes]:
        """The events as they come (but the usage event and [DONE]), until the answer
        ends or breaks (an upstream error or an end before [DONE]: `outcome` says how far
        it came). After [DONE] the body is read to its end (the chunked terminator, sent
        with it), so that the connection goes back to the pool: one closed unread is
        dropped, and the next request would pay a new one on both hosts. TimeoutError
        past `deadline` (loop time), even while vLLM sends nothing: the answer is closed
        then (vLLM aborts it), which ends the read that waits."""
        pending = b""
        # One timer for the answer (a timeout scope per chunk costs ~6 us each).
        timer = asyncio.get_running_loop().call_at(deadline, self._expire)
        try:
            async for chunk in self.response.stream:  # type: ignore[union-attr]  # as read
                if self.done:
                    continue
                *events, pending = (pending + chunk).split(b"\n\n")
                out = b"".join([self._event(event) for event in events])
                if out:
                    yield out
        except httpx.HTTPError:
            pass  # it broke -- or the deadline closed it
        finally:
            timer.cancel()
        if self._expired is not None and not self.done:
            raise TimeoutError

    def _expire(self) -> None:
        self._expired = asyncio.ensure_future(self.response.aclose())

    def _event(self, event: bytes) -> bytes:
        if event == _DONE:
            self.done = True
            return b""
        if event.startswith(b"data: {"):
            if _USAGE in event:
                self.usage = json.loads(event[len(b"data: ") :])
                return b""
            event, ids = split_token_ids(event, self.keep_ids)
            self.events.append(event)
            if ids:
                self.last = time.perf_counter()
                if self.first is None:
                    self.first = len(ids), self.last - self.handed_at
                self.tokens += ids
                if self.on_tokens is not None:
                    self.on_tokens(len(ids))
        return event + b"\n\n"

    def outcome(self) -> Relayed:
        """What came: whole (a finish reason sent, [DONE] or not), or where it broke and
        the text the client has (read from the events sent; ValueError if one cannot
        be read, or says vLLM failed)."""
        finish = None
        if self.events:
            with contextlib.suppress(ValueError):
                finish = _finish_reason(_data(self.events[-1]))
        if finish is not None or self.done:
            return Relayed(self.tokens, self.last - self.handed_at, self.first, True, finish)
        text = "".join(_text(_data(event)) for event in self.events)
        return Relayed(self.tokens, self.last - self.handed_at, self.first, False, None, text)

    def names(self) -> tuple[str, int] | None:
        """(id, created) of vLLM's events sent, None if none was: a stream that goes on
        from them keeps their names."""
        if not self.events:
            return None
        with contextlib.suppress(ValueError, KeyError, TypeError):
            data = _data(self.events[0])
            return str(data["id"]), int(data["created"])
        return None

    async def aclose(self) -> None:
        if self._expired is not None:
            await self._expired
        await self.response.aclose()  # vLLM aborts a request whose answer is closed unread


def _data(event: bytes) -> dict[str, Any]:
    data = json.loads(event[len(b"data: ") :])
    if not isinstance(data, dict) or "error" in data:
        raise ValueError(f"vLLM's event is not an answer: {event[:300]!r}")
    return data


def _finish_reason(data: dict[str, Any]) -> str | None:
    for choice in data.get("choices") or ():
        if choice.get("finish_reason") is not None:
            return choice["finish_reason"]
    return None


def _text(data: dict[str, Any]) -> str:
    """A completion event's text or a chat event's content."""
    text = ""
    for choice in data.get("choices") or ():
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text
