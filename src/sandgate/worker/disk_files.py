"""The worker's own way to a sandbox's files: a file written or read whole on the sandbox's
disk, without the hop through its agent's pipes (~0.5 ms per MiB each way on a small VM).

It takes the two calls the control plane makes for a file that fits in one chunk,
`open_write` with `commit` and `open_read` with `first` (`control/toolbox.py`), and answers
them as the agent does (`sandgate.agent.files`): the same entry, error codes and messages,
temp file beside the target and rename onto it. Any case it does not take it leaves to the
agent by answering None: a symlink anywhere on the path (the agent resolves it in the
sandbox's view), a root itself, a directory it cannot reach or make, a file larger than
`first`, a path outside /workspace and /tmp, malformed fields, and any call that finds both
file threads busy (so one tenant's files never queue another's).

Why it is safe (docs/decisions/0012-worker-file-path.md):

* It exists only for a sandbox whose /workspace and /tmp are its own disk's directories (a
  detached disk, no workspace bound, no image root; `BwrapRuntime.start`): the worker's view
  of that disk is then exactly what the sandbox sees there.
* Every path is opened with openat2(2) beneath the disk's root, refusing symlinks, magic
  links and mount crossings; temp file and rename are single names in an open directory.
* The work runs on the runtime's file threads (`FileThreads`), which never run anything else.
  Each has no supplementary groups; during a call it has the sandbox's uid and gid as its
  file-system ids and no effective capability at all (each checked once set): the kernel
  checks permissions as for the sandbox's own processes and what is created is the
  sandbox's. A thread that could not take the worker's ids back takes no further call.
* The disk's descriptor is duplicated under a lock that `close` takes before the runtime
  releases the disk, so a call never reaches a descriptor number reused meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import platform
import posixpath
import stat
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import BrokenExecutor, Future, ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from types import MappingProxyType
from typing import Any, TypeVar

from sandgate.agent import entries
from sandgate.agent.frames import Header
from sandgate.errors import from_wire
from sandgate.tunnel.rpc import NoAnswerError
from sandgate.worker import syscalls

log = logging.getLogger(__name__)

# openat2(2): the same number on every architecture; struct open_how is three u64
_SYS_OPENAT2 = 437
_RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE = _RESOLVE_NO_XDEV | _RESOLVE_NO_MAGICLINKS | _RESOLVE_NO_SYMLINKS | _RESOLVE_BENEATH
# as raw system calls these change the calling thread only (glibc's setgroups wrapper changes
# every thread of the process): (setgroups, capget, capset)
_SYSCALLS = MappingProxyType({"x86_64": (116, 125, 126), "aarch64": (159, 90, 91)})
_CAP_VERSION_3 = 0x20080522  # two 32-bit words per set
_THREAD_NAME = "sandbox-files"
# on these the agent answers in its own words (they name a symlink, a parent that is a file,
# or a name too long for the temp file it makes),
# or a shortage of descriptors in the worker (the agent has its own)
_LEAVE_TO_AGENT = frozenset(
    {errno.ELOOP, errno.EXDEV, errno.ENOTDIR, errno.ENAMETOOLONG, errno.EMFILE, errno.ENFILE}
)
# sandbox root -> its directory on the disk
_ROOTS = MappingProxyType({"/workspace": "workspace", "/tmp": "tmp"})
_UNSET = 0xFFFFFFFF  # an invalid id: setfsuid/setfsgid change nothing and answer the current
_T = TypeVar("_T")

# (disk root fd, sandbox path, its sandbox root, the rest, the call's fields, its payload)
_Work = Callable[[int, str, str, str, Header, bytes], tuple[Header, bytes]]


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


_CapSets = ctypes.Array[_CapData]  # the effective, permitted, inheritable of two words

_libc = ctypes.CDLL(None, use_errno=True)
_setfsuid = _libc.setfsuid
_setfsuid.argtypes = (ctypes.c_uint32,)
_setfsgid = _libc.setfsgid
_setfsgid.argtypes = (ctypes.c_uint32,)


def _openat2(dirfd: int, path: str, flags: int, mode: int = 0) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode, _RESOLVE)
    path_bytes = ctypes.c_char_p(os.fsencode(path))
    size = ctypes.c_size_t(ctypes.sizeof(how))
    return syscalls.call(_SYS_OPENAT2, ctypes.c_long(dirfd), path_bytes, ctypes.byref(how), size)


def _capabilities(change: Callable[[_CapSets], None] | None = None) -> _CapSets:
    """This thread's capability sets, after `change` (applied with capset) if given."""
    _, capget, capset = _SYSCALLS[platform.machine()]
    head = _CapHeader(_CAP_VERSION_3, 0)
    sets = (_CapData * 2)()
    syscalls.call(capget, ctypes.byref(head), ctypes.byref(sets))
    if change is not None:
        change(sets)
        syscalls.call(capset, ctypes.byref(head), ctypes.byref(sets))
        syscalls.call(capget, ctypes.byref(head), ctypes.byref(sets))
    return sets


