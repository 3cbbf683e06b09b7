"""What a worker keeps only in memory: its sandboxes, and the rows of its in-process state.

`WorkerLocalState` is every piece of state the worker service holds, created by the worker's
start (`worker/main.py`) and passed to `WorkerService`. Each field says what it holds, its
bound and what happens with N instances; `WORKER_STATE` and `WORKER_OBJECT_STATE` (the state
the worker's objects keep on `self`) are its rows in the one table `sandgate state-table`
prints (`cli/state_table.py`, docs/state.md). The server's are in `control/state.py`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from sandgate.core import placement
from sandgate.local_state import StateRow
from sandgate.worker.agent_link import AgentLink
from sandgate.worker.metrics import CpuSample
from sandgate.worker.runtime.base import RunningSandbox, SandboxSpec


@dataclass
class LiveSandbox:
    running: RunningSandbox
    link: AgentLink
    started_at: float = field(default_factory=time.time)
    stopping: bool = False
    handed_as: str | None = None  # a pooled sandbox: the create's name it was handed out as

    @property
    def name(self) -> str:
        return self.handed_as or self.running.spec.name

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "pid": self.link.ready_info.get("pid")}


@dataclass(frozen=True)
class Starting:
    spec: SandboxSpec
    start: asyncio.Future[LiveSandbox]


V = TypeVar("V")


def add_granted(totals: dict[str, int], spec: SandboxSpec, sign: int = 1) -> None:
    """Add (or, with `sign` -1, take off) what `spec` grants of each budgeted resource."""
    for name in placement.BUDGETED:
        totals[name] += sign * int(getattr(spec, name))


class GrantTally(MutableMapping[str, V], Generic[V]):
    """Sandbox name -> a sandbox (running, starting, tearing down), keeping the sum of what
    they were granted of each budgeted resource (`placement.BUDGETED`) as entries come and go.

    A start checks the worker's budget against what it holds (`WorkerService._check_budget`);
    summed afresh over every sandbox held, that cost a start ~1.2 ms at 1,000 held. Every
    change goes through `__setitem__` and `__delitem__` (the mixin's pop, setdefault, update
    and clear are made of them) and a sandbox's spec is frozen, so `granted` is exact.
    """

    __slots__ = ("_entries", "_granted", "_spec_of")

    def __init__(self, spec_of: Callable[[V], SandboxSpec]) -> None:
        self._entries: dict[str, V] = {}
        self._granted = dict.fromkeys(placement.BUDGETED, 0)
        self._spec_of = spec_of

    @property
    def granted(self) -> dict[str, int]:
        """What the entries were granted, summed (a copy)."""
        return dict(self._granted)

    def _count(self, value: V, sign: int) -> None:
        add_granted(self._granted, self._spec_of(value), sign)

    def __getitem__(self, key: str) -> V:
        return self._entries[key]

    def __setitem__(self, key: str, value: V) -> None:
        old = self._entries.get(key)
        if old is not None:
            self._count(old, -1)
        self._entries[key] = value
        self._count(value, 1)

    def __delitem__(self, key: str) -> None:
        self._count(self._entries.pop(key), -1)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __repr__(self) -> str:
        return f"GrantTally({self._entries!r}, granted={self._granted!r})"


def _live_spec(live: LiveSandbox) -> SandboxSpec:
    return live.running.spec


def _starting_spec(starting: Starting) -> SandboxSpec:
    return starting.spec


@dataclass
class WorkerLocalState:
    # sandbox name -> the running sandbox and its agent link. Per-process by nature: the
    # sandboxes are children of this worker process and die with it (bwrap --die-with-parent).
    sandboxes: GrantTally[LiveSandbox] = field(default_factory=lambda: GrantTally(_live_spec))
    # sandbox name -> the provision in progress (its spec and start), so a redelivered create
    # waits for the first and the budget counts what is starting.
    provisioning: GrantTally[Starting] = field(default_factory=lambda: GrantTally(_starting_spec))
    # sandbox name -> a sandbox being destroyed: recorded before it leaves `sandboxes`, kept
    # until its processes, cgroups, uid lease and directories are gone. Per-process by nature;
    # a worker that dies with entries here removes the leftovers at its next start.
    tearing_down: GrantTally[LiveSandbox] = field(default_factory=lambda: GrantTally(_live_spec))
    # sandbox name -> the task tearing it down (one per sandbox; it outlives the request that
    # asked for it, so a dropped link never interrupts a destroy).
    teardowns: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    # sandbox name -> its CPU time at the last `metrics` call, so the next one measures the
    # CPU used since (worker/metrics.py); dropped when the sandbox stops running.
    cpu_samples: dict[str, CpuSample] = field(default_factory=dict)
    # template -> its warm pool: started sandboxes no create has been handed yet (worker/pool.py)
    pool: dict[str, list[LiveSandbox]] = field(default_factory=dict)
    # template -> pool sandboxes being started now
    pool_starting: dict[str, int] = field(default_factory=dict)
    # set when a pool is short (a hand-out, a pooled sandbox that died): the filler wakes
    pool_wanted: asyncio.Event = field(default_factory=asyncio.Event)
    # sandbox name -> how many operations hold it frozen now (a workspace's commit or
    # restore, a build's export): frozen from the first hold to the last
    freeze_holds: dict[str, int] = field(default_factory=dict)
    # layer digest -> the fetch of that image layer in progress (worker/images.py), so the
    # sandboxes that need it wait for one download; dropped when it ends
    layer_fetches: dict[str, asyncio.Task[None]] = field(default_factory=dict)


WORKER_STATE: Mapping[str, StateRow] = MappingProxyType(
    {
        "WorkerLocalState.sandboxes": StateRow(
            "sandboxes running on this worker and their agent pipes",
            "the worker's capacity",
            "per-process by nature; reported to the control plane on every (re)connect",
        ),
        "WorkerLocalState.provisioning": StateRow(
            "provisions in progress by sandbox name",
            "the worker's capacity",
            "per-process by nature; a redelivered create of the same name waits for the first",
        ),
        "WorkerLocalState.tearing_down": StateRow(
            "sandboxes being destroyed, until everything they held on the host is gone",
            "the worker's capacity (they count against it)",
            "per-process by nature; reported in every hello and heartbeat until done, and what a "
            "crashed worker left is removed at its next start",
        ),
        "WorkerLocalState.teardowns": StateRow(
            "the task tearing each of those sandboxes down",
            "one per sandbox being destroyed",
            "per-process by nature; awaited by the worker's shutdown",
        ),
        "WorkerLocalState.pool": StateRow(
            "warm pools: started sandboxes per template that no create has been handed yet",
            "the --pool sizes; they count in the worker's capacity and budget, which it reports "
            "less the pools' share",
            "per-process by nature: a hand-out is this worker's; the control plane places by "
            "the reported capacity, counted exactly in the store",
        ),
        "WorkerLocalState.pool_starting": StateRow(
            "how many pool sandboxes of each template are starting",
            "the --pool sizes",
            "per-process by nature",
        ),
        "WorkerLocalState.pool_wanted": StateRow(
            "wakes the pool filler when a pool is short",
            "one event",
            "per-process by nature",
        ),
        "WorkerLocalState.layer_fetches": StateRow(
            "image layers being fetched from the control plane and unpacked",
            "the layers of the images being started",
            "per-process by nature; the unpacked layers themselves are files in the worker's "
            "state directory, kept across restarts (a partial fetch is removed at start)",
        ),
        "WorkerLocalState.freeze_holds": StateRow(
            "how many operations hold each sandbox frozen (workspace commits and restores, a "
            "build's export), so the last one alone thaws it",
            "one small count per frozen sandbox (dropped at zero)",
            "per-process by nature: the sandboxes' cgroups are this worker's",
        ),
        "WorkerLocalState.cpu_samples": StateRow(
            "each running sandbox's CPU time at its last metrics call",
            "one small record per running sandbox (dropped when it stops)",
            "per-process by nature: the sandbox's cgroup and processes are on this worker's host",
        ),
    }
)

# state the worker's objects keep on `self`, found by the registry test; each lives and dies
# with its owner
WORKER_OBJECT_STATE: Mapping[str, StateRow] = MappingProxyType(
    {
        "EgressGate.sandboxes": StateRow(
            "each sandbox's network policy and its gate counters (allowed, refused, DNS "
            "refused, the last 20 refusals)",
            "one entry per sandbox on this worker",
            "per-process by nature: the gate is this worker's; the policy is durable in the "
            "sandbox's row and sent with every provision and PUT …/network",
        ),
        "EgressGate.by_address": StateRow(
            "which sandbox a link address belongs to, so the gate knows who connects",
            "one per sandbox whose network is on",
            "per-process by nature: the links are this host's",
        ),
        "BwrapRuntime._network_changes": StateRow(
            "serialises changes of a running sandbox's network (its link and slot)",
            "one lock per worker",
            "per-process by nature: the links are this host's",
        ),
        "GrantTally._entries": StateRow(
            "the sandboxes of `sandboxes`, `provisioning` or `tearing_down` (above), with what "
            "they were granted of memory and disk summed in `_granted`",
            "those maps' own",
            "per-process by nature: the sums are of this worker's sandboxes",
        ),
        "Spawner._waiting": StateRow(
            "the starts handed to the spawner's thread, waiting for its pid",
            "one per sandbox start in progress",
            "per-process by nature: the thread starts this worker's sandboxes",
        ),
        "Spawner._owned": StateRow(
            "a start's own copies of the descriptors its child gets, until its result is in",
            "five per sandbox start in progress",
            "per-process by nature: descriptors of this worker",
        ),
        "SpawnedProcess._exited": StateRow(
            "the exit code of a sandbox's first process, once its pidfd says it exited",
            "one per running sandbox",
            "per-process by nature: only the parent can wait for it",
        ),
        "DiskFiles._lock": StateRow(
            "serialises taking a sandbox disk's descriptor against its release",
            "one lock per running sandbox",
            "per-process by nature: the disk is mounted for this worker's sandbox",
        ),
        "NetHost.spares": StateRow(
            "network namespaces made ahead for the next sandbox starts, with a link and without",
            "2 of each kind (`netns.SPARES`)",
            "per-process by nature: this host's namespaces, held by descriptors only (no "
            "name), so they end with a crashed worker; its host links are removed at its "
            "next start",
        ),
        "NetHost._wanted": StateRow(
            "wakes the spare filler when a start took one", "one event", "per-process by nature"
        ),
        "EgressGate._servers": StateRow(
            "the gate's DNS listener over TCP", "one", "per-process by nature"
        ),
        "EgressGate._tasks": StateRow(
            "connections and DNS queries being served",
            "the sandboxes' open connections (each within its pids and fd limits)",
            "per-process by nature; cancelled when the worker stops",
        ),
        "WorkspaceHost.mounted": StateRow(
            "workspaces whose image this worker has mounted, with how many sandboxes and git "
            "operations use each, and the flock that says it is mounted here",
            "the workspaces of this worker's sandboxes, plus those in a git operation",
            "exact across hosts: the flock on the workspace's lock file, on the shared root, "
            "keeps a second worker from mounting it; released by the kernel when this one dies",
        ),
        "WorkspaceHost.lingering": StateRow(
            "workspaces unmounted here whose file system lives on in a copy of the mount table "
            "(a namespace being torn down): its loop device, mounted again by a mount "
            "meanwhile, and the flock, kept until it is gone",
            "the workspaces unmounted in the last moments (each let go once its file system "
            "is gone), plus those found alive on the host at start (likewise when this worker "
            "took their flock, else kept until mounted here or deleted): at most the host's "
            "loop devices",
            "exact across hosts: the flock stays held until the file system is gone, so no "
            "other worker mounts the image before its last changes are written (one found at "
            "start whose flock another worker process here holds is guarded by that one)",
        ),
        "WorkspaceHost._watchers": StateRow(
            "the task per lingering workspace that lets its flock go once its file system is gone",
            "one per lingering workspace",
            "per-process by nature",
        ),
        "WorkspaceHost.fences": StateRow(
            "the highest lock fence an operation on each workspace arrived with",
            "one integer per workspace used since the worker started",
            "exact: the fences come from the store, one per holder of the workspace's "
            "deployment-wide lock; an operation with a lower one stops before its next git step",
        ),
        "WorkspaceHost._git_slots": StateRow(
            "bounds the workspaces whose git runs at once on this worker",
            "4 (`GIT_SLOTS`); the others wait their turn",
            "per-process by nature: the git processes are this host's",
        ),
        "WorkspaceHost._locks": StateRow(
            "serialises the mount, unmount and git operations of each workspace on this worker",
            "one lock per workspace used since the worker started",
            "per-process by nature (one worker has a workspace mounted); across instances the "
            "store's advisory lock orders commits and restores",
        ),
        "AgentLink.ready": StateRow(
            "set when the sandbox's agent reported ready",
            "one event per sandbox",
            "per-process by nature",
        ),
        "AgentLink.ready_info": StateRow(
            "the agent's ready event (pid, version)",
            "one small dict per sandbox",
            "per-process by nature",
        ),
        "TunnelClient.connected": StateRow(
            "whether the worker's tunnel is up", "one event per worker", "per-process by nature"
        ),
        "UidPool._held": StateRow(
            "host uids leased to this worker's sandboxes (flock held on a file per uid)",
            "the worker's uid range",
            "exact: the flock on the uid's file is the lease across every process on the host, "
            "released when its holder dies",
        ),
        "BwrapRuntime._limits": StateRow(
            "which cgroup limits this host can enforce, found at prepare",
            "3 flags",
            "per-process by nature: facts about this worker's host",
        ),
        "BwrapRuntime._root_args": StateRow(
            "bwrap arguments building the read-only root, computed at prepare",
            "a few dozen strings",
            "per-process by nature: facts about this worker's host",
        ),
        "BwrapRuntime._etc_args": StateRow(
            "bwrap arguments binding the minimal /etc, computed at prepare",
            "a few dozen strings",
            "per-process by nature: facts about this worker's host",
        ),
    }
)
