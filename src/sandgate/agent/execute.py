"""``exec``: run one program to its end and answer with its exit code and output.

The program runs in a session of its own (its process group is remembered in
``AgentState.groups``, so that the agent's exit kills it); its output is read by the one pump
(pump.py), keeping the first ``EXEC_OUTPUT_CAP`` bytes of each stream. The environment, cwd
and executable lookup here are also what background processes get (procs.py).
"""

from __future__ import annotations

import os
import signal
import stat
import threading
import time
from types import MappingProxyType

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    import subprocess

    from sandgate.agent import entries, paths, pump, warm
    from sandgate.agent.request import AgentError, Header, start_thread, str_field
    from sandgate.agent.state import AgentState
else:
    import entries
    import paths
    import pump
    import warm
    from request import AgentError, start_thread, str_field

EXEC_OUTPUT_CAP = 1 << 20  # bytes kept of each of stdout and stderr
EXEC_PATH = "/usr/local/bin:/usr/bin:/bin"
EXEC_DEFAULT_TIMEOUT = 30.0
EXEC_TIMEOUT_EXIT_CODE = 124
INLINE_CODE_BYTES = 64 << 10  # larger programs are read from a pipe, not argv

INTERPRETERS = MappingProxyType(
    {"bash": ("bash", "-c"), "sh": ("sh", "-c"), "python": ("python3", "-c")}
)


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


def which(st: AgentState, name: str) -> str:
    found = st.which_cache.get(name)
    if found is None:
        for directory in EXEC_PATH.split(":"):
            candidate = f"{directory}/{name}"
            if os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
                found = st.which_cache[name] = candidate
                break
        else:
            raise AgentError("not_found", f"{name} is not installed in this sandbox")
    return found


def exec_timeout(req: Header) -> float:
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


def exec_env(st: AgentState, req: Header) -> dict[str, str]:
    extra = req.get("env")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise AgentError("invalid_request", "'env' must be an object of strings")
    for key, value in extra.items():
        if not isinstance(value, str) or not key or "=" in key or "\x00" in key or "\x00" in value:
            raise AgentError("invalid_request", f"invalid environment variable {key!r}")
    home = st.roots[0][1]
    return {"PATH": EXEC_PATH, "HOME": home, "LANG": "C.UTF-8", **st.sandbox_env, **extra}


def exec_cwd(st: AgentState, req: Header) -> str:
    target = paths.resolve(st.roots, str_field(req, "cwd", st.cwd), follow=True, name="cwd")
    found = os.stat(target.real)
    if not stat.S_ISDIR(found.st_mode):
        raise AgentError("not_a_directory", f"cwd {target.spath} is not a directory")
    return target.real


def op_exec(st: AgentState, req: Header, payload: bytes) -> tuple[Header, bytes]:
    language = str_field(req, "language")
    interpreter = INTERPRETERS.get(language)
    if interpreter is None:
        raise AgentError("invalid_request", f"'language' must be one of {sorted(INTERPRETERS)}")
    if "code" in req:
        code = str_field(req, "code")
    else:  # large programs travel as the payload, UTF-8
        try:
            code = payload.decode("utf-8")
        except UnicodeDecodeError:
            raise AgentError("invalid_request", "the code payload is not UTF-8") from None
        if not code:
            raise AgentError("invalid_request", "'code' is empty")
    if "\x00" in code:
        raise AgentError("invalid_request", "'code' contains a NUL byte")
    timeout = exec_timeout(req)
    env = exec_env(st, req)
    cwd = exec_cwd(st, req)
    program = which(st, interpreter[0])
    argv = [program, interpreter[1], code]
    shell = warm.shell_command(argv)
    if shell is not None and warm.eligible_env(env):
        return _run(st, argv, cwd, env, timeout, shell=shell)
    if len(code.encode()) <= INLINE_CODE_BYTES:
        return _run(st, argv, cwd, env, timeout)
    # past the kernel's limit on one argument (128 KiB), the interpreter reads the program
    # from a pipe that a thread fills
    read_end, write_end = os.pipe()
    feeder = threading.Thread(target=_feed, args=(write_end, code.encode()), daemon=True)
    try:
        try:
            start_thread(feeder)
        except AgentError:  # not started: the pipe's other end is still ours
            os.close(write_end)
            raise
        argv = [program, f"/dev/fd/{read_end}"]
        return _run(st, argv, cwd, env, timeout, pass_fds=(read_end,))
    finally:
        os.close(read_end)


