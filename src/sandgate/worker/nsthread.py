"""Network namespaces made and entered from one short-lived thread, not from a process.

A network namespace belongs to a thread, not to a process: a thread that calls
``unshare(CLONE_NEWNET)`` is in a new namespace while the rest of the process stays where
it was, and a socket keeps the namespace it was made in for its whole life. So the worker
makes a sandbox's namespace in-process: a new thread unshares, opens a descriptor of its
namespace (which keeps it alive once the thread has gone back and exited) and a netlink
socket in it, and goes back. Configuring the namespace later takes a netlink socket made the
same way after ``setns`` into it. No ``ip`` process is spawned, and the worker's descriptor
table (which every spawn copies, and which grows with the sandboxes held) is not copied.

Each call runs on a thread of its own that exits after it: a thread that could not go back
to the worker's namespace is never reused for anything else.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

_CLONE_NEWNET = 0x40000000
_NETLINK_ROUTE = 0
_libc = ctypes.CDLL(None, use_errno=True)
_libc.unshare.argtypes = (ctypes.c_int,)
_libc.setns.argtypes = (ctypes.c_int, ctypes.c_int)

T = TypeVar("T")


def new_namespace() -> tuple[int, socket.socket]:
    """A new network namespace (only a down ``lo`` in it): a descriptor that holds it, and a
    netlink route socket inside it."""
    return _on_own_thread(_unshare)


def route_socket_in(namespace_fd: int) -> socket.socket:
    """A netlink route socket inside the namespace `namespace_fd` opens."""
    return _on_own_thread(lambda: _enter(namespace_fd))


def _unshare() -> tuple[int, socket.socket]:
    home = _own_namespace()
    try:
        _check(_libc.unshare(_CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        fd = _own_namespace()
        try:
            return fd, _route_socket()
        except BaseException:
            os.close(fd)
            raise
    finally:
        _go_back(home)


def _enter(namespace_fd: int) -> socket.socket:
    home = _own_namespace()
    try:
        _check(_libc.setns(namespace_fd, _CLONE_NEWNET), "setns into the namespace")
        return _route_socket()
    finally:
        _go_back(home)


def _go_back(home: int) -> None:
    try:
        _check(_libc.setns(home, _CLONE_NEWNET), "setns back")
    finally:
        os.close(home)


def _own_namespace() -> int:
    return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)


def _route_socket() -> socket.socket:
    return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, _NETLINK_ROUTE)


def _check(result: int, what: str) -> None:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _on_own_thread(work: Callable[[], T]) -> T:
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as exc:  # handed to the caller
            failure.append(exc)

    thread = threading.Thread(target=run, name="sandgate-netns", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]
