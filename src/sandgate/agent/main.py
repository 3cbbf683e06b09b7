"""The agent inside every sandbox: request frames on stdin, response frames on stdout.

The protocol (operations, path rules, error codes) is specified in docs/agent-protocol.md; the
wire format is frames.py. This file is deployed as /opt/sandgate/sandgate_agent.py, run by the
launcher agent.py next to it, beside the agent's other modules (see __init__.py), by the
sandbox's system Python with the standard library only:

    /usr/bin/python3 -I -S /opt/sandgate/agent.py --workspace /workspace --tmp /tmp

Here: the frame loop, dispatch onto threads, and the agent's start and exit. The operations
live in files.py (file operations and handles), execute.py (exec), procs.py (background
processes and terminals), watch.py (directory watches) and ports.py (connections to the
sandbox's ports, served by one thread of their own); everything the agent keeps in
memory is the one ``AgentState`` (state.py) made by main() and handed to every operation.

Startup is on the sandbox-create latency path and one agent idles in every sandbox, so only
cheap modules are imported here; subprocess, selectors, shutil, procs.py (with children.py
and output.py), watch.py and ports.py are imported on first use and ctypes (malloc tuning)
just after the ready event; no module of the agent imports `typing` when run (each names
``TYPE_CHECKING = False`` itself: typing was ~6 ms of a ~28 ms start). Each request runs on
a daemon thread of its own (threads.py keeps a few that served a request for the next
ones), except that the operations on one handle run one after another in arrival order and
port requests are served by the port loop; stderr is the agent's log.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
from functools import partial
from types import MappingProxyType

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    import select
    from collections.abc import Callable, Mapping
    from types import FrameType

    from sandgate.agent import execute, files, frames, paths, ports, pressure, procs, threads, watch
    from sandgate.agent.log import log
    from sandgate.agent.request import AgentError, Header, at_pids_limit
    from sandgate.agent.state import AgentState
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import execute
    import files
    import frames
    import paths
    import pressure
    import threads
    from log import log
    from request import AgentError, at_pids_limit
    from state import AgentState

PROTOCOL_VERSION = 1
# malloc (_tune_malloc): buffers up to this size come from the heap; each heap keeps this much
# free for the next request; at most this many heaps
HEAP_BUFFER_BYTES = 4 << 20
HEAP_KEPT_BYTES = 4 << 20
HEAPS = 2
OWED_SCAN_RETRY_MS = 20  # a scan owed by the reading thread waits this long for a spawn's end


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


def _registry(st: AgentState) -> procs.Registry:
    """The agent's processes and terminals, made (and procs.py imported) on first use."""
    with st.registry_lock:
        if st.closing:
            raise AgentError("io_error", "the agent is shutting down")
        if st.registry is None:
            module = __import__("procs")  # procs.py, next to this file
            st.registry = module.Registry(
                env=partial(execute.exec_env, st),
                cwd=partial(execute.exec_cwd, st),
                which=partial(execute.which, st),
                python=st.python,
                reaper=st.reaper,
                shells=st.warm,
            )
        return st.registry


def op_procs(st: AgentState, req: Header, payload: bytes) -> tuple[Header, bytes]:
    """Every proc_* and pty_* operation: see procs.py."""
    return _registry(st).handle(str(req.get("op")), req, payload)


# --------------------------------------------------------------------------- watches

_WATCH_OPS = ("watch_start", "watch_read", "watch_stop")


def _watches(st: AgentState) -> watch.Watches:
    """The agent's directory watches, made (and watch.py imported) on first use."""
    with st.watches_lock:
        if st.closing:
            raise AgentError("io_error", "the agent is shutting down")
        if st.watches is None:
            module = __import__("watch")  # watch.py, next to this file
            st.watches = module.Watches(st.roots)
        return st.watches


def op_watches(st: AgentState, req: Header, payload: bytes) -> tuple[Header, bytes]:
    """Every watch_* operation: see watch.py. watch_read long-polls on its own thread."""
    return _watches(st).handle(str(req.get("op")), req, payload)


# --------------------------------------------------------------------------- ports

