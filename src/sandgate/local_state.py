"""The row every piece of in-process state has, and the rows no one package owns.

Anything kept only in one process is written down once: what it holds, its bound and what
happens with N instances (`StateRow`). The server's state and its rows are in
`control/state.py` (`ServerLocalState`, `SERVER_STATE`), the worker's in `worker/state.py`
(`WorkerLocalState`, `WORKER_STATE`, `WORKER_OBJECT_STATE`). Here are the rest: the state of
the tunnel's links, which both ends keep (`LINK_STATE`), and the in-sandbox agent's, which
imports nothing of sandgate (`AGENT_STATE`, `AGENT_GROWTH`). `sandgate state-table`
(`cli/state_table.py`) prints all of it as one table, docs/state.md. A unit test
(`tests/unit/test_local_state_registry.py`) walks `src/` and fails on module-level mutable
state anywhere, and on state a class keeps on `self` or a registry field without its row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class StateRow:
    holds: str
    bound: str
    under_n_instances: str


# state the tunnel's link objects keep on `self` (on the server and on the worker), found by
# the registry test; each lives and dies with its owner
LINK_STATE: Mapping[str, StateRow] = MappingProxyType(
    {
        "MemoryLink._to_server": StateRow(
            "frames from the worker to the server on an in-memory tunnel link (tests/fast)",
            "what one side sent and the other has not read yet: calls wait for their answers",
            "per-process by nature: both ends of the link live in one process",
        ),
        "MemoryLink._to_worker": StateRow(
            "frames from the server to the worker on an in-memory tunnel link (tests/fast)",
            "what one side sent and the other has not read yet: calls wait for their answers",
            "per-process by nature: both ends of the link live in one process",
        ),
        "RpcChannel._pending": StateRow(
            "calls waiting for their answer on one link",
            "the calls in flight on that link",
            "per-process by nature: a link is one process's connection; all fail when it closes",
        ),
        "RpcChannel._running": StateRow(
            "requests from the peer being handled on one link",
            "the requests in flight on that link",
            "per-process by nature; cancelled when the link closes",
        ),
        "RpcChannel._send_lock": StateRow(
            "serialises frames written to one link", "one lock per link", "per-process by nature"
        ),
    }
)

AGENT_STATE: Mapping[str, StateRow] = MappingProxyType(
    {
        "agent": StateRow(
            "the in-sandbox agent's open file handles, exec process groups, background processes "
            "and terminals with their output buffers, directory watches with their events, "
            "connections to the sandbox's ports, the request threads kept for the next request, "
            "the shell started ahead of the next command",
            "64 handles; 256 processes/terminals with at most 1 MiB of output each; 64 watches "
            "with at most 10,000 events each; 256 port connections, each holding at most one "
            "read's answer (1 MiB) and 8 writes; 4 idle request threads, each for 10 s; one "
            "waiting shell",
            "per-process by nature: one agent process per sandbox, gone with it",
        ),
    }
)


# What grows inside one process and is not a registry field: the in-sandbox agent's collections
# (standard library only, it cannot import this module; all of it hangs off its one
# AgentState, sandgate/agent/state.py; a test checks that every name below is in the agent).
# Everything the agent holds is also inside the sandbox's memory cgroup: only its own sandbox
# pays for it.
AGENT_GROWTH: tuple[tuple[str, str, str], ...] = (
    (
        "agent `AgentState.handles`",
        "open file handles (uploads, downloads)",
        "64 (`MAX_HANDLES`); closed by the worker's call or dropped at exit",
    ),
    (
        "agent `Registry._entries`",
        "background processes and terminals",
        "256 (`MAX_PROCESSES`): the oldest exited one is forgotten to make room; a start with "
        "256 still running is refused",
    ),
    (
        "agent `Reaper._owned`",
        "the agent's own children with their start times, as the sandbox's pid 1 (orphans.py: "
        "never reaped by it)",
        "the sandbox's processes: each scan for orphans forgets the pids gone from its /proc, "
        "and every recorded child's exit brings a scan; empty where the agent is not pid 1",
    ),
    (
        "agent code contexts (kernel_bridge.py processes tagged ctx:<id>, each with its "
        "IPython kernel)",
        "the variables and imports of each code context",
        "processes of `Registry._entries` (256 at most), within the sandbox's memory and pids "
        "limits; nothing of them is kept in the control plane (the tag finds one from any "
        "instance); they die with their sandbox",
    ),
    (
        "agent output ring (`Output.chunks`)",
        "the recent output of one process or terminal",
        "1 MiB (`PROCESS_BUFFER_BYTES`) and 4,096 chunks (`MAX_CHUNKS`) per process: the "
        "oldest output is dropped first",
    ),
    (
        "agent `Watches._watchers`",
        "directory watches (`watch_start`)",
        "64 (`MAX_WATCHERS`): the oldest ended one is forgotten to make room; a start with 64 "
        "active is refused",
    ),
    (
        "agent watch events (`Watcher.events`)",
        "the recent events of one directory watch",
        "10,000 events (`MAX_EVENTS`) and 4 MiB (`MAX_BUFFER_BYTES`) per watch: the oldest are "
        "dropped first",
    ),
    (
        "agent `Watcher.dirs`, `Watcher.pending`",
        "the directories a watch watches; names a new directory's first scan reported",
        "the directories below the watched one, at most the kernel's "
        "fs.inotify.max_user_watches; `pending` is emptied whenever the kernel's queue is",
    ),
    (
        "agent heaps (glibc malloc)",
        "freed buffers of file chunks, frames and exec output (up to 4 MiB each), kept for "
        "the next request",
        "4 MiB free per heap (`HEAP_KEPT_BYTES`), two heaps (`HEAPS`); all of it given back "
        "(malloc_trim) once a request thread has been idle 10 s (`IDLE_SECONDS`)",
    ),
    (
        "agent `Threads._calls`",
        "requests handed to a request thread that waits for one",
        "at most the threads waiting: 4 (`MAX_IDLE`), each for at most 10 s (`IDLE_SECONDS`); "
        "a request with none waiting gets a thread of its own",
    ),
    (
        "agent exec output",
        "stdout and stderr of one `execute`",
        "1 MiB each (`EXEC_OUTPUT_CAP`), the rest dropped and reported truncated",
    ),
    (
        "agent `AgentState.groups`, `Registry._orphans`",
        "process groups that may still be alive, to kill at exit",
        "pruned of dead groups at every start: the live groups, at most the sandbox's `pids`",
    ),
    (
        "agent `Ports._conns`",
        "TCP connections to ports inside the sandbox (`port_open`: previews, the port proxy)",
        "256 (`MAX_CONNECTIONS`): an open with 256 open is refused; one no request used for "
        "its idle time (`IDLE_SECONDS` by default) is closed, and all are at the agent's exit",
    ),
    (
        "agent `Conn.buffer`, `Conn.writes`",
        "what a waiting read took from one connection; writes the kernel has not taken yet",
        "one read's `max` (`MAX_READ_BYTES`, 1 MiB); `MAX_PENDING_WRITES` writes, each one "
        "frame: the rest waits in the kernel's socket buffers",
    ),
    (
        "agent `Ports._inbox`",
        "port requests handed to the port loop, not yet taken by it",
        "the worker's requests in flight to this agent",
    ),
    (
        "agent `AgentState.queues`",
        "requests waiting for one handle or process, in arrival order",
        "the worker's requests in flight to this agent",
    ),
    (
        "agent `AgentState.which_cache`",
        "executables found on PATH, by name",
        "one per executable that exists in the sandbox (bounded by its disk quota)",
    ),
    (
        "agent `Warm._waiting`, `Warm._wanted`, `Warm._cpu`, `Warm._answered`, "
        "`Warm._quick` (warm.py, pressure.py)",
        "the shell started ahead of the next short `bash`/`sh` exec, waiting on a pipe; the "
        "language, directory and environment of the next one to start; the host's CPU stall "
        "total at the last look and whether the CPUs were saturated; when the last answer "
        "went and whether the last command came soon after one (saturated and soon: none is "
        "started)",
        "one shell (one pid, ~1 MiB) per sandbox that ran a shell command in the last 10 s "
        "(`threads.IDLE_SECONDS`); ended when a command for another directory or environment "
        "comes, and at the agent's exit",
    ),
)
