"""The agent's request threads: reused while requests keep coming, gone when they stop.

Starting a thread for each request cost more than the rest of the agent's work for a short
``exec`` (a fresh thread's first spawn: ~0.16 ms of a 1.4 ms ``echo``, docs/benchmarks.md).
So a thread that has served a request waits up to ``IDLE_SECONDS`` for the next one. At most
``MAX_IDLE`` wait at a time: a burst's extra threads end as soon as they are done, and an idle
sandbox keeps no thread beyond the reading one for long (every task a sandbox holds is walked
by each other sandbox's start: the scale section of docs/benchmarks.md).

``concurrent.futures.ThreadPoolExecutor`` would keep its threads for the process's life and
queue work behind a fixed number of them; requests here must never wait for one another (a
long exec must not hold back a stat), so a call with no idle thread gets a new one.
"""

from __future__ import annotations

import threading
import time

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    from collections.abc import Callable

IDLE_SECONDS = 10.0
MAX_IDLE = 4


class Threads:
    """Runs each call at once on a thread of its own: an idle one if any, else a new one.

    Invariant (under ``_ready``): ``len(_calls) <= _idle``, so every handed-over call has a
    waiting thread that will take it; a waiting thread leaves only by taking a call or, when
    none is pending, by timing out.
    """

    __slots__ = ("_calls", "_idle", "_idle_seconds", "_max_idle", "_ready", "on_idle")

    def __init__(self, *, idle_seconds: float = IDLE_SECONDS, max_idle: int = MAX_IDLE) -> None:
        self._ready = threading.Condition(threading.Lock())
        self._calls: list[tuple[Callable[..., None], tuple[object, ...]]] = []
        self._idle = 0  # threads waiting in _next
        self._idle_seconds = idle_seconds
        self._max_idle = max_idle
        # called by a thread that ends after waiting idle_seconds for a call (the agent gives
        # its heaps' free memory back then); it must not raise
        self.on_idle: Callable[[], object] | None = None

    def run(self, call: Callable[..., None], *args: object) -> bool:
        """Start ``call(*args)`` now. It must not raise: what it raises ends its thread.
        False when no thread was idle and none could be started (a thread is a task: the
        sandbox's processes hold its whole pids limit): the call did not run."""
        with self._ready:
            if self._idle > len(self._calls):
                self._calls.append((call, args))
                self._ready.notify()
                return True
        # handed over in a list the thread empties: a Thread keeps its args while it runs
        try:
            threading.Thread(target=self._serve, args=([(call, args)],), daemon=True).start()
        except RuntimeError:  # "can't start new thread": clone refused (EAGAIN)
            return False
        return True

    @property
    def idle(self) -> int:
        """Threads waiting for a call now."""
        with self._ready:
            return self._idle - len(self._calls)

    def _serve(self, first: list[tuple[Callable[..., None], tuple[object, ...]]]) -> None:
        job: tuple[Callable[..., None], tuple[object, ...]] | None = first.pop()
        while job is not None:
            run, with_args = job
            job = None  # nothing of a served request stays referenced while this thread waits
            run(*with_args)
            del run, with_args
            job = self._next()

    def _next(self) -> tuple[Callable[..., None], tuple[object, ...]] | None:
        """The next call handed to this thread, or None: it ends (enough idle, or idle long)."""
        with self._ready:
            if self._idle >= self._max_idle:
                return None
            self._idle += 1
            try:
                deadline = time.monotonic() + self._idle_seconds
                while not self._calls:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._ready.wait(remaining)
                else:
                    return self._calls.pop(0)
            finally:
                self._idle -= 1
        if self.on_idle is not None:  # idle this long: outside the lock, it may take a while
            self.on_idle()
        return None
