"""Everything the agent keeps in memory, in one object, and the open file handles in it.

main() makes the one ``AgentState`` of the agent process and hands it to every operation; no
module of the agent keeps state of its own (a unit test refuses module-level containers and
``global``). All of it is per agent process, inside the sandbox's memory cgroup, and gone
with the sandbox (docs/state.md, row "agent").
"""

from __future__ import annotations

import os
import threading
import time

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    from collections.abc import Callable

    from sandgate.agent import orphans, ports, pressure, procs, threads, warm, watch
    from sandgate.agent.request import Header
else:
    import orphans
    import pressure
    import threads
    import warm


class AgentState:
    """The agent's sandbox roots and environment, and what its requests leave behind."""

    __slots__ = (
        "closing",
        "cwd",
        "groups",
        "groups_lock",
        "handles",
        "handles_lock",
        "next_handle",
        "ports",
        "ports_lock",
        "python",
        "queues",
        "queues_lock",
        "reaper",
        "registry",
        "registry_lock",
        "roots",
        "sandbox_env",
        "threads",
        "warm",
        "watches",
        "watches_lock",
        "which_cache",
        "write_lock",
    )

    def __init__(
        self,
        roots: tuple[tuple[str, str], ...],
        sandbox_env: dict[str, str],
        cwd: str = "/workspace",
        cpu_stalled: Callable[[], int | None] | None = None,
    ) -> None:
        """``cpu_stalled``: the host's CPU stall total (pressure.py), read to decide whether
        a shell is started ahead of the next command; None: never read, always started."""
        self.roots = roots  # (sandbox root, real directory): /workspace first, "/" last if any
        self.cwd = cwd  # where a command without a cwd starts (a template's WorkingDir)
        self.python: tuple[str, ...] = ()  # runs programs beside the agent (): its own
        self.sandbox_env = sandbox_env  # the agent's own environment at start
        self.write_lock = threading.Lock()  # one response frame at a time on stdout
        # the guard every spawn holds; as the sandbox's pid 1, the reaper of orphans
        self.reaper = orphans.Reaper(os.getpid())
        # the threads requests run on: reused while requests come, at most 4 idle (main.py)
        self.threads = threads.Threads()
        # exec (execute.py): process groups started, possibly still alive; closing is set
        # under groups_lock by the shutdown, which re-enters it when a signal arrives then
        self.groups_lock = threading.RLock()
        self.groups: set[int] = set()
        self.closing = False
        self.which_cache: dict[str, str] = {}  # executables found on PATH, by name
        # a shell started ahead of the next exec (warm.py), unless the CPUs are saturated
        cpu = pressure.CpuPressure(cpu_stalled or pressure.never, time.monotonic())
        self.warm = warm.Warm(cpu)
        # open file handles (files.py), at most MAX_HANDLES
        self.handles_lock = threading.Lock()
        self.handles: dict[int, Handle] = {}
        self.next_handle = 0
        # background processes and terminals (procs.py), made by the first proc_*/pty_*
        # request; re-entered when a signal arrives during shutdown
        self.registry_lock = threading.RLock()
        self.registry: procs.Registry | None = None
        # directory watches (watch.py), made by the first watch_* request; re-entered when a
        # signal arrives during shutdown
        self.watches_lock = threading.RLock()
        self.watches: watch.Watches | None = None
        # connections to the sandbox's ports (ports.py), made by the first port_* request;
        # re-entered when a signal arrives during shutdown
        self.ports_lock = threading.RLock()
        self.ports: ports.Ports | None = None
        # requests waiting for one handle or pid, in arrival order (main.py)
        self.queues_lock = threading.Lock()
        self.queues: dict[tuple[str, int], list[tuple[int, Header, bytes]]] = {}


class Handle:
    """An open file of files.py, registered in ``AgentState.handles``."""

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
                    try:
                        os.unlink(self.temp)
                    except OSError:
                        pass