def _clear_effective(sets: _CapSets) -> None:
    for half in sets:
        half.effective = 0


def _restore_effective(before: _CapSets, sets: _CapSets) -> None:
    for half, was in zip(sets, before, strict=True):
        half.effective = was.effective


def probe() -> str | None:
    """Why this host's worker cannot reach sandbox files itself (the agent serves them all),
    or None when it can."""
    if platform.machine() not in _SYSCALLS:
        return f"no thread-own setgroups and capset known on {platform.machine()}"
    if os.geteuid() != 0:
        return "the worker is not root"
    try:
        os.close(_openat2(-100, ".", os.O_PATH))  # AT_FDCWD
        _capabilities()
    except OSError as exc:
        return f"openat2 or capget is not available: {exc.strerror}"
    return None


def _drop_groups() -> None:
    """A file thread's start: no supplementary groups on this thread (the sandbox has none)."""
    syscalls.call(_SYSCALLS[platform.machine()][0], ctypes.c_long(0), None)


class FileThreads:
    """The threads sandbox files are reached on, shared by a worker's sandboxes. A call that
    finds them all busy is not queued: the caller leaves it to the agent."""

    SIZE = 2

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(
            self.SIZE, thread_name_prefix=_THREAD_NAME, initializer=_drop_groups
        )
        self._busy = 0  # calls submitted and not finished (counted down when the thread is)

    def check(self) -> str | None:
        """Why this host or these threads cannot reach sandbox files (the agent serves every
        file), or None when they can: `probe`, then one empty call as nobody, at the worker's
        start (no thread starts when the probe fails)."""
        problem = probe()
        if problem is not None:
            return problem
        try:
            return self._pool.submit(_try_ids).result(timeout=10)
        except Exception as exc:  # a thread that cannot start (groups), or none in time
            return f"a file thread cannot start: {exc!r}"

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, call: Callable[[], _T], *, wait: float) -> _T | None:
        """`call` on a file thread, within `wait` seconds; None if none is free (or the
        threads are shut down)."""
        if self._busy >= self.SIZE:
            return None
        loop = asyncio.get_running_loop()
        try:
            done: Future[_T] = self._pool.submit(call)
        except RuntimeError:  # shut down: the worker is stopping
            return None
        self._busy += 1
        done.add_done_callback(partial(self._finished_on, loop))
        try:
            async with asyncio.timeout(wait):
                return await asyncio.wrap_future(done, loop=loop)
        except BrokenExecutor:  # a thread could not start as a file thread
            return None
        except TimeoutError:
            raise NoAnswerError(f"no answer from the sandbox's disk within {wait:g} s") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if done.cancelled() and (task is None or not task.cancelling()):
                return None  # cancelled by the shutdown, not this caller
            raise

    def _finished_on(self, loop: asyncio.AbstractEventLoop, _: object) -> None:
        """(On the thread that ran the call.) Count it done on the loop's thread."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing counts any more
            loop.call_soon_threadsafe(self._finished)

    def _finished(self) -> None:
        self._busy -= 1


class _NotMine(Exception):
    """This case is the agent's to answer."""