def _feed(fd: int, data: bytes) -> None:
    try:
        entries.write_all(fd, data)
    except OSError:
        pass  # the interpreter stopped reading (it exited or was killed)
    finally:
        os.close(fd)


def _spawn(
    st: AgentState,
    argv: list[str],
    cwd: str,
    env: dict[str, str],
    pass_fds: tuple[int, ...] = (),
    stdin: int | None = None,
    stdout: int | None = None,
    stderr: int | None = None,
) -> subprocess.Popen[bytes]:
    import subprocess

    if TYPE_CHECKING:
        from sandgate.agent.children import popen
    else:  # on the first exec, not at the agent's start
        from children import popen

    with st.groups_lock:  # so that shutdown never misses a group being started
        if st.closing:
            raise AgentError("io_error", "the agent is shutting down")
        _prune_groups(st)
        with st.reaper.spawning():  # the reaper (orphans.py) never waits for ours
            proc = popen(
                argv,
                st.warm.make_room,  # at the pids limit, the waiting shell's pid first
                stdin=subprocess.DEVNULL if stdin is None else stdin,
                stdout=subprocess.PIPE if stdout is None else stdout,
                stderr=subprocess.PIPE if stderr is None else stderr,
                cwd=cwd,
                env=env,
                pass_fds=pass_fds,
            )
            st.reaper.own(proc.pid)
        st.groups.add(proc.pid)
    return proc


def _prune_groups(st: AgentState) -> None:
    """Forget groups with no process left, so that a recycled pid is never killed."""
    for pgid in list(st.groups):
        try:
            os.killpg(pgid, 0)
        except OSError:  # ESRCH: gone; EPERM: the id now belongs to someone else
            st.groups.discard(pgid)


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def stop(st: AgentState) -> None:
    """The agent is exiting: start nothing more, kill every group exec started."""
    with st.groups_lock:
        st.closing = True
        for pgid in list(st.groups):
            _killpg(pgid)


def _run(
    st: AgentState,
    argv: list[str],
    cwd: str,
    env: dict[str, str],
    timeout: float,
    pass_fds: tuple[int, ...] = (),
    shell: tuple[tuple[str, ...], str] | None = None,
) -> tuple[Header, bytes]:
    """Run ``argv`` to its end; with ``shell`` (argv split by `warm.shell_command`), in the
    sandbox's waiting shell when it fits (warm.py)."""
    started = time.monotonic()
    taken = None
    if shell is not None:
        taken = st.warm.take((shell[0], cwd, env), shell[1], keep_stdin=False)
    if taken is not None:
        proc = taken.proc
        proc.stdout, proc.stderr = os.fdopen(taken.out, "rb", 0), os.fdopen(taken.err, "rb", 0)
    else:
        proc = _spawn(st, argv, cwd, env, pass_fds)
    out, err = _Capture(), _Capture()
    assert proc.stdout is not None and proc.stderr is not None
    sinks = {proc.stdout.fileno(): out.add, proc.stderr.fileno(): err.add}
    try:
        timed_out = pump.pump(
            proc.pid,
            sinks,
            exited=lambda: proc.poll() is not None,
            deadline=started + timeout,
            expire=lambda: _killpg(proc.pid),
        )
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
        "warm": taken is not None,  # ran in a shell started ahead of it (warm.py)
    }
    return header, bytes(out.data) + bytes(err.data)


def start_warm(st: AgentState) -> None:
    """Start the shell the next command is to find waiting, if one is due (warm.py); called
    after a command's reply has gone, on its thread. A shell that cannot start (the pids
    limit, say) is not tried again until a command spawns; one that was no longer wanted
    once started is followed by one that is, once."""
    for _ in range(2):
        key = st.warm.due()
        if key is None:
            return
        waiting = None
        try:
            waiting = _start_waiting(st, key)
        finally:
            st.warm.started(waiting)


def _start_waiting(st: AgentState, key: warm.Key) -> warm.Waiting | None:
    """A shell for ``key`` waiting on its stdin pipe, or None if it could not start."""
    if TYPE_CHECKING:
        from sandgate.agent.children import on_pipes
    else:  # as _spawn does: not at the agent's start
        from children import on_pipes

    program, cwd, env = key
    try:
        read_profile = warm.profile(program, env)  # before: a change after is seen
        argv = [*program, warm.script(program[0])]
        started = on_pipes(lambda i, o, e: _spawn(st, argv, cwd, env, stdin=i, stdout=o, stderr=e))
    except (AgentError, OSError):
        return None  # the next command spawns (warm.py)
    return warm.Waiting(key, *started, read_profile)
