"""The engine threads: all model work runs here, never on the gRPC event loop.

At most `max_concurrent` generations run at once (default 1: one CPU-bound decode at a time is
the fastest on a small machine); further jobs wait in FIFO order. Per-session ordering (one
Generate per session at a time) is the service's job, not the scheduler's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class Scheduler:
    def __init__(self, max_concurrent: int = 1) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.max_concurrent = max_concurrent
        self._pool = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="kakeya-engine")
        self._lock = threading.Lock()
        self._queued = 0
        self._running = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        with self._lock:
            self._queued += 1

        def run() -> Any:
            with self._lock:
                self._queued -= 1
                self._running += 1
            try:
                return fn(*args)
            finally:
                with self._lock:
                    self._running -= 1

        return self._pool.submit(run)

    @property
    def running(self) -> int:
        return self._running

    @property
    def queued(self) -> int:
        return self._queued

    def shutdown(self, *, wait: bool = True) -> None:
        # Queued jobs are dropped (their callers see UNAVAILABLE); running ones finish their step.
        self._pool.shutdown(wait=wait, cancel_futures=True)
