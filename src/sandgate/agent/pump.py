"""The one output pump: read a child's pipes until it has exited, enforcing its deadline.

Used by exec (execute.py, which keeps the first MiB of each stream) and by every background
process and terminal (procs.py, which keeps the most recent MiB for its followers); the two
differ only in what they hand in: where each descriptor's bytes go, how to learn that the child
exited (and reap it), and what to do when the deadline passes.
"""

from __future__ import annotations

import errno
import os
import time

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

READ_CHUNK = 64 << 10
EXIT_GRACE = 0.1  # seconds of output still read after the child itself exited
POLL_INTERVAL = 0.05  # seconds between looks when nothing else wakes the loop


def pump(
    pid: int,
    sinks: Mapping[int, Callable[[bytes], None]],
    *,
    exited: Callable[[], bool],
    deadline: float | None,
    expire: Callable[[], None],
) -> bool:
    """Read every descriptor of ``sinks`` into its sink until the child has exited.

    ``exited()`` reaps the child and says whether it has exited. Once it has, output still
    arriving (from children it left behind) is read until every descriptor is at its end or
    for ``EXIT_GRACE`` more. At the monotonic ``deadline`` (if any) ``expire()`` is called
    once (it kills the child's group), and the pump goes on until the child is gone. Returns
    whether the deadline passed. The descriptors are made non-blocking and left open; a
    terminal's EIO (its last slave fd closed) counts as its end.

    A pidfd wakes the loop when the child exits; without one (old kernel, seccomp) the loop
    looks every ``POLL_INTERVAL``.
    """
    import selectors

    selector = selectors.DefaultSelector()
    for fd in sinks:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    pidfd = pidfd_open(pid)
    if pidfd is not None:
        selector.register(pidfd, selectors.EVENT_READ)
    open_fds = len(sinks)
    exited_at: float | None = None
    timed_out = False
    try:
        while True:
            now = time.monotonic()
            if exited_at is None and exited():
                exited_at = now
            wait: float | None
            if exited_at is not None:
                if not open_fds or now >= exited_at + EXIT_GRACE:
                    return timed_out
                wait = exited_at + EXIT_GRACE - now
            elif timed_out:
                wait = POLL_INTERVAL
            elif deadline is not None and now >= deadline:
                expire()
                timed_out = True
                wait = POLL_INTERVAL
            elif deadline is not None:
                wait = deadline - now
            else:
                wait = None
            if pidfd is None:
                wait = POLL_INTERVAL if wait is None else min(wait, POLL_INTERVAL)
            for key, _events in selector.select(wait):
                fd = key.fd
                if fd == pidfd:
                    selector.unregister(fd)
                    os.close(fd)
                    pidfd = None  # exited: exited() above picks up the status
                    continue
                try:
                    data = os.read(fd, READ_CHUNK)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    if exc.errno != errno.EIO:  # EIO: a terminal's last slave fd closed
                        raise
                    data = b""
                if data:
                    sinks[fd](data)
                else:
                    selector.unregister(fd)
                    open_fds -= 1
    finally:
        selector.close()
        if pidfd is not None:
            os.close(pidfd)


def pidfd_open(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits, or None where there is none."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        fd: int = pidfd_open(pid)
    except OSError:
        return None
    return fd
