"""The agent inside every sandbox: request frames on stdin, response frames on stdout.

The protocol (operations, path rules, error codes) is specified in docs/agent-protocol.md; the
wire format is frames.py. The file is deployed as /opt/sandgate/agent.py next to frames.py and
run by the sandbox's system Python with the standard library only:

    /usr/bin/python3 -I -S /opt/sandgate/agent.py --workspace /workspace --tmp /tmp

Startup is on the sandbox-create latency path and one agent idles in every sandbox, so only
cheap modules are imported here; subprocess, selectors, shutil and procs.py (background
processes and terminals) are imported on first use and ctypes (malloc tuning) just after the
ready event.
Each request runs on a daemon thread of its own, except that the operations on one handle run
one after another in arrival order; stderr is the agent's log.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
import signal
import stat
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple, cast

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable
    from types import FrameType

    from sandgate.agent import frames, procs
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import frames

PROTOCOL_VERSION = 1
EXEC_OUTPUT_CAP = 1 << 20  # bytes kept of each of stdout and stderr
EXEC_PATH = "/usr/local/bin:/usr/bin:/bin"
EXEC_DEFAULT_TIMEOUT = 30.0
EXEC_EXIT_GRACE = 0.1  # seconds of output still read after the command itself exited
EXEC_TIMEOUT_EXIT_CODE = 124
INLINE_CODE_BYTES = 64 << 10  # larger programs are read from a pipe, not argv
READ_CHUNK = 64 << 10
MAX_READ_LENGTH = 4 << 20
MAX_HANDLES = 64
HANDLE_IDLE_SECONDS = 300.0
# Room left in a response header for everything but exec's stdout and stderr.

Header = dict[str, Any]

SANDBOX_ROOTS = ("/workspace", "/tmp")

_INTERPRETERS = {"bash": ("bash", "-c"), "sh": ("sh", "-c"), "python": ("python3", "-c")}

_ERRNO_CODES = {
    errno.ENOENT: "not_found",
    errno.ENOTDIR: "not_a_directory",
    errno.EISDIR: "is_a_directory",
    errno.EEXIST: "exists",
    errno.ENOTEMPTY: "directory_not_empty",
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.EROFS: "permission_denied",
    errno.EINVAL: "invalid_request",
    errno.ENAMETOOLONG: "invalid_request",
    errno.ENOSPC: "storage_full",  # the worker names the sandbox's quota
    errno.EDQUOT: "storage_full",
}


class AgentError(Exception):
    """A request failed with one of the protocol's error codes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# --------------------------------------------------------------------------- state

_roots: list[tuple[str, str]] = []  # (sandbox root, real directory), set by main()
_sandbox_env: dict[str, str] = {}  # the agent's own environment at start
_write_lock = threading.Lock()
_groups_lock = threading.RLock()  # re-entered when a signal arrives during shutdown
_groups: set[int] = set()  # process groups started by exec, possibly still alive
_closing = False
_which_cache: dict[str, str] = {}


