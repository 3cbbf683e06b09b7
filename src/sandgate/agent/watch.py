"""Directory watches of the agent (docs/agent-protocol.md, "Directory watches").

Standard library only, deployed next to the agent (main.py) and imported by it on the first
``watch_*`` request, so an agent that never watches pays nothing (ctypes included). Linux
inotify through ctypes (libc's ``inotify_init1``, ``inotify_add_watch``, ``inotify_rm_watch``):
every watcher has an inotify instance of its own and one daemon thread that reads its events
into a bounded buffer; ``watch_read`` only looks at that buffer, so it long-polls on its own
request thread like ``proc_read`` does. The one ``Watches`` registry lives in the agent's
``AgentState``.

Notes on behaviour the protocol leaves open:

* A recursive watch watches every subdirectory when it starts (before it answers), and each
  one created or moved in later when its event is read. A directory created and filled at once
  (``mkdir -p a/b && touch a/b/c``) may be filled before its watch is added: what it holds
  then is reported as created, each entry once.
* Symlinks below the watched directory are never followed.
* A subdirectory moved out of the tree stops being watched; one moved in is watched (what it
  holds is not reported: it was not created).
* ``write`` is ``IN_MODIFY``: one per write(2), less where the kernel merges identical events
  not yet read; ``IN_CLOSE_WRITE`` is not reported (it would double every write).
* Events about a watched directory itself (no name) are not reported: its parent's watch
  reports them, with its name. The watcher ends (``ended: true`` once its events were read)
  when the watched directory is deleted, moved or unmounted.
* When the kernel's queue overflows (``IN_Q_OVERFLOW``, fs.inotify.max_queued_events) events
  are lost; reads say ``overflowed: true`` from then on.
"""

from __future__ import annotations

import errno
import itertools
import json
import math
import os
import select
import stat
import struct
import threading
import time
from collections import deque

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    from typing import Any

    from sandgate.agent import entries, paths
    from sandgate.agent.log import log
    from sandgate.agent.request import AgentError, Header, bool_field, start_thread, str_field
else:
    import entries
    import paths
    from log import log
    from request import AgentError, bool_field, start_thread, str_field

MAX_WATCHERS = 64  # watchers per agent (ended ones are forgotten first to make room)
MAX_EVENTS = 10_000  # events kept per watcher: the oldest are dropped first
MAX_BUFFER_BYTES = 4 << 20  # and at most this much of them (their JSON)
MAX_ANSWER_BYTES = 512 << 10  # events (their JSON) sent in one watch_read answer
MAX_WAIT = 30.0  # seconds a read may wait for an event
READ_BYTES = 64 << 10  # one read(2) of an inotify descriptor
STOP_JOIN_SECONDS = 2.0  # watch_stop: how long it waits for the watcher's thread to end

# <sys/inotify.h>
IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_UNMOUNT = 0x00002000
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000

WATCH_MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR  # refused (ENOTDIR) unless a directory: no check-then-watch race
    | IN_DONT_FOLLOW  # a symlink put in place after the path was resolved is not followed
    | IN_EXCL_UNLINK  # nothing about files already unlinked but still open
)
# an event's type: the first of these its mask has (every event has one of them at most)
EVENT_TYPES = (
    (IN_CREATE | IN_MOVED_TO, "create"),
    (IN_MODIFY, "write"),
    (IN_DELETE, "remove"),
    (IN_MOVED_FROM, "rename"),
    (IN_ATTRIB, "chmod"),
)
ROOT_ENDS = IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT | IN_IGNORED

EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then the name


class Inotify:
    """libc's inotify calls, raising OSError (or AgentError for a limit) on failure."""

    def __init__(self) -> None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            self._init1 = libc.inotify_init1
            self._add = libc.inotify_add_watch
            self._rm = libc.inotify_rm_watch
        except (ImportError, OSError, AttributeError) as exc:
            raise AgentError(
                "io_error", f"directory watches are unavailable: no inotify here ({exc})"
            ) from None
        self._init1.argtypes = [ctypes.c_int]
        self._add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self._rm.argtypes = [ctypes.c_int, ctypes.c_int]
        for function in (self._init1, self._add, self._rm):
            function.restype = ctypes.c_int
        self._get_errno = ctypes.get_errno

    def _error(self, what: str, filename: str | None = None) -> OSError:
        code = self._get_errno()
        if code == errno.ENOSPC:  # a kernel limit, not a full disk
            return _Limit(
                f"{what}: the kernel's limit of inotify watches (fs.inotify.max_user_watches) "
                "is reached; watch fewer directories"
            )
        if code == errno.EMFILE:
            return _Limit(
                f"{what}: the kernel's limit of inotify instances "
                "(fs.inotify.max_user_instances) or of open files is reached; stop a watch"
            )
        if code == errno.ENOSYS:
            return _Limit(f"{what}: this kernel has no inotify", code="io_error")
        if filename is not None:
            return OSError(code, os.strerror(code), filename)
        return OSError(code, f"{what}: {os.strerror(code)}")

    def init(self) -> int:
        fd = int(self._init1(os.O_NONBLOCK | os.O_CLOEXEC))
        if fd < 0:
            raise self._error("inotify_init1")
        return fd

    def add(self, fd: int, real: str) -> int:
        wd = int(self._add(fd, os.fsencode(real), WATCH_MASK))
        if wd < 0:
            raise self._error("inotify_add_watch", real)
        return wd

    def remove(self, fd: int, wd: int) -> None:
        self._rm(fd, wd)  # EINVAL: already gone; nothing to do either way


