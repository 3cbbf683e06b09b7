"""What a sandbox runtime does for the worker: start the agent isolated, stop it, clean up.

A runtime knows nothing about the tunnel or the agent protocol: it starts
`agent_argv(...)` inside a fresh sandbox with stdin/stdout as pipes and hands back the
process. The worker talks to the agent over those pipes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sandgate.core.egress_policy import NO_NETWORK, NetworkPolicy
from sandgate.core.workspaces import ResolvedMount
from sandgate.worker.child import ChildProcess
from sandgate.worker.disk_files import DiskFiles


@dataclass(frozen=True)
class LayerRef:
    digest: str  # sha256:<hex> of the blob as stored
    size: int  # bytes of the blob
    media: str = "tar"  # "tar" or "tar+gzip"


@dataclass(frozen=True)
class ImageSpec:
    """A template's root file system (control/templates.py): its layers, bottom first, and
    what its image config asks of a process started in it."""

    digest: str  # the template's content address: its layers and config
    layers: tuple[LayerRef, ...]
    env: tuple[tuple[str, str], ...] = ()  # below the sandbox's own env
    workdir: str = ""  # the agent's working directory ("" = /workspace)
    user: str = ""  # "" or root: uid 0 inside; a number: that uid (its files look its own)
    cmd: tuple[str, ...] = ()  # started in the background once the sandbox is up

    @property
    def size(self) -> int:
        return sum(layer.size for layer in self.layers)


@dataclass(frozen=True)
class SandboxSpec:
    name: str  # also the hostname inside the sandbox; [a-z0-9-], at most 63 chars
    env: dict[str, str] = field(default_factory=dict)
    network: NetworkPolicy = NO_NETWORK  # what the egress gate lets out (worker/egress.py)
    memory_mb: int = 512
    cpus: float = 1.0
    pids: int = 256
    disk_mb: int = 1024  # quota of /workspace and /tmp together
    template: str = "default"  # what it starts as (worker/pool.py TEMPLATES)
    pool: bool = True  # a provision may hand out a pooled sandbox for it (worker/pool.py)
    image: ImageSpec | None = None  # None: the host's /usr read-only (the built-in templates)
    # persistent workspaces bound into it (worker/workspaces.py), each for its recorded owner
    workspaces: tuple[ResolvedMount, ...] = ()

    def resources(self) -> dict[str, int | float]:
        return {
            "memory_mb": self.memory_mb,
            "cpus": self.cpus,
            "pids": self.pids,
            "disk_mb": self.disk_mb,
        }


@dataclass
class RunningSandbox:
    spec: SandboxSpec
    process: ChildProcess  # stdin/stdout are the agent's frame pipes
    workspace: Path  # where the worker reaches /workspace (while the sandbox runs)
    # runtime-private handles (uid lease, cgroup paths, ...) needed by stop()
    private: dict[str, Any] = field(default_factory=dict)
    # what the worker measures it by (worker/metrics.py): its leaf cgroups, one per hierarchy
    # (none: its process tree instead); the mount point of its own file system (/workspace
    # and /tmp), or without one the host directories it writes to on a shared file system
    cgroup_dirs: tuple[Path, ...] = ()
    disk: Path | None = None
    scratch: tuple[Path, ...] = ()
    upper: Path | None = None  # a template sandbox's overlay upper directory (rootfs.py)
    # whole files on its own disk, written and read by the worker itself (disk_files.py);
    # None: every file call goes to the agent
    files: DiskFiles | None = None
    # where the kernel counts the processes it killed at the sandbox's memory limit (v2
    # `memory.events`, v1 `memory.oom_control`: `oom_kill N`); None without a memory cgroup
    oom_counter: Path | None = None


class Runtime(Protocol):
    name: str

    def features(self) -> dict[str, Any]:
        """What this runtime enforces on this host, reported to the control plane.

        Never claims a protection it does not apply: e.g. {"isolation": "bwrap",
        "user_namespace": True, "seccomp": True, "network": "none", "limits": {"memory":
        True, "pids": True, "cpu": True}, "cgroup": "v1"}.
        """
        ...

    async def prepare(self) -> None:
        """Once at worker start: check the host, remove leftovers of an earlier crash."""
        ...

    async def start(self, spec: SandboxSpec) -> RunningSandbox:
        """Create the sandbox and start its agent. On failure nothing is left behind."""
        ...

    async def stop(self, sandbox: RunningSandbox) -> None:
        """Kill every process of the sandbox and remove its files, cgroups and mounts."""
        ...

    async def close(self) -> None:
        """Once at worker stop, after every sandbox was stopped: remove the worker's own
        host resources (its cgroup parents). Leaves anything still in use alone."""
        ...
