"""The heap of a long-lived sandgate process (`sandgate server`, `sandgate worker`).

A file chunk, a tunnel frame or an HTTP body is a buffer of about 1 MiB, made and dropped
several times per request. glibc's defaults give such a buffer back to the kernel when it
is freed (an mmap'ed block, or the top of a heap trimmed once 2 blocks' worth is free), so
the next one is new memory again: page faults on every page, ~0.3 ms per MiB on a virtual
machine like the ones sandgate was measured on (docs/benchmarks.md, "Session 14"). These
processes serve many requests for as long as they run: they keep buffers up to
`LARGE_BUFFER_BYTES` in the heap and up to `KEPT_FREE_BYTES` of it free for the next ones.
The agent inside each sandbox, which must stay small when idle, has its own setting
(agent/main.py `_tune_malloc`).
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

LARGE_BUFFER_BYTES = 4 << 20  # larger blocks are mmap'ed and given back when freed
KEPT_FREE_BYTES = 32 << 20  # free heap kept for the next requests

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_large_buffers() -> None:
    """Set the thresholds above (glibc only; elsewhere a debug line, nothing else)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError) as exc:
        log.debug("heap.untuned", extra={"error": str(exc)})
        return
    mallopt(_M_MMAP_THRESHOLD, LARGE_BUFFER_BYTES)  # fixed: glibc no longer moves it
    mallopt(_M_TRIM_THRESHOLD, KEPT_FREE_BYTES)