@contextmanager
def _as_sandbox(uid: int, gid: int) -> Iterator[None]:
    """Run the block with the sandbox's file-system ids and no effective capability on this
    thread, then the worker's again. Only on a file thread that has the worker's own ids."""
    own_uid, own_gid = os.geteuid(), os.getegid()
    if not threading.current_thread().name.startswith(_THREAD_NAME) or os.getgroups():
        raise _NotMine  # not a file thread, or its groups came back
    if _setfsuid(_UNSET) != own_uid or _setfsgid(_UNSET) != own_gid:
        raise _NotMine  # an earlier call could not take the ids back: this thread is done
    try:
        before = _capabilities()
    except OSError:
        raise _NotMine from None
    _setfsgid(gid)
    _setfsuid(uid)
    try:
        if _setfsuid(_UNSET) != uid or _setfsgid(_UNSET) != gid:
            raise _NotMine
        try:
            if any(half.effective for half in _capabilities(_clear_effective)):
                raise _NotMine
        except OSError:
            raise _NotMine from None
        yield
    finally:
        try:
            _capabilities(partial(_restore_effective, before))
        except OSError as exc:  # without them its next call cannot set ids and is refused
            log.error("disk_files.capabilities_not_restored: %s", exc.strerror)
        _setfsuid(own_uid)
        _setfsgid(own_gid)
        if _setfsuid(_UNSET) != own_uid or _setfsgid(_UNSET) != own_gid:
            log.error("disk_files.ids_not_restored: this file thread takes no further call")


def _try_ids() -> str | None:
    try:
        with _as_sandbox(65534, 65534):
            return None
    except _NotMine:
        return "a file thread cannot take other file-system ids or drop its capabilities"


def _split(value: Any) -> tuple[str, str, str] | None:
    """A path as the agent reads it (`agent/paths.resolve`): (its sandbox path, its sandbox
    root, the rest), or None for what the agent must answer (malformed, a root itself,
    outside /workspace and /tmp)."""
    if not isinstance(value, str) or not value or "\x00" in value:
        return None
    try:
        value.encode()
    except UnicodeEncodeError:  # a lone surrogate: the agent's call cannot even carry it
        return None
    spath = entries.sandbox_path(value)
    for sroot in _ROOTS:
        if spath.startswith(sroot + "/"):
            return spath, sroot, spath[len(sroot) + 1 :]
    return None


def _error(code: str, message: str) -> Exception:
    return from_wire({"code": code, "message": message})


def _os_error(exc: OSError) -> Exception:
    """As the agent words it (`agent/paths.os_error`): the file names are sandbox paths."""
    code = entries.ERRNO_CODES.get(exc.errno or 0, "io_error")
    message = exc.strerror or str(exc)
    for filename in (exc.filename, exc.filename2):
        if isinstance(filename, str):
            message += f": {filename}"
    return _error(code, message)


