"""Admission control: at most `max_active` generations at once and `max_queue` more
waiting for a slot; beyond that a request is refused at once with 429 and Retry-After,
so a burst costs a bounded amount of memory instead of an unbounded queue."""

from __future__ import annotations

import asyncio
from typing import Callable

from proxy.server.errors import RequestError
from proxy.server.metrics import ServerMetrics


class Admission:
    def __init__(self, max_active: int, max_queue: int, metrics: ServerMetrics):
        self.max_active = max_active
        self.max_queue = max_queue
        self.metrics = metrics
        self._slots = asyncio.Semaphore(max_active)
        self._num_waiting = 0

    async def acquire(self, deadline: float) -> Callable[[], None]:
        """Wait for a slot (until `deadline`: TimeoutError); returns its idempotent release."""
        if self._slots.locked() and self._num_waiting >= self.max_queue:
            self.metrics.rejected.labels("queue_full").inc()
            raise RequestError(
                f"server busy: {self.max_active} requests running and {self._num_waiting} "
                "waiting (server settings max_active, max_queue); retry later",
                status=429,
                err_type="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        self._num_waiting += 1
        self.metrics.queued.inc()
        try:
            async with asyncio.timeout_at(deadline):
                await self._slots.acquire()
        finally:
            self._num_waiting -= 1
            self.metrics.queued.dec()
        self.metrics.active.inc()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._slots.release()
                self.metrics.active.dec()

        return release
