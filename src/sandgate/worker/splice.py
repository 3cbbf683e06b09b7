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
F_SETPIPE_SZ = 1031  # <linux/fcntl.h>
FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK


async def _ready(add: Callable[..., Any], remove: Callable[[int], Any], fd: int) -> None:
    """Wait until `fd` is readable (add_reader) or writable (add_writer)."""
    waiter = asyncio.get_running_loop().create_future()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    add(fd, wake)
    try:
        await waiter
    finally:
        remove(fd)


async def pump(src: socket.socket, dst: socket.socket) -> None:
    """Move everything `src` sends to `dst`, then half-close `dst` (its peer sees EOF)."""
    loop = asyncio.get_running_loop()
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    with contextlib.suppress(OSError):
        fcntl.fcntl(write_end, F_SETPIPE_SZ, CHUNK)
    try:
        while True:
            try:
                moved = os.splice(src.fileno(), write_end, CHUNK, flags=FLAGS)
            except BlockingIOError:
                await _ready(loop.add_reader, loop.remove_reader, src.fileno())
                continue
            if moved == 0:
                break
            while moved:
                try:
                    moved -= os.splice(read_end, dst.fileno(), moved, flags=FLAGS)
                except BlockingIOError:
                    await _ready(loop.add_writer, loop.remove_writer, dst.fileno())
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
    finally:
        os.close(read_end)
        os.close(write_end)


async def relay(a: socket.socket, b: socket.socket) -> None:
    """Both directions until each side has closed; a failure in one ends both."""

    async def one_way(src: socket.socket, dst: socket.socket) -> None:
        try:
            await pump(src, dst)
        except OSError:  # a reset, a broken pipe: the other direction ends too
            for sock in (a, b):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    await asyncio.gather(one_way(a, b), one_way(b, a))