def _log(message: str) -> None:
    try:
        sys.stderr.write(f"sandgate-agent[{os.getpid()}]: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _write_frame(data: bytes) -> None:
    out = sys.stdout.buffer
    with _write_lock:
        try:
            out.write(data)
            out.flush()
        except (OSError, ValueError) as exc:  # the worker is gone; stdin EOF follows
            _log(f"cannot write a response: {exc}")


# --------------------------------------------------------------------------- fields


def _str_field(req: Header, name: str, default: str | None = None) -> str:
    value = req.get(name)
    if value is None:
        value = default
    if not isinstance(value, str):
        raise AgentError("invalid_request", f"{name!r} must be a string")
    return value


def _bool_field(req: Header, name: str, default: bool | None = None) -> bool:
    value = req.get(name)
    if value is None:
        value = default
    if not isinstance(value, bool):
        raise AgentError("invalid_request", f"{name!r} must be a boolean")
    return value


def _int_field(req: Header, name: str) -> int:
    value = req.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise AgentError("invalid_request", f"{name!r} must be an integer")
    return value


# --------------------------------------------------------------------------- paths


class Target(NamedTuple):
    """A checked path: its sandbox view and where it really is."""

    spath: str  # normalised, as the sandbox sees it (/workspace/...)
    real: str  # the path to use with the OS
    root: str  # real directory of the root it is under
    is_root: bool


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _outside(value: str) -> AgentError:
    return AgentError("path_outside_sandbox", f"{value!r} is outside the sandbox's filesystem")


def _resolve(value: Any, *, follow: bool = False, name: str = "path") -> Target:
    """Map a sandbox path onto the real filesystem, refusing anything that leaves a root.

    Every component but the last is resolved (symlinks followed) and must stay inside the
    root. The last one is followed only when ``follow`` is true (open, list, cwd); otherwise
    a symlink there is the object itself (stat, remove, move, mkdir).
    """
    if not isinstance(value, str) or not value:
        raise AgentError("invalid_request", f"{name!r} must be a non-empty string")
    if "\x00" in value:
        raise AgentError("invalid_request", f"{name!r} contains a NUL byte")
    if not value.startswith("/"):
        value = "/workspace/" + value
    spath = posixpath.normpath(value)
    if spath.startswith("//"):
        spath = "/" + spath.lstrip("/")
    for sroot, rroot in _roots:
        if spath == sroot:
            return Target(spath, rroot, rroot, True)
        if spath.startswith(sroot + "/"):
            break
    else:
        raise _outside(value)
    real = posixpath.join(rroot, spath[len(sroot) + 1 :])
    parent = os.path.realpath(posixpath.dirname(real))
    if not _inside(parent, rroot):
        raise _outside(value)
    real = posixpath.join(parent, posixpath.basename(real))
    if follow and os.path.islink(real):
        real = os.path.realpath(real)
        if not _inside(real, rroot):
            raise _outside(value)
    return Target(spath, real, rroot, False)


def _to_sandbox(real: str) -> str:
    """The sandbox view of a real path, for error messages (never leaks host paths)."""
    for sroot, rroot in _roots:
        if _inside(real, rroot):
            return sroot + real[len(rroot) :]
    return posixpath.basename(real)


def _os_error(exc: OSError) -> AgentError:
    code = _ERRNO_CODES.get(exc.errno or 0, "io_error")
    message = exc.strerror or str(exc)
    for filename in (exc.filename, exc.filename2):
        if isinstance(filename, str):
            message += f": {_to_sandbox(filename)}"
    return AgentError(code, message)


def _iso_mtime(mtime_ns: int) -> str:
    seconds, nanos = divmod(mtime_ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{nanos // 1000:06d}Z"


def _entry(spath: str, st: os.stat_result) -> Header:
    mode = st.st_mode
    if stat.S_ISREG(mode):
        kind = "file"
    elif stat.S_ISDIR(mode):
        kind = "dir"
    elif stat.S_ISLNK(mode):
        kind = "symlink"
    else:
        kind = "other"
    return {
        "name": posixpath.basename(spath),
        "path": spath,
        "type": kind,
        "size": st.st_size,
        "mode": f"{stat.S_IMODE(mode):04o}",
        "mtime": _iso_mtime(st.st_mtime_ns),
    }


def _lstat(target: Target) -> os.stat_result | None:
    try:
        return os.lstat(target.real)
    except FileNotFoundError:
        return None


def _lstat_entry(target: Target) -> Header:
    return _entry(target.spath, os.lstat(target.real))


# --------------------------------------------------------------------------- file ops


def op_ping(req: Header, payload: bytes) -> tuple[Header, bytes]:
    return {}, b""


def op_stat(req: Header, payload: bytes) -> tuple[Header, bytes]:
    return {"entry": _lstat_entry(_resolve(req.get("path")))}, b""


def op_list(req: Header, payload: bytes) -> tuple[Header, bytes]:
    target = _resolve(req.get("path"), follow=True)
    prefix = target.spath.rstrip("/") + "/"
    entries = []
    with os.scandir(target.real) as it:
        for item in it:
            try:
                st = item.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed meanwhile
                continue
            entries.append(_entry(prefix + item.name, st))
    entries.sort(key=lambda entry: entry["name"])
    return {"entries": entries}, b""


def op_mkdir(req: Header, payload: bytes) -> tuple[Header, bytes]:
    target = _resolve(req.get("path"))
    parents = _bool_field(req, "parents", True)
    st = _lstat(target)
    if st is not None:
        if stat.S_ISDIR(st.st_mode) and parents:
            return {"entry": _entry(target.spath, st)}, b""
        raise AgentError("exists", f"{target.spath} already exists")
    if parents:
        try:
            os.makedirs(target.real)
        except FileExistsError:  # created meanwhile (a file in a parent gives ENOTDIR)
            if not os.path.isdir(target.real):
                raise AgentError("exists", f"{target.spath} already exists") from None
    else:
        os.mkdir(target.real)
    return {"entry": _lstat_entry(target)}, b""


def op_move(req: Header, payload: bytes) -> tuple[Header, bytes]:
    src = _resolve(req.get("src"), name="src")
    dst = _resolve(req.get("dst"), name="dst")
    overwrite = _bool_field(req, "overwrite", False)
    if src.is_root or dst.is_root:
        raise AgentError("invalid_request", "a sandbox root cannot be moved or replaced")
    if _lstat(src) is None:
        raise AgentError("not_found", f"{src.spath} does not exist")
    if not overwrite and _lstat(dst) is not None:
        raise AgentError("exists", f"{dst.spath} already exists")
    try:
        os.rename(src.real, dst.real)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        _move_across_filesystems(src, dst)
    return {"entry": _lstat_entry(dst)}, b""


def _move_across_filesystems(src: Target, dst: Target) -> None:
    """rename(2) cannot cross mounts (/tmp and /workspace may be two): copy, then remove."""
    import shutil

    src_st = os.lstat(src.real)
    dst_st = _lstat(dst)
    if stat.S_ISDIR(src_st.st_mode):
        if dst_st is not None:
            if not stat.S_ISDIR(dst_st.st_mode):
                raise AgentError("not_a_directory", f"{dst.spath} is not a directory")
            os.rmdir(dst.real)  # like rename(2): only an empty directory is replaced
        shutil.copytree(src.real, dst.real, symlinks=True)
        shutil.rmtree(src.real)
        return
    if dst_st is not None and stat.S_ISDIR(dst_st.st_mode):
        raise AgentError("is_a_directory", f"{dst.spath} is a directory")
    temp = _temp_name(dst.real)
    try:
        shutil.copy2(src.real, temp, follow_symlinks=False)
        os.rename(temp, dst.real)
    except BaseException:
        _unlink_quietly(temp)
        raise
    os.unlink(src.real)


def op_remove(req: Header, payload: bytes) -> tuple[Header, bytes]:
    target = _resolve(req.get("path"))
    recursive = _bool_field(req, "recursive", False)
    if target.is_root:
        raise AgentError("invalid_request", f"{target.spath} is a sandbox root")
    st = os.lstat(target.real)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(target.real)  # a symlink is unlinked, never its target
    elif recursive:
        import shutil

        shutil.rmtree(target.real)  # does not follow symlinks
    else:
        os.rmdir(target.real)
    return {}, b""


# --------------------------------------------------------------------------- handles


class _Handle:
    __slots__ = ("closed", "fd", "kind", "lock", "spath", "target", "temp", "used")

    def __init__(self, kind: str, fd: int, spath: str, target: str = "", temp: str = "") -> None:
        self.kind = kind  # "read" or "write"
        self.fd = fd
        self.spath = spath
        self.target = target  # write: real path renamed onto at commit
        self.temp = temp  # write: real path of the temp file
        self.lock = threading.Lock()
        self.used = time.monotonic()
        self.closed = False

    def close(self, *, discard: bool) -> None:
        """Close the fd (once); with ``discard`` a write handle's temp file is removed."""
        if not self.closed:
            self.closed = True
            try:
                os.close(self.fd)
            finally:
                if discard and self.temp:
                    _unlink_quietly(self.temp)


_handles: dict[int, _Handle] = {}
_handles_lock = threading.Lock()
_next_handle = 0


def _register(handle: _Handle) -> int:
    global _next_handle
    now = time.monotonic()
    with _handles_lock:
        idle = [hid for hid, h in _handles.items() if now - h.used > HANDLE_IDLE_SECONDS]
        expired = [_handles.pop(hid) for hid in idle]
        full = len(_handles) >= MAX_HANDLES
        if not full:
            _next_handle += 1
            hid = _next_handle
            _handles[hid] = handle
    for old in expired:
        with old.lock:
            old.close(discard=True)
    if full:
        handle.close(discard=True)
        raise AgentError("io_error", f"too many open handles (at most {MAX_HANDLES})")
    return hid


def _lookup(req: Header, kind: str, *, pop: bool = False) -> _Handle:
    hid = _int_field(req, "handle")
    with _handles_lock:
        handle = _handles.pop(hid, None) if pop else _handles.get(hid)
    if handle is None:
        raise AgentError("not_found", f"no open handle {hid}")
    if handle.kind != kind:
        if pop:
            with _handles_lock:
                _handles[hid] = handle
        raise AgentError("invalid_request", f"handle {hid} is not a {kind} handle")
    handle.used = time.monotonic()
    return handle


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _temp_name(target_real: str) -> str:
    directory, name = posixpath.split(target_real)
    return posixpath.join(directory, f".{name[:200]}.sandgate-{os.urandom(6).hex()}")


def _open_nofollow(target: Target, flags: int, mode: int = 0o644) -> int:
    try:
        return os.open(target.real, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the last component became a symlink after resolving
            raise _outside(target.spath) from None
        raise


def op_open_read(req: Header, payload: bytes) -> tuple[Header, bytes]:
    target = _resolve(req.get("path"), follow=True)
    # O_NONBLOCK so that a FIFO cannot hang the request; only regular files are served.
    fd = _open_nofollow(target, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise AgentError("is_a_directory", f"{target.spath} is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise AgentError("invalid_request", f"{target.spath} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    hid = _register(_Handle("read", fd, target.spath))
    return {"handle": hid, "size": st.st_size}, b""


def op_read(req: Header, payload: bytes) -> tuple[Header, bytes]:
    handle = _lookup(req, "read")
    length = _int_field(req, "length")
    if not 0 < length <= MAX_READ_LENGTH:
        raise AgentError("invalid_request", f"'length' must be between 1 and {MAX_READ_LENGTH}")
    chunks: list[bytes] = []
    remaining = length
    with handle.lock:
        if handle.closed:
            raise AgentError("not_found", "the handle was closed")
        while remaining:
            chunk = os.read(handle.fd, remaining)
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
    return {}, b"".join(chunks)


def op_close_read(req: Header, payload: bytes) -> tuple[Header, bytes]:
    handle = _lookup(req, "read", pop=True)
    with handle.lock:
        handle.close(discard=False)
    return {}, b""


def op_open_write(req: Header, payload: bytes) -> tuple[Header, bytes]:
    target = _resolve(req.get("path"), follow=True)
    if target.is_root or os.path.isdir(target.real):
        raise AgentError("is_a_directory", f"{target.spath} is a directory")
    directory = posixpath.dirname(target.real)
    try:
        os.makedirs(directory, exist_ok=True)
    except FileExistsError:
        raise AgentError("not_a_directory", f"a parent of {target.spath} is a file") from None
    if not _inside(os.path.realpath(directory), target.root):  # swapped meanwhile
        raise _outside(target.spath)
    temp = _temp_name(target.real)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    hid = _register(_Handle("write", fd, target.spath, target.real, temp))
    return {"handle": hid}, b""


def op_write(req: Header, payload: bytes) -> tuple[Header, bytes]:
    handle = _lookup(req, "write")
    view = memoryview(payload)
    with handle.lock:
        if handle.closed:
            raise AgentError("not_found", "the handle was closed")
        while view:
            view = view[os.write(handle.fd, view) :]
    return {"written": len(payload)}, b""


def op_close_write(req: Header, payload: bytes) -> tuple[Header, bytes]:
    commit = _bool_field(req, "commit")
    handle = _lookup(req, "write", pop=True)
    with handle.lock:
        try:
            handle.close(discard=False)
            if not commit:
                return {}, b""
            if os.path.isdir(handle.target):
                raise AgentError("is_a_directory", f"{handle.spath} is a directory")
            os.rename(handle.temp, handle.target)
        finally:
            _unlink_quietly(handle.temp)  # nothing left once renamed
        return {"entry": _entry(handle.spath, os.lstat(handle.target))}, b""


# --------------------------------------------------------------------------- exec


class _Capture:
    """One output stream: the first EXEC_OUTPUT_CAP bytes are kept, the rest dropped."""

    __slots__ = ("data", "truncated")

    def __init__(self) -> None:
        self.data = bytearray()
        self.truncated = False

    def add(self, chunk: bytes) -> None:
        room = EXEC_OUTPUT_CAP - len(self.data)
        if len(chunk) > room:
            self.truncated = True
            chunk = chunk[:room]
        self.data += chunk


def _which(name: str) -> str:
    found = _which_cache.get(name)
    if found is None:
        for directory in EXEC_PATH.split(":"):
            candidate = f"{directory}/{name}"
            if os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
                found = _which_cache[name] = candidate
                break
        else:
            raise AgentError("not_found", f"{name} is not installed in this sandbox")
    return found


def _exec_timeout(req: Header) -> float:
    value = req.get("timeout")
    if value is None:
        return EXEC_DEFAULT_TIMEOUT
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not 0 < value < float("inf")
    ):
        raise AgentError("invalid_request", "'timeout' must be a positive number of seconds")
    return float(value)


def _exec_env(req: Header) -> dict[str, str]:
    extra = req.get("env")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise AgentError("invalid_request", "'env' must be an object of strings")
    for key, value in extra.items():
        if not isinstance(value, str) or not key or "=" in key or "\x00" in key or "\x00" in value:
            raise AgentError("invalid_request", f"invalid environment variable {key!r}")
    home = _roots[0][1]
    return {"PATH": EXEC_PATH, "HOME": home, "LANG": "C.UTF-8", **_sandbox_env, **extra}


def _exec_cwd(req: Header) -> str:
    target = _resolve(_str_field(req, "cwd", "/workspace"), follow=True, name="cwd")
    st = os.stat(target.real)
    if not stat.S_ISDIR(st.st_mode):
        raise AgentError("not_a_directory", f"cwd {target.spath} is not a directory")
    return target.real


def op_exec(req: Header, payload: bytes) -> tuple[Header, bytes]:
    language = _str_field(req, "language")
    interpreter = _INTERPRETERS.get(language)
    if interpreter is None:
        raise AgentError("invalid_request", f"'language' must be one of {sorted(_INTERPRETERS)}")
    if "code" in req:
        code = _str_field(req, "code")
    else:  # large programs travel as the payload, UTF-8
        try:
            code = payload.decode("utf-8")
        except UnicodeDecodeError:
            raise AgentError("invalid_request", "the code payload is not UTF-8") from None
        if not code:
            raise AgentError("invalid_request", "'code' is empty")
    if "\x00" in code:
        raise AgentError("invalid_request", "'code' contains a NUL byte")
    timeout = _exec_timeout(req)
    env = _exec_env(req)
    cwd = _exec_cwd(req)
    program = _which(interpreter[0])
    if len(code.encode()) <= INLINE_CODE_BYTES:
        return _run([program, interpreter[1], code], cwd, env, timeout)
    # past the kernel's limit on one argument (128 KiB), the interpreter reads the program
    # from a pipe that a thread fills
    read_end, write_end = os.pipe()
    feeder = threading.Thread(target=_feed, args=(write_end, code.encode()), daemon=True)
    try:
        feeder.start()
        return _run([program, f"/dev/fd/{read_end}"], cwd, env, timeout, pass_fds=(read_end,))
    finally:
        os.close(read_end)


def _feed(fd: int, data: bytes) -> None:
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        pass  # the interpreter stopped reading (it exited or was killed)
    finally:
        os.close(fd)


def _spawn(
    argv: list[str], cwd: str, env: dict[str, str], pass_fds: tuple[int, ...] = ()
) -> subprocess.Popen[bytes]:
    import subprocess

    with _groups_lock:  # so that shutdown never misses a group being started
        if _closing:
            raise AgentError("io_error", "the agent is shutting down")
        _prune_groups()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,
            pass_fds=pass_fds,
        )
        _groups.add(proc.pid)
    return proc


def _prune_groups() -> None:
    """Forget groups with no process left, so that a recycled pid is never killed."""
    for pgid in list(_groups):
        try:
            os.killpg(pgid, 0)
        except OSError:  # ESRCH: gone; EPERM: the id now belongs to someone else
            _groups.discard(pgid)


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _run(
    argv: list[str], cwd: str, env: dict[str, str], timeout: float, pass_fds: tuple[int, ...] = ()
) -> tuple[Header, bytes]:
    started = time.monotonic()
    proc = _spawn(argv, cwd, env, pass_fds)
    out, err = _Capture(), _Capture()
    try:
        timed_out = _collect(proc, out, err, started + timeout)
    except BaseException:
        _killpg(proc.pid)
        raise
    finally:
        returncode = proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    duration_ms = (time.monotonic() - started) * 1000.0
    if timed_out:
        exit_code = EXEC_TIMEOUT_EXIT_CODE
    elif returncode < 0:  # killed by a signal: report it the way a shell does
        exit_code = 128 - returncode
    else:
        exit_code = returncode
    # the output travels as raw bytes in the payload (stdout then stderr): no JSON escaping,
    # no header size limit; the receiver splits it at stdout_bytes
    header = {
        "exit_code": exit_code,
        "duration_ms": round(duration_ms, 3),
        "timed_out": timed_out,
        "stdout_bytes": len(out.data),
        "stdout_truncated": out.truncated,
        "stderr_truncated": err.truncated,
    }
    return header, bytes(out.data) + bytes(err.data)


def _collect(proc: subprocess.Popen[bytes], out: _Capture, err: _Capture, deadline: float) -> bool:
    """Read both pipes until the command exits (plus a grace period) or the deadline.

    Returns whether the deadline killed the process group. A pidfd wakes the loop when the
    command exits; without one (old kernel, seccomp) the loop polls every 50 ms.
    """
    import selectors

    assert proc.stdout is not None and proc.stderr is not None
    captures = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    selector = selectors.DefaultSelector()
    for fd in captures:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    pidfd = _pidfd_open(proc.pid)
    if pidfd is not None:
        selector.register(pidfd, selectors.EVENT_READ)
    open_pipes = len(captures)
    exited_at: float | None = None
    timed_out = False
    try:
        while True:
            now = time.monotonic()
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None:
                if not open_pipes or now >= exited_at + EXEC_EXIT_GRACE:
                    return timed_out
                wait = exited_at + EXEC_EXIT_GRACE - now
            elif not timed_out and now >= deadline:
                _killpg(proc.pid)
                timed_out = True
                wait = 0.05
            else:
                wait = 0.05 if timed_out else deadline - now
            if pidfd is None:
                wait = min(wait, 0.05)
            for key, _events in selector.select(wait):
                fd = key.fd
                if fd == pidfd:
                    selector.unregister(fd)
                    os.close(fd)
                    pidfd = None  # exited: poll() above picks up the status
                    continue
                try:
                    chunk = os.read(fd, READ_CHUNK)
                except BlockingIOError:
                    continue
                if chunk:
                    captures[fd].add(chunk)
                else:
                    selector.unregister(fd)
                    open_pipes -= 1
    finally:
        selector.close()
        if pidfd is not None:
            os.close(pidfd)


def _pidfd_open(pid: int) -> int | None:
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        fd: int = pidfd_open(pid)
    except OSError:
        return None
    return fd


# --------------------------------------------------------------------------- procs

_PROC_OPS = (
    "proc_start",
    "proc_list",
    "proc_read",
    "proc_stdin",
    "proc_signal",
    "pty_open",
    "pty_read",
    "pty_write",
    "pty_resize",
    "pty_close",
)
_registry: procs.Registry | None = None  # created by the first proc_*/pty_* request
_registry_lock = threading.RLock()  # re-entered when a signal arrives during shutdown


def _proc_registry() -> procs.Registry:
    global _registry
    with _registry_lock:
        if _closing:
            raise AgentError("io_error", "the agent is shutting down")
        if _registry is None:
            module = __import__("procs")  # procs.py, next to this file
            _registry = cast(
                "procs.Registry",
                module.Registry(error=AgentError, env=_exec_env, cwd=_exec_cwd, which=_which),
            )
        return _registry


def op_procs(req: Header, payload: bytes) -> tuple[Header, bytes]:
    """Every proc_* and pty_* operation: see procs.py."""
    return _proc_registry().handle(str(req.get("op")), req, payload)


# --------------------------------------------------------------------------- dispatch

HANDLERS: dict[str, Callable[[Header, bytes], tuple[Header, bytes]]] = {
    "ping": op_ping,
    "exec": op_exec,
    "stat": op_stat,
    "list": op_list,
    "mkdir": op_mkdir,
    "move": op_move,
    "remove": op_remove,
    "open_write": op_open_write,
    "write": op_write,
    "close_write": op_close_write,
    "open_read": op_open_read,
    "read": op_read,
    "close_read": op_close_read,
    **dict.fromkeys(_PROC_OPS, op_procs),
}


def _serve(request_id: int, req: Header, payload: bytes) -> None:
    """Run one request on its own thread and write its response; never raises."""
    body = b""
    try:
        op = req.get("op")
        handler = HANDLERS.get(op) if isinstance(op, str) else None
        if handler is None:
            raise AgentError("invalid_request", f"unknown op {op!r}")
        fields, body = handler(req, payload)
        header: Header = {"id": request_id, "ok": True, **fields}
    except AgentError as exc:
        header = frames.error_header(request_id, exc.code, exc.message)
    except OSError as exc:
        error = _os_error(exc)
        header = frames.error_header(request_id, error.code, error.message)
    except Exception as exc:
        _log(f"request {request_id} failed: {exc!r}")
        header = frames.error_header(request_id, "io_error", f"{type(exc).__name__}: {exc}")
    try:
        data = frames.encode(header, body)
    except (frames.FrameError, TypeError, ValueError) as exc:
        message = f"the response cannot be sent: {exc}"
        data = frames.encode(frames.error_header(request_id, "io_error", message))
    _write_frame(data)


# Operations on one handle run in arrival order (a worker may pipeline the writes of an
# upload), and so do the writes to one background process or terminal (typed keys): they go
# through a per-handle or per-pid queue drained by one thread at a time.
_HANDLE_OPS = frozenset({"write", "read", "close_write", "close_read"})
_PID_OPS = frozenset({"proc_stdin", "pty_write", "pty_resize", "pty_close"})
_queues: dict[tuple[str, int], list[tuple[int, Header, bytes]]] = {}
_queues_lock = threading.Lock()


def _dispatch(request_id: int, req: Header, payload: bytes) -> None:
    """Called on the reading thread: start the request on a thread of its own."""
    op = req.get("op")
    field = "handle" if op in _HANDLE_OPS else "pid" if op in _PID_OPS else None
    value = req.get(field) if field is not None else None
    if field is None or not isinstance(value, int) or isinstance(value, bool):
        threading.Thread(target=_serve, args=(request_id, req, payload), daemon=True).start()
        return
    key = (field, value)
    with _queues_lock:
        queue = _queues.get(key)
        if queue is not None:  # a thread is draining this queue
            queue.append((request_id, req, payload))
            return
        _queues[key] = [(request_id, req, payload)]
    threading.Thread(target=_drain, args=(key,), daemon=True).start()


def _drain(key: tuple[str, int]) -> None:
    while True:
        with _queues_lock:
            queue = _queues[key]
            if not queue:
                del _queues[key]
                return
            item = queue.pop(0)
        _serve(*item)


def _shutdown(status: int) -> None:
    """Kill every process group started by exec or procs, drop unfinished uploads, exit."""
    global _closing
    with _groups_lock:
        _closing = True
        for pgid in list(_groups):
            _killpg(pgid)
    with _registry_lock:
        if _registry is not None:
            _registry.shutdown()
    with _handles_lock:
        for handle in _handles.values():
            if handle.temp:
                _unlink_quietly(handle.temp)
    try:
        sys.stderr.flush()
    finally:
        os._exit(status)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _log(f"signal {signum}: stopping")
    _shutdown(0)


def _fatal(message: str) -> None:
    """The worker broke the protocol: log an id-less error and exit non-zero."""
    _log(json.dumps(frames.error_header(None, "invalid_request", message)))
    _shutdown(2)


def _tune_malloc() -> None:
    """Keep an idle agent small after a burst of large requests (glibc only; best effort).

    By default glibc raises its mmap threshold each time a large block is freed, so the MiB
    buffers of exec output and file transfer end up in heaps that are never given back (an
    agent stayed at ~45 MiB after a few uploads instead of ~9 MiB). A fixed threshold keeps
    them mmap'ed and returned on free. Done in-process, not via MALLOC_* environment
    variables, which the commands run by exec would inherit.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        # Tenant code runs as our uid: non-dumpable, we cannot be ptraced, have our memory
        # or descriptors taken (/proc/<pid>/mem, pidfd_getfd) or our /proc/<pid>/fd read.
        if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
            _log(f"WARNING: prctl(PR_SET_DUMPABLE, 0) failed: errno {ctypes.get_errno()}")
        libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
        libc.mallopt(-8, 2)  # M_ARENA_MAX: not one heap per request thread
    except (ImportError, OSError, AttributeError) as exc:
        _log(f"malloc tuning unavailable: {exc}")


def _parse_args(argv: list[str]) -> dict[str, str]:
    """``--workspace DIR --tmp DIR`` (also ``--name=DIR``); argparse is too slow to import."""
    options: dict[str, str] = {}
    args = iter(argv)
    for arg in args:
        name, sep, value = arg.partition("=")
        if name not in ("--workspace", "--tmp"):
            raise ValueError(f"unknown argument {arg!r}")
        if not sep:
            value = next(args, "")
        if not value:
            raise ValueError(f"{name} needs a directory")
        options[name[2:]] = value
    for name in ("workspace", "tmp"):
        if name not in options:
            raise ValueError(f"--{name} is required")
        if not os.path.isdir(options[name]):
            raise ValueError(f"--{name} {options[name]!r} is not a directory")
    return options


def main(argv: list[str]) -> int:
    try:
        options = _parse_args(argv)
    except ValueError as exc:
        _log(f"usage: agent.py --workspace DIR --tmp DIR: {exc}")
        return 2
    for sroot, name in zip(SANDBOX_ROOTS, ("workspace", "tmp"), strict=True):
        _roots.append((sroot, os.path.realpath(options[name])))
    _sandbox_env.update(os.environ)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    ready = {"event": "ready", "pid": os.getpid(), "version": PROTOCOL_VERSION}
    _write_frame(frames.encode(ready))
    _tune_malloc()  # after the ready event (off the create latency path), before any request
    stdin = sys.stdin.buffer
    while True:
        try:
            frame = frames.read_frame(stdin)
        except (frames.FrameError, OSError) as exc:
            _fatal(f"malformed request frame: {exc}")
            return 2
        if frame is None:
            break
        req, payload = frame
        request_id = req.get("id")
        if not isinstance(request_id, int) or isinstance(request_id, bool):
            _fatal(f"request without an integer id: {req.get('op')!r}")
            return 2
        _dispatch(request_id, req, payload)
    _shutdown(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
