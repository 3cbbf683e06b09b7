"""The output buffer of one background process or terminal: its most recent bytes.

Offsets count every byte the process ever wrote (stdout and stderr together, in the order
they were read); the buffer keeps the most recent ``PROCESS_BUFFER_BYTES`` of them, in chunks of
one stream, and any number of followers read it, each from its own offset (long-polling).
"""

from __future__ import annotations

import threading
import time
from collections import deque

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    from typing import Any

PROCESS_BUFFER_BYTES = 1 << 20  # output kept per process
MAX_ANSWER_BYTES = 1 << 20  # output sent in one proc_read/pty_read answer
MAX_CHUNKS = 4096  # chunks kept per process (see procs.py's docstring)
MERGE_BYTES = 64 << 10  # output of one stream is appended to the last chunk up to this size


class Chunk:
    __slots__ = ("data", "start", "stream")

    def __init__(self, stream: str, start: int, data: bytes) -> None:
        self.stream = stream
        self.start = start  # offset of data[0] in everything the process wrote
        self.data = bytearray(data)


class Output:
    """The most recent output of one process, and the followers waiting for more."""

    __slots__ = ("chunks", "cond", "done", "end", "size")

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.chunks: deque[Chunk] = deque()
        self.end = 0  # offset just past the last byte ever written
        self.size = 0  # bytes buffered: they are [end - size, end)
        self.done = False  # the process exited and its output was read to the end

    def append(self, stream: str, data: bytes) -> None:
        with self.cond:
            last = self.chunks[-1] if self.chunks else None
            if last is not None and last.stream == stream and len(last.data) < MERGE_BYTES:
                last.data += data
            else:
                self.chunks.append(Chunk(stream, self.end, data))
            self.end += len(data)
            self.size += len(data)
            self._trim()
            self.cond.notify_all()

    def _trim(self) -> None:
        excess = self.size - PROCESS_BUFFER_BYTES
        while excess > 0 or len(self.chunks) > MAX_CHUNKS:
            head = self.chunks[0]
            if len(head.data) <= excess or len(self.chunks) > MAX_CHUNKS:
                self.chunks.popleft()
                self.size -= len(head.data)
                excess -= len(head.data)
            else:
                del head.data[:excess]
                head.start += excess
                self.size -= excess
                excess = 0

    def finish(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify_all()

    def read(
        self, offset: int, wait: float, linger: float = 0.0
    ) -> tuple[list[list[Any]], bytes, int, int, bool]:
        """(chunks, payload, next_offset, first_offset, everything read) from ``offset``.

        Blocks up to ``wait`` seconds for output past ``offset`` or the end of the process.
        With output there and the process still running, it then waits up to ``linger``
        seconds more for the process to end, so a short command's output and its exit come
        in one answer (each answer is a round trip through the worker).
        """
        deadline = time.monotonic() + wait
        with self.cond:
            while True:
                first = self.end - self.size
                start = max(offset, first)
                if start < self.end:
                    if linger > 0 and not self.done:
                        lingered = time.monotonic() + linger
                        while not self.done and (left := lingered - time.monotonic()) > 0:
                            self.cond.wait(left)
                        first = self.end - self.size
                        start = max(offset, first)
                    chunks, payload, end = self._collect(start)
                    return chunks, payload, end, first, self.done and end == self.end
                if self.done:
                    return [], b"", self.end, first, True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return [], b"", self.end, first, False
                self.cond.wait(remaining)

    def _collect(self, start: int) -> tuple[list[list[Any]], bytes, int]:
        chunks: list[list[Any]] = []
        parts: list[bytes] = []
        position = start
        room = MAX_ANSWER_BYTES
        for chunk in self.chunks:
            skip = position - chunk.start
            if skip >= len(chunk.data):
                continue
            part = bytes(chunk.data[skip : skip + room])
            if chunks and chunks[-1][0] == chunk.stream:
                chunks[-1][1] += len(part)
            else:
                chunks.append([chunk.stream, len(part)])
            parts.append(part)
            position += len(part)
            room -= len(part)
            if not room:
                break
        return chunks, b"".join(parts), position
