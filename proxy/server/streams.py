"""The proxy's streaming responses: each chunk its body yields is written as it comes,
and a client that goes away ends the stream.

Starlette's StreamingResponse does the same with an anyio task group per response
(one task writes, one waits for the disconnect). A stream here is written by the
request's own task, and one plain asyncio task waits for the disconnect and cancels
it. With streams to vLLM opened on the HTTP client's transport directly, a fifth less
of the proxy's CPU per pass-through request (2.5 -> 2.0 ms against a scripted upstream),
on vLLM-CPU's 2-core hosts where every cycle the proxy spends is taken from the engine
(docs/PERFORMANCE.md, "One hop, and what the proxy adds to it").
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class EventStream(Response):
    """A streaming response. `body_iterator` may be replaced (wrapped) before it is
    sent; `on_chunk` (one, set before it is sent) sees each chunk before it goes out,
    and must not raise; each of `on_close` is called with whether the body ran to its
    end when the response is done with, however it ends (finished, failed, client gone):
    an admitted stream holds its slot until then, the A/B clock stops then. (Callbacks,
    not wrapping generators: each layer of those costs microseconds a chunk, and a
    chunk is a token.) A client that disconnects cancels the body where it waits (its
    `finally` blocks run: a relayed answer is closed, and vLLM aborts it)."""

    on_chunk: Callable[[bytes], None] | None = None

    def __init__(
        self,
        content: AsyncIterator[bytes],
        status_code: int = 200,
        media_type: str | None = None,
    ) -> None:
        self.body_iterator = content
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self.on_close: list[Callable[[bool], None]] = []
        self.init_headers(None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def listen() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        listener = asyncio.ensure_future(listen())
        complete = False
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code,
                 "headers": self.raw_headers}
            )  # fmt: skip
            on_chunk = self.on_chunk
            async for chunk in self.body_iterator:
                if on_chunk is not None:
                    on_chunk(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            complete = True
            # Sent before the listener can run (the server's answer to `receive` after
            # the response is complete is a disconnect too): it is cancelled below.
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone or task.uncancel() > 0:
                raise
        except OSError:  # ASGI 2.4 servers raise it from `send` once the client is gone
            pass
        finally:
            listener.cancel()
            try:
                # A body the client left at a `yield` is closed here (its `finally` runs).
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                for call in self.on_close:
                    call(complete)
