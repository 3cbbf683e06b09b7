"""The agent's stdin and stdout pipes, sized for the frames that pass through them."""

from __future__ import annotations

import contextlib
import fcntl

from sandgate.worker.child import ChildProcess

# The agent's pipes: a reader that buffers up to PIPE_LIMIT before it pauses the pipe (the
# asyncio default, 64 KiB, paused and resumed it many times for one file chunk), and pipes of
# PIPE_BYTES (the kernel's default is 64 KiB: a 1 MiB chunk took 16 wake-ups on each side).
# Both are only filled while a frame passes: an idle sandbox holds no buffer. The reader
# takes up to PIPE_BYTES per read, not asyncio's 256 KiB: a chunk in one wake-up.
PIPE_LIMIT = 1 << 20
PIPE_BYTES = 1 << 20


def widen_pipes(process: ChildProcess) -> None:
    """Give the agent's stdin and stdout pipes PIPE_BYTES (best effort: the default works)."""
    for stream in (process.stdin, process.stdout):
        transport = getattr(stream, "transport", None) or getattr(stream, "_transport", None)
        pipe = transport.get_extra_info("pipe") if transport is not None else None
        if pipe is not None:
            # OSError: the size refused; ValueError: the pipe already closed (the child
            # exited at once, and its end is gone): the default works, or nothing is left
            with contextlib.suppress(OSError, ValueError):
                fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        if stream is process.stdout and transport is not None and hasattr(transport, "max_size"):
            transport.max_size = PIPE_BYTES  # _UnixReadPipeTransport's bytes per os.read