_PORT_OPS = frozenset(("port_open", "port_write", "port_read", "port_shutdown", "port_close"))


def _ports(st: AgentState) -> ports.Ports:
    """The agent's connections to its sandbox's ports, made (and ports.py imported) on first
    use. Its one loop thread answers port requests itself (see ports.py)."""
    with st.ports_lock:
        if st.closing:
            raise AgentError("io_error", "the agent is shutting down")
        if st.ports is None:
            module = __import__("ports")  # ports.py, next to this file
            answer, fail = partial(_answer, st), partial(_fail, st)
            st.ports = module.Ports(answer, fail)
        return st.ports


def _submit_port(st: AgentState, request_id: int, op: str, req: Header, payload: bytes) -> None:
    """On the reading thread: hand a port_* request to the port loop, which answers it."""
    try:
        _ports(st).submit(request_id, op, req, payload)
    except AgentError as exc:
        _fail(st, request_id, exc.code, exc.message, exc.details)
    except OSError as exc:  # the loop's pipe or selector: no descriptor left
        error = paths.os_error(st.roots, exc)
        _fail(st, request_id, error.code, error.message)


def _answer(st: AgentState, request_id: int, fields: Header, body: bytes) -> None:
    _write_frame(st, frames.encode({"id": request_id, "ok": True, **fields}, body))


def _fail(
    st: AgentState, request_id: int, code: str, message: str, details: Header | None = None
) -> None:
    _write_frame(st, frames.encode(frames.error_header(request_id, code, message, details)))


def op_ping(st: AgentState, req: Header, payload: bytes) -> tuple[Header, bytes]:
    return {}, b""


def op_configure(st: AgentState, req: Header, payload: bytes) -> tuple[Header, bytes]:
    """A pooled sandbox handed out: the create's environment, for every command from now on."""
    env = req.get("env") or {}
    if not isinstance(env, dict):
        raise AgentError("invalid_request", "'env' must be an object of strings")
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\x00" in key:
            raise AgentError("invalid_request", f"invalid environment variable {key!r}")
        if not isinstance(value, str) or "\x00" in value:
            raise AgentError("invalid_request", f"invalid value of {key!r}")
    st.sandbox_env.update(env)
    return {}, b""


# --------------------------------------------------------------------------- dispatch

HANDLERS: Mapping[str, Callable[[AgentState, Header, bytes], tuple[Header, bytes]]]
HANDLERS = MappingProxyType(
    {
        "ping": op_ping,
        "configure": op_configure,
        "exec": execute.op_exec,
        "stat": files.op_stat,
        "list": files.op_list,
        "mkdir": files.op_mkdir,
        "move": files.op_move,
        "remove": files.op_remove,
        "open_write": files.op_open_write,
        "write": files.op_write,
        "close_write": files.op_close_write,
        "open_read": files.op_open_read,
        "read": files.op_read,
        "close_read": files.op_close_read,
        **dict.fromkeys(_PROC_OPS, op_procs),
        **dict.fromkeys(_WATCH_OPS, op_watches),
    }
)


def _write_frame(st: AgentState, data: bytes, payload: bytes = b"") -> None:
    """Write a frame: `data`, then `payload` if given (a large payload goes apart from its
    head, not copied behind it: frames.encode_head)."""
    out = sys.stdout.buffer
    with st.write_lock:
        try:
            out.write(data)
            if payload:
                out.write(payload)
            out.flush()
        except (OSError, ValueError) as exc:  # the worker is gone; stdin EOF follows
            log(f"cannot write a response: {exc}")


_SHELL_OPS = frozenset({"exec", "proc_start"})  # may run a shell command (warm.py)