class DiskFiles:
    """One sandbox's files on its own disk, reached by the worker (see the module)."""

    OPS = frozenset({"open_write", "open_read"})  # the agent calls it may answer

    def __init__(self, mount_fd: int, uid: int, gid: int, threads: FileThreads) -> None:
        self._mount_fd = mount_fd  # the runtime's; released by it after `close`
        self._uid = uid
        self._gid = gid
        self._threads = threads
        self._lock = threading.Lock()

    def close(self) -> None:
        """No call reaches the disk after this (the runtime calls it before releasing)."""
        with self._lock:
            self._mount_fd = -1

    async def serve(
        self, op: str, fields: Header, payload: bytes, *, wait: float = 60.0
    ) -> tuple[Header, bytes] | None:
        """The answer to an agent call within `wait` seconds, or None: the agent's to
        answer."""
        work: _Work
        if op == "open_write" and fields.get("commit") is True:
            work = self._write
        elif op == "open_read" and type(fields.get("first")) is int:
            if not 0 < fields["first"] <= entries.MAX_READ_LENGTH:
                return None
            work = self._read
        else:
            return None
        split = _split(fields.get("path"))
        if split is None:
            return None
        return await self._threads.run(partial(self._run, work, split, fields, payload), wait=wait)

    def _run(
        self, work: _Work, split: tuple[str, str, str], fields: Header, payload: bytes
    ) -> tuple[Header, bytes] | None:
        with self._lock:
            if self._mount_fd < 0:
                return None  # stopping: the agent's call says so
            try:
                root = os.dup(self._mount_fd)
            except OSError:  # out of descriptors: the agent has its own
                return None
        spath, sroot, rest = split
        try:
            with _as_sandbox(self._uid, self._gid):
                return work(root, spath, sroot, rest, fields, payload)
        except _NotMine:
            return None
        except OSError as exc:
            if exc.errno in _LEAVE_TO_AGENT:
                return None
            raise _os_error(exc) from None
        finally:
            os.close(root)

    # ------------------------------------------------------------------ the two calls

    def _write(
        self, root: int, spath: str, sroot: str, rest: str, fields: Header, data: bytes
    ) -> tuple[Header, bytes]:
        parent_path, name = posixpath.split(rest)
        try:  # up to the temp file, any failure is the agent's to word (it redoes the same)
            parent = _directory(root, sroot, parent_path)
        except OSError:
            raise _NotMine from None
        where = posixpath.dirname(spath)
        try:
            _refuse_directory(parent, name, spath)
            temp = entries.upload_temp_name(name)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = _named(os.open, f"{where}/{temp}", temp, flags, 0o644, dir_fd=parent)
            try:
                try:
                    entries.write_all(fd, data)
                finally:
                    os.close(fd)
                _refuse_directory(parent, name, spath)
                try:
                    os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
                except OSError as exc:
                    raise OSError(exc.errno, exc.strerror, f"{where}/{temp}", None, spath) from None
            except BaseException:
                try:
                    os.unlink(temp, dir_fd=parent)
                except OSError:
                    pass
                raise
            found = _named(os.stat, spath, name, dir_fd=parent, follow_symlinks=False)
            return {"handle": None, "entry": entries.entry(spath, found)}, b""
        finally:
            os.close(parent)

    def _read(
        self, root: int, spath: str, sroot: str, rest: str, fields: Header, payload: bytes
    ) -> tuple[Header, bytes]:
        first: int = fields["first"]
        # O_NONBLOCK so that a FIFO cannot hang the call; only regular files are served
        flags = os.O_RDONLY | os.O_NONBLOCK
        fd = _named(_openat2, spath, root, f"{_ROOTS[sroot]}/{rest}", flags)
        try:
            opened = os.fstat(fd)
            problem = entries.not_readable(opened, spath)
            if problem is not None:
                raise _error(*problem)
            if opened.st_size > first:
                raise _NotMine  # read through a handle: the agent keeps those
            os.set_blocking(fd, True)
            head = entries.read_up_to(fd, first)  # at most `first`: what it holds now, whole
        finally:
            os.close(fd)
        return {"handle": None, "size": len(head), "first": len(head), "eof": True}, head


def _named(call: Callable[..., _T], spath: str, *args: Any, **kwargs: Any) -> _T:
    """`call`, its OS error naming `spath` (the sandbox's path of what failed, as the agent
    names it)."""
    try:
        return call(*args, **kwargs)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, spath) from None


def _directory(root: int, sroot: str, parent_path: str) -> int:
    """An O_PATH descriptor of the upload's directory, made (with its parents) if missing."""
    directory = _ROOTS[sroot]
    flags = os.O_PATH | os.O_DIRECTORY
    if parent_path:
        try:
            return _openat2(root, f"{directory}/{parent_path}", flags)
        except FileNotFoundError:
            pass
    fd = _openat2(root, directory, flags)
    for part in parent_path.split("/") if parent_path else ():
        try:
            try:
                below = _openat2(fd, part, flags)
            except FileNotFoundError:
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass  # made meanwhile
                below = _openat2(fd, part, flags)
        finally:
            os.close(fd)
        fd = below
    return fd


def _refuse_directory(parent: int, name: str, spath: str) -> None:
    """A directory at the target is an error; a symlink there, or a target it cannot look
    at, is the agent's (it follows the one and words the other)."""
    try:
        found = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    except OSError:
        raise _NotMine from None
    if stat.S_ISDIR(found.st_mode):
        raise _error("is_a_directory", f"{spath} is a directory")
    if stat.S_ISLNK(found.st_mode):
        raise _NotMine
