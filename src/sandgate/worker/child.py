"""What the worker uses of a sandbox's first process: `asyncio.subprocess.Process` (the
process runtime) or the bwrap runtime's own (`spawner.SpawnedProcess`)."""

from __future__ import annotations

import asyncio
from typing import Protocol


class ChildProcess(Protocol):
    pid: int
    stdin: asyncio.StreamWriter | None  # the agent's frames in
    stdout: asyncio.StreamReader | None  # and out

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...
    def kill(self) -> None: ...

    async def communicate(self, input: bytes | None = None) -> tuple[bytes, bytes]: ...