def _serve(st: AgentState, request_id: int, req: Header, payload: bytes) -> None:
    """Run one request on its own thread and write its response; never raises."""
    body = b""
    try:
        op = req.get("op")
        handler = HANDLERS.get(op) if isinstance(op, str) else None
        if handler is None:
            raise AgentError("invalid_request", f"unknown op {op!r}")
        fields, body = handler(st, req, payload)
        header: Header = {"id": request_id, "ok": True, **fields}
    except AgentError as exc:
        header = frames.error_header(request_id, exc.code, exc.message, exc.details)
    except OSError as exc:
        error = paths.os_error(st.roots, exc)
        header = frames.error_header(request_id, error.code, error.message)
    except Exception as exc:
        log(f"request {request_id} failed: {exc!r}")
        header = frames.error_header(request_id, "io_error", f"{type(exc).__name__}: {exc}")
    try:
        data, tail = frames.encode_parts(header, body)
    except (frames.FrameError, TypeError, ValueError) as exc:
        message = f"the response cannot be sent: {exc}"
        data, tail = frames.encode(frames.error_header(request_id, "io_error", message)), b""
    _write_frame(st, data, tail)
    if isinstance(op, str) and op in _SHELL_OPS:  # off the reply's path: the next shell
        execute.start_warm(st)


# Operations on one handle run in arrival order (a worker may pipeline the writes of an
# upload), and so do the writes to one background process or terminal (typed keys): they go
# through a per-handle or per-pid queue (AgentState.queues) drained by one thread at a time.
_HANDLE_OPS = frozenset({"write", "read", "close_write", "close_read"})
_PID_OPS = frozenset({"proc_stdin", "pty_write", "pty_resize", "pty_close"})


def _dispatch(st: AgentState, request_id: int, req: Header, payload: bytes) -> None:
    """Called on the reading thread: start the request on a thread of its own (an idle
    one of ``st.threads`` if any)."""
    op = req.get("op")
    if not isinstance(op, str):  # refused by _serve; a set lookup would raise if unhashable
        op = ""
    if op in _PORT_OPS:  # no thread of its own: the port loop serves it (ports.py)
        _submit_port(st, request_id, op, req, payload)
        return
    field = "handle" if op in _HANDLE_OPS else "pid" if op in _PID_OPS else None
    value = req.get(field) if field is not None else None
    if field is None or not isinstance(value, int) or isinstance(value, bool):
        if not st.threads.run(_serve, st, request_id, req, payload):
            _no_thread(st, request_id, req, payload)
        return
    key = (field, value)
    with st.queues_lock:
        queue = st.queues.get(key)
        if queue is not None:  # a thread is draining this queue
            queue.append((request_id, req, payload))
            return
        st.queues[key] = [(request_id, req, payload)]
    if not st.threads.run(_drain, st, key):
        with st.queues_lock:
            refused = st.queues.pop(key, [])
        for queued in refused:  # only this request: the queue was new
            _no_thread(st, *queued)


# What ends processes, the way a sandbox at its pids limit gets its pids back: served on the
# reading thread itself when no thread can take it. A signal never blocks; the locks these
# take are held by other threads for a look-up, a signal or a spawn (at most its start
# timeout), never while waiting on the reading thread, so the wait is bounded.
_ENDING_OPS = frozenset({"proc_signal", "pty_close"})


def _no_thread(st: AgentState, request_id: int, req: Header, payload: bytes) -> None:
    """No thread could take the request (the sandbox's processes hold its pids limit): one
    that ends processes is served here; any other is refused at once, never waited for."""
    op = req.get("op")
    if isinstance(op, str) and op in _ENDING_OPS:
        _serve(st, request_id, req, payload)
        return
    exc = at_pids_limit()
    _fail(st, request_id, exc.code, exc.message, exc.details)


def _drain(st: AgentState, key: tuple[str, int]) -> None:
    while True:
        with st.queues_lock:
            queue = st.queues[key]
            if not queue:
                del st.queues[key]
                return
            item = queue.pop(0)
        _serve(st, *item)


# --------------------------------------------------------------------------- start and exit


def _shutdown(st: AgentState, status: int) -> None:
    """Kill every process group started by exec or procs, stop every directory watch, drop
    unfinished uploads, exit."""
    execute.stop(st)
    with st.registry_lock:
        if st.registry is not None:
            st.registry.shutdown()
    with st.watches_lock:
        if st.watches is not None:
            st.watches.shutdown()
    with st.ports_lock:
        if st.ports is not None:
            st.ports.shutdown()
    files.drop_uploads(st)
    try:
        sys.stderr.flush()
    finally:
        os._exit(status)