class _Limit(OSError):
    """An inotify limit: answered with its own code (an OSError so callers catch one type)."""

    def __init__(self, message: str, code: str = "limit_exceeded") -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Watcher:
    """One watched directory: its inotify instance, the thread reading it, its events."""

    __slots__ = (
        "closed",
        "cond",
        "cursor",
        "dirs",
        "done",
        "end",
        "ended_at",
        "events",
        "fd",
        "fd_lock",
        "gone",
        "inotify",
        "overflowed",
        "pending",
        "prefix",
        "real",
        "recursive",
        "root",
        "root_wd",
        "size",
        "stop_r",
        "stop_w",
        "stopping",
        "thread",
        "wid",
    )

    def __init__(self, wid: str, target: paths.Target, inotify: Inotify, recursive: bool) -> None:
        self.wid = wid
        self.prefix = target.spath.rstrip("/") + "/"  # the sandbox path of every event
        self.real = target.real  # the watched directory on the real filesystem
        self.root = target.root  # real directory of its sandbox root
        self.recursive = recursive
        self.inotify = inotify
        # the events read, and their readers
        self.cond = threading.Condition(threading.Lock())
        self.events: deque[tuple[Header, int]] = deque()  # (event, its JSON size)
        self.end = 0  # offset just past the last event ever read
        self.size = 0  # JSON bytes of the events buffered
        self.cursor = 0  # the next event for readers that give no offset
        self.done = False  # the thread ended and closed the descriptors: nothing more comes
        self.ended_at = 0.0
        self.overflowed = False
        # the thread's own: watch descriptors, by the directory they watch (relative; "" is the
        # watched one), and the names a directory's first scan already reported as created
        self.dirs: dict[int, str] = {}
        self.pending: dict[int, set[str]] = {}
        self.root_wd = -1
        self.gone = False  # the watched directory was deleted, moved or unmounted
        self.stopping = False  # watch_stop or the agent's exit asked the thread to end
        self.thread: threading.Thread | None = None
        self.fd_lock = threading.Lock()
        self.closed = False
        self.fd = inotify.init()
        try:
            self.stop_r, self.stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            os.close(self.fd)
            raise

    # ----------------------------------------------------------------------- watching

    def watch_tree(self, rel: str, *, created: bool, initial: bool = False) -> None:
        """Watch ``rel`` and (recursive) every directory below it. ``created``: report what
        each holds as created (a directory that was just created). ``initial``: the start,
        where a failure to watch the directory itself fails the request."""
        stack = [rel]
        while stack:
            current = stack.pop()
            real = os.path.join(self.real, current) if current else self.real
            if current and not paths.inside(os.path.realpath(real), self.root):
                continue  # a component was swapped for a symlink that leaves the sandbox
            try:
                wd = self.inotify.add(self.fd, real)
            except _Limit:
                if initial:
                    raise
                log(f"watch {self.wid}: {current} is not watched: inotify limit reached")
                return
            except OSError:
                if initial and not current:
                    raise
                continue  # gone or replaced meanwhile: its own events tell
            if not current:
                self.root_wd = wd
            self.dirs[wd] = current
            if not self.recursive:
                return
            try:
                with os.scandir(real) as listing:
                    items = [(e.name, e.is_dir(follow_symlinks=False)) for e in listing]
            except OSError:
                continue
            below = []
            for name, is_dir in sorted(items):
                if entries.is_upload_temp(name):
                    continue
                child = f"{current}/{name}" if current else name
                if created:
                    self.pending.setdefault(wd, set()).add(name)
                    self._append(child, "create")
                if is_dir:
                    below.append(child)
            stack.extend(reversed(below))  # depth first, in name order

    def _forget_tree(self, rel: str) -> None:
        """A directory moved out of the tree: stop watching it and what is below it."""
        below = rel + "/"
        for wd, current in list(self.dirs.items()):
            if current == rel or current.startswith(below):
                del self.dirs[wd]
                self.pending.pop(wd, None)
                self.inotify.remove(self.fd, wd)

    def run(self) -> None:
        """The watcher's thread: read events until stopped or the watched directory is gone."""
        try:
            poller = select.poll()
            poller.register(self.fd, select.POLLIN)
            poller.register(self.stop_r, select.POLLIN)
            while not self.gone and not self.stopping:
                ready = {fd for fd, _ in poller.poll()}
                if self.stop_r in ready:
                    break
                self._drain()
        except BaseException as exc:  # never leave readers waiting forever
            log(f"watch {self.wid}: reading its events failed: {exc!r}")
        finally:
            self._close()
            with self.cond:
                self.done = True
                self.ended_at = time.monotonic()
                self.cond.notify_all()

    def _drain(self) -> None:
        """Read every event queued now (the descriptor is non-blocking)."""
        while not self.gone and not self.stopping:
            try:
                data = os.read(self.fd, READ_BYTES)
            except BlockingIOError:
                # the queue is empty: any event a first scan reported was read by now
                self.pending.clear()
                return
            if not data:
                return
            offset = 0
            while offset + EVENT.size <= len(data) and not self.gone:
                wd, mask, _cookie, length = EVENT.unpack_from(data, offset)
                raw = data[offset + EVENT.size : offset + EVENT.size + length]
                offset += EVENT.size + length
                name = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
                self._event(wd, mask, name)

    def _event(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            if not self.overflowed:
                log(f"watch {self.wid}: the kernel's event queue overflowed: events were lost")
            with self.cond:
                self.overflowed = True
            return
        rel = self.dirs.get(wd)
        if rel is None:
            return  # a watch removed meanwhile
        if not name:  # about the watched directory itself
            if mask & IN_IGNORED:
                del self.dirs[wd]
                self.pending.pop(wd, None)
            if wd == self.root_wd and mask & ROOT_ENDS:
                self.gone = True  # the thread ends; readers see it once it closed
            return
        if entries.is_upload_temp(name):
            return  # an upload in progress: its file appears when it is renamed into place
        child = f"{rel}/{name}" if rel else name
        pending = self.pending.get(wd)
        if pending and mask & (IN_CREATE | IN_MOVED_TO) and name in pending:
            pending.discard(name)  # its directory's first scan reported it already
            return
        kind = next((kind for bits, kind in EVENT_TYPES if mask & bits), None)
        if kind is None:
            return
        self._append(child, kind)
        if self.recursive and mask & IN_ISDIR:
            if mask & IN_CREATE:
                self.watch_tree(child, created=True)
            elif mask & IN_MOVED_TO:
                self.watch_tree(child, created=False)
            elif mask & IN_MOVED_FROM:
                self._forget_tree(child)

    def _append(self, rel: str, kind: str) -> None:
        event = {"name": rel, "path": self.prefix + rel, "type": kind}
        size = len(json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode())
        with self.cond:
            self.events.append((event, size))
            self.end += 1
            self.size += size
            while len(self.events) > MAX_EVENTS or self.size > MAX_BUFFER_BYTES:
                _, dropped = self.events.popleft()
                self.size -= dropped
            self.cond.notify_all()

    # ----------------------------------------------------------------------- readers

    def read(self, offset: int | None, wait: float) -> Header:
        """Events from ``offset`` (None: this watcher's cursor, advanced past them); waits up
        to ``wait`` seconds for one, or for the end of the watcher."""
        deadline = time.monotonic() + wait
        with self.cond:
            if offset is not None and offset > self.end:  # end only grows
                raise AgentError("invalid_request", f"'offset' {offset} is past the last event")
            while True:
                first = self.end - len(self.events)
                start = self.cursor if offset is None else offset
                begin = max(start, first)
                remaining = deadline - time.monotonic()
                if begin < self.end or self.done or remaining <= 0:
                    events, next_offset = self._collect(begin - first)
                    next_offset += first
                    if offset is None:
                        self.cursor = next_offset
                    return {
                        "events": events,
                        "next_offset": next_offset,
                        "first_offset": first,
                        "dropped": begin - start,  # fell out of the buffer before this read
                        "ended": self.done and next_offset == self.end,
                        "overflowed": self.overflowed,
                    }
                self.cond.wait(remaining)

    def _collect(self, index: int) -> tuple[list[Header], int]:
        """Buffered events from ``index`` on, up to MAX_ANSWER_BYTES; and the index after."""
        events: list[Header] = []
        room = MAX_ANSWER_BYTES
        for event, size in itertools.islice(self.events, index, None):
            if events and size > room:
                break
            events.append(event)
            room -= size
        return events, index + len(events)

    # ----------------------------------------------------------------------- ending

    def start(self) -> None:
        thread = threading.Thread(target=self.run, name=f"watch-{self.wid}", daemon=True)
        start_thread(thread)
        self.thread = thread  # only once it runs: it closes the descriptors when it ends

    def stop(self) -> None:
        """Ask the thread to end (it closes the descriptors); at once, never blocking."""
        self.stopping = True
        with self.fd_lock:
            if self.closed:
                return
            try:
                os.write(self.stop_w, b"x")
            except BlockingIOError:  # asked before
                pass

    def _close(self) -> None:
        """Close the inotify instance (dropping its watches) and the stop pipe; once."""
        with self.fd_lock:
            if self.closed:
                return
            self.closed = True
            for fd in (self.fd, self.stop_r, self.stop_w):
                try:
                    os.close(fd)
                except OSError:
                    pass


class Watches:
    """The directory watches of one agent, and the requests on them."""

    def __init__(self, roots: paths.Roots) -> None:
        self._roots = roots
        self._inotify: Inotify | None = None
        self._lock = threading.RLock()  # re-entered when a signal arrives during shutdown
        self._watchers: dict[str, Watcher] = {}
        self._starting = 0  # watch_start requests admitted and still walking their tree
        self._next = 0
        self._closing = False

    def handle(self, op: str, req: Header, payload: bytes) -> tuple[Header, bytes]:
        if op == "watch_start":
            return self._start(req), b""
        if op == "watch_read":
            return self._read(req), b""
        if op == "watch_stop":
            return self._stop(req), b""
        raise AgentError("invalid_request", f"unknown op {op!r}")

    def shutdown(self) -> None:
        """Stop every watcher (the agent is exiting); never waits for their threads."""
        got = self._lock.acquire(timeout=2.0)
        try:
            self._closing = True
            watchers = list(self._watchers.values())
        finally:
            if got:
                self._lock.release()
        for watcher in watchers:
            watcher.stop()

    def _start(self, req: Header) -> Header:
        target = paths.resolve(self._roots, req.get("path"), follow=True)
        recursive = bool_field(req, "recursive", False)
        if not stat.S_ISDIR(os.stat(target.real).st_mode):  # a missing path: not_found
            raise AgentError("not_a_directory", f"{target.spath} is not a directory")
        with self._lock:
            if self._inotify is None:
                self._inotify = Inotify()
            inotify = self._inotify
            self._admit()
            self._starting += 1
            self._next += 1
            wid = f"w{self._next}"
        watcher: Watcher | None = None
        try:
            watcher = Watcher(wid, target, inotify, recursive)
            watcher.watch_tree("", created=False, initial=True)
            watcher.start()
        except BaseException as exc:
            if watcher is not None:
                watcher._close()
            if isinstance(exc, _Limit):
                raise AgentError(exc.code, exc.message) from None
            raise
        finally:
            with self._lock:
                self._starting -= 1
                if watcher is not None and watcher.thread is not None:
                    self._watchers[wid] = watcher
                closing = self._closing
        if closing:
            assert watcher is not None
            watcher.stop()
            raise AgentError("io_error", "the agent is shutting down")
        return {"watch": wid}

    def _admit(self) -> None:
        """Make room for one more (lock held): forget the oldest ended one, or refuse."""
        if self._closing:
            raise AgentError("io_error", "the agent is shutting down")
        if len(self._watchers) + self._starting < MAX_WATCHERS:
            return
        ended = [w for w in self._watchers.values() if w.done]
        if not ended:
            raise AgentError(
                "limit_exceeded",
                f"too many directory watches: {MAX_WATCHERS} are active (the limit); "
                "stop one first",
            )
        oldest = min(ended, key=lambda watcher: watcher.ended_at)
        del self._watchers[oldest.wid]

    def _watcher(self, req: Header) -> Watcher:
        wid = str_field(req, "watch")
        with self._lock:
            watcher = self._watchers.get(wid)
        if watcher is None:
            raise AgentError("not_found", f"no directory watch {wid!r}")
        return watcher

    def _read(self, req: Header) -> Header:
        watcher = self._watcher(req)
        offset = req.get("offset")
        if offset is not None and (
            not isinstance(offset, int) or isinstance(offset, bool) or offset < 0
        ):
            raise AgentError("invalid_request", "'offset' must be an integer >= 0 or absent")
        wait = req.get("wait")
        if wait is None:
            wait = 0.0
        if not _is_number(wait) or not 0 <= wait <= MAX_WAIT:
            raise AgentError(
                "invalid_request", f"'wait' must be a number of seconds from 0 to {MAX_WAIT:g}"
            )
        return watcher.read(offset, float(wait))

    def _stop(self, req: Header) -> Header:
        wid = str_field(req, "watch")
        with self._lock:
            watcher = self._watchers.pop(wid, None)
        if watcher is None:
            raise AgentError("not_found", f"no directory watch {wid!r}")
        watcher.stop()
        if watcher.thread is not None:
            watcher.thread.join(STOP_JOIN_SECONDS)
        return {}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
