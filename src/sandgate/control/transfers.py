"""A large file's chunks on their way to or from a sandbox, a few at a time.

A file larger than one chunk goes through a handle in the sandbox, a call per chunk. One call
at a time left every process on the way idle while another worked: the server read the body
while the chunk before it waited for nothing, the agent wrote while the server waited for
its answer. Here up to `WINDOW` chunk calls are under way together (docs/benchmarks.md,
"Session 21"). Each call names its offset in the file (the agent's `offsets`), so the
order in which calls arrive does not matter: a forwarded call may overtake another.

Memory stays bounded: a transfer holds at most `WINDOW` chunks in calls under way, beside
the one the client is sending or receiving. The first failed call fails the transfer; the
calls still under way are cancelled and awaited before the caller cleans up, so nothing
of the transfer is left running behind it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NoReturn, TypeVar

WINDOW = 4  # chunk calls under way at once, per transfer

T = TypeVar("T")
Write = Callable[[int, bytes], Awaitable[None]]  # (offset, data)
Read = Callable[[int, int], Awaitable[bytes]]  # (offset, length) -> data


class ChangedSizeError(Exception):
    """A read came back shorter than asked, before the end the file had when opened."""


class Chunker:
    """A body's pieces gathered into chunks of `size` bytes. The pieces are kept as they
    come and joined once a chunk is whole, so each byte is copied once on its way to a
    chunk (a bytearray grown by the pieces and sliced into chunks copied most of them
    three times)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("a chunk holds at least one byte")
        self._size = size
        self._parts: deque[memoryview] = deque()
        self.held = 0  # bytes added and not yet taken

    def add(self, piece: bytes) -> None:
        if piece:
            self._parts.append(memoryview(piece))
            self.held += len(piece)

    def full(self) -> bytes | None:
        """The next whole chunk, if one is held."""
        return self._take(self._size) if self.held >= self._size else None

    def rest(self) -> bytes:
        """All that is held (less than a chunk once `full` gave None)."""
        return self._take(self.held)

    def _take(self, size: int) -> bytes:
        taken: list[memoryview] = []
        need = size
        while need:
            part = self._parts[0]
            if len(part) <= need:
                taken.append(self._parts.popleft())
                need -= len(part)
            else:
                taken.append(part[:need])
                self._parts[0] = part[need:]
                need = 0
        self.held -= size
        if len(taken) == 1 and isinstance(taken[0].obj, bytes) and len(taken[0].obj) == size:
            return taken[0].obj  # one piece that is the chunk: no copy at all
        return b"".join(taken)


class Writes:
    """The writes of one upload, in the order of the file, up to `window` under way: `put`
    each chunk, then `finish` (raises the first failure) or `abandon`. Whatever the upload
    waits for meanwhile (the client's next piece of body) goes through `until`, so that a
    write that fails ends the wait at once, not when the client sends more."""

    def __init__(self, write: Write, window: int = WINDOW) -> None:
        if window < 1:
            raise ValueError("a window holds at least one write")
        self._write = write
        self._window = window
        self._under_way: deque[asyncio.Future[None]] = deque()
        self._failed = asyncio.Event()  # a write under way ended with an error
        self.offset = 0  # where the next chunk goes

    async def put(self, data: bytes) -> None:
        """Start the write of `data` at the current offset, once the window has room
        (waiting for the oldest write; any write's failure is raised here)."""
        while len(self._under_way) >= self._window:
            await self.until(self._under_way[0])
            self._under_way.popleft()
        if self._failed.is_set():
            self._raise_failure()
        write = asyncio.ensure_future(self._write(self.offset, data))
        write.add_done_callback(self._ended)
        self._under_way.append(write)
        self.offset += len(data)

    async def finish(self) -> None:
        """Wait for every write, oldest first; the first failure is raised."""
        while self._under_way:
            await self.until(self._under_way[0])
            self._under_way.popleft()

    async def abandon(self) -> None:
        """Cancel the writes still under way and wait until each has ended."""
        await _cancel_all(self._under_way)
        self._under_way.clear()

    async def until(self, step: Awaitable[T]) -> T:
        """What `step` gives, unless a write under way fails first: then `step` is
        cancelled and that write's error raised."""
        if not self._under_way:
            return await step
        if self._failed.is_set():
            self._raise_failure()
        task = asyncio.ensure_future(step)
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            await asyncio.wait((task, failed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))
        if not task.cancelled():
            return task.result()
        self._raise_failure()

    def _ended(self, write: asyncio.Future[None]) -> None:
        if not write.cancelled() and write.exception() is not None:
            self._failed.set()

    def _raise_failure(self) -> NoReturn:
        for write in self._under_way:
            if write.done() and not write.cancelled() and (error := write.exception()):
                raise error
        raise AssertionError("a write failed but none under way holds its error")


class ReadAhead:
    """The file's bytes from `start` to `size`, `chunk` per read, in order. Reads start at
    once and run up to `window` ahead of the consumer. A short read before `size` means the
    file shrank: ChangedSizeError. `aclose` cancels the reads still under way."""

    def __init__(self, read: Read, start: int, size: int, chunk: int, window: int = WINDOW):
        if window < 1 or chunk < 1:
            raise ValueError("a window holds at least one read of at least one byte")
        self._read = read
        self._size = size
        self._chunk = chunk
        self._window = window
        self._offset = start  # where the next read starts
        self._under_way: deque[tuple[int, asyncio.Future[bytes]]] = deque()
        self._fill()

    def _fill(self) -> None:
        while self._offset < self._size and len(self._under_way) < self._window:
            length = min(self._chunk, self._size - self._offset)
            self._under_way.append(
                (length, asyncio.ensure_future(self._read(self._offset, length)))
            )
            self._offset += length

    def __aiter__(self) -> ReadAhead:
        return self

    async def __anext__(self) -> bytes:
        if not self._under_way:
            raise StopAsyncIteration
        length, task = self._under_way[0]
        data = await task
        self._under_way.popleft()
        if len(data) != length:
            raise ChangedSizeError(f"a read of {length} bytes gave {len(data)}")
        self._fill()
        return data

    async def aclose(self) -> None:
        await _cancel_all(task for _, task in self._under_way)
        self._under_way.clear()


async def _cancel_all(tasks: Iterable[asyncio.Future[Any]]) -> None:
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