def _on_signal(st: AgentState, signum: int, frame: FrameType | None) -> None:
    log(f"signal {signum}: stopping")
    _shutdown(st, 0)


def _fatal(st: AgentState, message: str) -> None:
    """The worker broke the protocol: log an id-less error and exit non-zero."""
    log(json.dumps(frames.error_header(None, "invalid_request", message)))
    _shutdown(st, 2)


def _tune_malloc(st: AgentState) -> None:
    """Reuse the memory of large requests while they come, give it back once idle (glibc
    only; best effort).

    By default glibc raises its mmap threshold each time a large block is freed, so the MiB
    buffers of exec output and file transfer end up in heaps that are never given back (an
    agent stayed at ~45 MiB after a few uploads instead of ~9 MiB). Forcing such buffers to be
    mmap'ed (a 128 KiB threshold, until session 14) gave them back on free, but then every
    buffer was new memory: ~0.3 ms of page faults per MiB inside a sandbox, several per file
    transferred (docs/benchmarks.md, "Session 14"). Now buffers up to 4 MiB (a file chunk, a
    frame, an exec's output) come from the heap, which keeps up to 4 MiB free for the next
    request, and a request thread that ends after its idle wait (threads.py) trims the
    heaps back (``malloc_trim``). Done in-process, not via MALLOC_* environment variables,
    which the commands run by exec would inherit.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        # Tenant code runs as our uid: non-dumpable, we cannot be ptraced, have our memory
        # or descriptors taken (/proc/<pid>/mem, pidfd_getfd) or our /proc/<pid>/fd read.
        if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
            log(f"WARNING: prctl(PR_SET_DUMPABLE, 0) failed: errno {ctypes.get_errno()}")
        libc.mallopt(-3, HEAP_BUFFER_BYTES)  # M_MMAP_THRESHOLD (fixed: never raised past)
        libc.mallopt(-1, HEAP_KEPT_BYTES)  # M_TRIM_THRESHOLD
        libc.mallopt(-8, HEAPS)  # M_ARENA_MAX: not one heap per request thread
        trim: Callable[[], object] | None = partial(libc.malloc_trim, 0)
    except (ImportError, OSError, AttributeError) as exc:
        log(f"malloc tuning unavailable: {exc}")
        trim = None
    st.threads.on_idle = partial(_on_idle, st, trim)


def _on_idle(st: AgentState, trim: Callable[[], object] | None) -> None:
    """A request thread waited `threads.IDLE_SECONDS` for a request and ends: the shell
    waiting for the next command ends too if none came as long (warm.py), and the heaps give
    their free memory back."""
    st.warm.expire(threads.IDLE_SECONDS)
    if trim is not None:
        trim()


def _wait_for_request(st: AgentState, poller: select.poll) -> None:
    """Until the request pipe has bytes (or its end): a SIGCHLD meanwhile has a thread scan
    for orphans (orphans.py), or this one when none can start (the zombies hold the pids a
    thread would need), as soon as no spawn is under way. `poller` watches both
    (`_request_poller`)."""
    while True:
        ready = dict(poller.poll(OWED_SCAN_RETRY_MS if st.reaper.owed else None))
        if st.reaper.wake_fd in ready:
            st.reaper.woken(st.threads.run)
        if st.reaper.owed:
            st.reaper.reap_if_free()
        if 0 in ready:
            return


def _request_poller(st: AgentState) -> select.poll:
    """One poll set of the request pipe and the reaper's wake-up byte, for every wait."""
    import select

    poller = select.poll()
    poller.register(0, select.POLLIN)
    poller.register(st.reaper.wake_fd, select.POLLIN)
    return poller


