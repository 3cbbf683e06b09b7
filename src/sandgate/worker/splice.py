"""Bytes between two connected sockets, moved by the kernel: splice(2) from one socket into
a pipe and from the pipe into the other, never through Python's memory. The egress gate
(`egress.py`) relays every byte a sandbox sends and receives this way; an asyncio stream copy
reached about a third of the direct throughput on this machine (docs/benchmarks.md).

Both sockets must be non-blocking. The event loop only says when a socket is readable or
writable (`add_reader`/`add_writer`); each direction owns one reader and one writer, so the
two directions never wait on the same thing.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
from collections.abc import Callable
from typing import Any

CHUNK = 1 << 20  # at most this much per splice
LINGER = 60.0  # once one direction has ended, the other is cut after this long silent
CHECK = 5.0  # a wait looks at the clock this often
F_SETPIPE_SZ = 1031  # <linux/fcntl.h>
FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK


class _Quiet:
    """How long a direction may wait in silence: forever, until the other one has ended."""

    def __init__(self) -> None:
        self.linger: float | None = None


async def _ready(
    add: Callable[..., Any], remove: Callable[[int], Any], fd: int, quiet: _Quiet
) -> None:
    """Wait until `fd` is readable (add_reader) or writable (add_writer); TimeoutError once
    `quiet.linger` is set and the wait has lasted that long (a half-closed connection whose
    other side never finishes, say a server that ignores the client's FIN)."""
    waiter = asyncio.get_running_loop().create_future()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    add(fd, wake)
    try:
        waited = 0.0
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=CHECK)
            if done:
                return
            waited += CHECK
            if quiet.linger is not None and waited >= quiet.linger:
                raise TimeoutError
    finally:
        remove(fd)
        waiter.cancel()


async def pump(src: socket.socket, dst: socket.socket, quiet: _Quiet | None = None) -> None:
    """Move everything `src` sends to `dst`, then half-close `dst` (its peer sees EOF)."""
    quiet = quiet or _Quiet()
    loop = asyncio.get_running_loop()
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    with contextlib.suppress(OSError):
        fcntl.fcntl(write_end, F_SETPIPE_SZ, CHUNK)
    try:
        while True:
            try:
                moved = os.splice(src.fileno(), write_end, CHUNK, flags=FLAGS)
            except BlockingIOError:
                await _ready(loop.add_reader, loop.remove_reader, src.fileno(), quiet)
                continue
            if moved == 0:
                break
            while moved:
                try:
                    moved -= os.splice(read_end, dst.fileno(), moved, flags=FLAGS)
                except BlockingIOError:
                    await _ready(loop.add_writer, loop.remove_writer, dst.fileno(), quiet)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
    finally:
        os.close(read_end)
        os.close(write_end)


async def relay(a: socket.socket, b: socket.socket, *, linger: float = LINGER) -> None:
    """Both directions until each side has closed; a failure in one ends both, and once one
    has ended the other is cut when silent for `linger` seconds."""
    quiet = _Quiet()

    async def one_way(src: socket.socket, dst: socket.socket) -> None:
        try:
            await pump(src, dst, quiet)
        except (OSError, TimeoutError):  # a reset, a broken pipe: the other one ends too
            for sock in (a, b):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        finally:
            quiet.linger = linger

    await asyncio.gather(one_way(a, b), one_way(b, a))
