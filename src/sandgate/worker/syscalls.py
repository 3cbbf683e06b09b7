"""Raw Linux system calls that Python's `os` does not wrap, through libc's `syscall`.

The numbers passed are the kernel's own; those of 424 and up (the new mount API, openat2)
are the same on every architecture.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def call(number: int, *args: Any) -> int:
    """System call `number` with `args` (ctypes values); its OSError on failure."""
    result = int(_syscall(ctypes.c_long(number), *args))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result
