"""The agent's request threads (agent/threads.py): reused, never queued, gone when idle."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sandgate.agent.threads import Threads

WAIT = 10.0


def until(check: Callable[[], bool], seconds: float = WAIT) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_a_thread_that_served_a_call_serves_the_next() -> None:
    threads = Threads(idle_seconds=WAIT)
    seen: list[int] = []
    done = threading.Event()

    def record() -> None:
        seen.append(threading.get_ident())
        done.set()

    for _ in range(5):
        done.clear()
        threads.run(record)
        assert done.wait(WAIT)
        until(lambda: threads.idle == 1)  # back to waiting before the next call
    assert len(set(seen)) == 1 and seen[0] != threading.get_ident()


def test_calls_never_wait_for_one_another() -> None:
    """Each call that finds no idle thread gets a new one: 12 calls that only finish together
    (a barrier of 12) all finish, with 2 idle threads kept from before."""
    threads = Threads(idle_seconds=WAIT, max_idle=2)
    pair = threading.Barrier(2, timeout=WAIT)

    def meet_pair() -> None:
        pair.wait()

    for _ in range(2):
        threads.run(meet_pair)
    until(lambda: threads.idle == 2)
    barrier = threading.Barrier(12, timeout=WAIT)
    finished = threading.Semaphore(0)

    def meet() -> None:
        barrier.wait()
        finished.release()

    for _ in range(12):
        threads.run(meet)
    for _ in range(12):
        assert finished.acquire(timeout=WAIT)
    until(lambda: threads.idle == 2)  # the burst's other 10 threads ended


def test_idle_threads_end() -> None:
    threads = Threads(idle_seconds=0.05)
    served: list[threading.Thread] = []
    threads.run(lambda: served.append(threading.current_thread()))
    until(lambda: len(served) == 1)
    served[0].join(WAIT)
    assert not served[0].is_alive()
    assert threads.idle == 0


def test_no_call_is_lost_while_threads_time_out() -> None:
    """Calls handed over just as waiting threads give up are still run, each once."""
    threads = Threads(idle_seconds=0.0005, max_idle=3)
    lock = threading.Lock()
    counts: dict[int, int] = {}

    def count(i: int) -> None:
        with lock:
            counts[i] = counts.get(i, 0) + 1

    for i in range(3000):
        threads.run(count, i)
        if i % 7 == 0:
            time.sleep(0.0005)
    until(lambda: len(counts) == 3000)
    assert set(counts.values()) == {1}


def test_a_thread_idle_long_enough_calls_on_idle() -> None:
    threads = Threads(idle_seconds=0.05)
    idled = threading.Event()
    threads.on_idle = idled.set
    threads.run(lambda: None)
    assert idled.wait(WAIT)


def test_a_busy_thread_does_not_call_on_idle() -> None:
    threads = Threads(idle_seconds=WAIT)
    idled = threading.Event()
    threads.on_idle = idled.set
    done = threading.Semaphore(0)
    for _ in range(20):
        threads.run(done.release)
        assert done.acquire(timeout=WAIT)
    assert not idled.is_set()


def test_a_waiting_thread_keeps_nothing_of_the_call_it_served() -> None:
    """An idle thread must not pin its last request (a MiB payload) for its whole wait."""
    import gc
    import weakref

    class Payload:
        pass

    threads = Threads(idle_seconds=WAIT)
    payload = Payload()
    gone = weakref.ref(payload)
    threads.run(lambda p: None, payload)
    del payload
    until(lambda: threads.idle == 1)
    gc.collect()
    assert gone() is None