def _parse_args(argv: list[str]) -> dict[str, str]:
    """``--workspace DIR --tmp DIR [--root /] [--cwd DIR]`` (also ``--name=DIR``); argparse
    is too slow to import. ``--root /``: the whole root is the sandbox's own (a template's
    copy-on-write root), so paths anywhere in it are served; ``--cwd``: where commands
    start by default (a template's WorkingDir); ``--loader L --library-path D``: the agent
    runs on a Python started by that dynamic loader (a template sandbox's agent runs on the
    host's), and so do the programs it starts (kernel_bridge). ``--cpu-pressure FILE``:
    where the host's CPU pressure is read (pressure.py; /proc/pressure/cpu by default), or
    ``off``: never, so the shell started ahead of the next command (warm.py) is started
    whatever the load."""
    options: dict[str, str] = {}
    args = iter(argv)
    for arg in args:
        name, sep, value = arg.partition("=")
        known = (
            "--workspace",
            "--tmp",
            "--root",
            "--cwd",
            "--loader",
            "--library-path",
            "--env",
            "--mount",
            "--cpu-pressure",
        )
        if name not in known:
            raise ValueError(f"unknown argument {arg!r}")
        if not sep:
            value = next(args, "")
        if not value:
            raise ValueError(f"{name} needs a value")
        if name in ("--env", "--mount"):  # repeated (NAME=VALUE for the commands it starts;
            # a workspace mounted outside /workspace: another root of its files API)
            options[name[2:]] = options.get(name[2:], "") + value + "\0"
            continue
        options[name[2:]] = value
    for name in ("workspace", "tmp"):
        if name not in options:
            raise ValueError(f"--{name} is required")
        if not os.path.isdir(options[name]):
            raise ValueError(f"--{name} {options[name]!r} is not a directory")
    if options.get("root", "/") != "/":
        raise ValueError("--root takes only /")
    return options


def main(argv: list[str]) -> int:
    try:
        options = _parse_args(argv)
    except ValueError as exc:
        log(f"usage: agent.py --workspace DIR --tmp DIR: {exc}")
        return 2
    roots = tuple(
        (sroot, os.path.realpath(options[name]))
        for sroot, name in zip(paths.SANDBOX_ROOTS, ("workspace", "tmp"), strict=True)
    )
    for mount in filter(None, options.get("mount", "").split("\0")):
        if not mount.startswith("/") or not os.path.isdir(mount):
            log(f"usage: --mount {mount!r} is not a directory")
            return 2
        roots += ((os.path.normpath(mount), os.path.realpath(mount)),)
    if "root" in options:
        roots += (("/", "/"),)
    sandbox_env = dict(os.environ)
    for pair in options.get("env", "").split("\0"):
        key, sep, value = pair.partition("=")
        if sep and key:
            sandbox_env[key] = value
    psi = options.get("cpu-pressure", pressure.PSI_CPU)
    cpu_stalled = None if psi == "off" else partial(pressure.read_stalled_us, psi)
    st = AgentState(roots, sandbox_env, options.get("cwd", "/workspace"), cpu_stalled)
    if "loader" in options:
        library = options.get("library-path", "")
        st.python = (options["loader"], "--library-path", library, sys.executable)
    signal.signal(signal.SIGTERM, partial(_on_signal, st))
    signal.signal(signal.SIGINT, partial(_on_signal, st))
    ready = {"event": "ready", "pid": os.getpid(), "version": PROTOCOL_VERSION}
    _write_frame(st, frames.encode(ready))
    _tune_malloc(st)  # after the ready event (off the create latency path), before any request
    # as its sandbox's pid 1, orphans are the agent's to reap (orphans.py): the loop then
    # waits for a request or a SIGCHLD together, and reads its pipe unbuffered (a frame
    # left in a buffer would wait for the next one's bytes)
    poller = _request_poller(st) if st.reaper.start() else None
    stdin = sys.stdin.buffer if poller is None else io.FileIO(0, "rb", closefd=False)
    while True:
        try:
            if poller is not None:
                _wait_for_request(st, poller)
            frame = frames.read_frame(stdin)
        except (frames.FrameError, OSError) as exc:
            _fatal(st, f"malformed request frame: {exc}")
            return 2
        if frame is None:
            break
        req, payload = frame
        request_id = req.get("id")
        if not isinstance(request_id, int) or isinstance(request_id, bool):
            _fatal(st, f"request without an integer id: {req.get('op')!r}")
            return 2
        _dispatch(st, request_id, req, payload)
    _shutdown(st, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
