"""Moves into cgroups without a wait for RCU: the cgroup2 option `favordynmods`.

Every sandbox start moves its first process into the sandbox's groups: a write of its pid
to `cgroup.procs` in each hierarchy (`root_step.py`). By default the kernel guards such
a move with one per-CPU rwsem for the whole host, and taking it for writing waits for an RCU
grace period unless another move came just before. Sandbox starts are spaced further apart
than that, so each one waited: 7-14 ms of a 50 ms create on a 2-CPU VM (docs/benchmarks.md,
"Session 16").

`favordynmods`, an option of the cgroup2 hierarchy (Linux 6.1+), keeps that rwsem in the
mode in which a move takes it at once; forks and exits pay a little more instead (from
Linux 6.18, a move takes a per-process rwsem). The rwsem is shared by every hierarchy, v1
ones too, so the one switch on the cgroup2 mount serves a hybrid host as well. It holds for
the whole host until it is turned off (from 6.18, until the next boot).

The worker sets it once at start, where it may: it reconfigures the cgroup2 superblock
(`fspick` + `fsconfig`) with the options it has plus this one, so nothing else changes; the
mount's own flags (nosuid, ...) are not touched.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sandgate.worker import syscalls
from sandgate.worker.cgroups import mount_entries

log = logging.getLogger(__name__)

OPTION: Final = "favordynmods"
# the common syscall table (the same numbers on every architecture)
_SYS_FSCONFIG: Final = 431
_SYS_FSPICK: Final = 433
_AT_FDCWD: Final = -100
_FSPICK_CLOEXEC: Final = 0x1
_FSCONFIG_SET_FLAG: Final = 0
_FSCONFIG_CMD_RECONFIGURE: Final = 7
# generic superblock flags in mountinfo's super options: not cgroup2 parameters
_GENERIC: Final = frozenset({"rw", "ro"})


@dataclass(frozen=True)
class Cgroup2Mount:
    mount_point: Path
    options: tuple[str, ...]  # its superblock's cgroup2 options (nsdelegate, ...)


def find_cgroup2(mountinfo: str) -> Cgroup2Mount | None:
    """The first cgroup2 mount in a /proc/<pid>/mountinfo text, or None."""
    for entry in mount_entries(mountinfo):
        if entry.fstype == "cgroup2":
            options = tuple(o for o in entry.super_options if o and o not in _GENERIC)
            return Cgroup2Mount(entry.mount_point, options)
    return None


def favor(
    mountinfo: Path = Path("/proc/self/mountinfo"),
    features: Path = Path("/sys/kernel/cgroup/features"),
) -> str | None:
    """Turn `favordynmods` on for the host's cgroup2 hierarchy if it is not on: None once
    it is on, else why it is not (the worker then starts sandboxes as before, only slower)."""
    try:
        found = find_cgroup2(mountinfo.read_text())
    except OSError as exc:
        return f"cannot read {mountinfo}: {exc.strerror}"
    if found is None:
        return "no cgroup2 hierarchy is mounted"
    if OPTION in found.options:
        return None
    try:
        offered = features.read_text().split()
    except OSError:
        offered = []
    if OPTION not in offered:
        return f"this kernel has no cgroup2 option {OPTION} (Linux 6.1 or later has it)"
    try:
        _reconfigure(found.mount_point, (*found.options, OPTION))
        now = find_cgroup2(mountinfo.read_text())
    except OSError as exc:
        return f"cannot set {OPTION} on {found.mount_point}: {exc.strerror}"
    if now is None or OPTION not in now.options:  # e.g. from a cgroup namespace of its own
        return f"{OPTION} did not take on {found.mount_point} (a cgroup namespace of its own?)"
    log.info("cgroup.favordynmods_on mount=%s (host-wide)", found.mount_point)
    return None


def _reconfigure(mount_point: Path, options: tuple[str, ...]) -> None:
    """Reconfigure the superblock mounted at `mount_point` to exactly these flag options."""
    fd = syscalls.call(
        _SYS_FSPICK, _AT_FDCWD, os.fsencode(mount_point), ctypes.c_uint(_FSPICK_CLOEXEC)
    )
    try:
        for option in options:
            syscalls.call(
                _SYS_FSCONFIG,
                fd,
                ctypes.c_uint(_FSCONFIG_SET_FLAG),
                option.encode(),
                None,
                ctypes.c_int(0),
            )
        syscalls.call(
            _SYS_FSCONFIG, fd, ctypes.c_uint(_FSCONFIG_CMD_RECONFIGURE), None, None, ctypes.c_int(0)
        )
    finally:
        os.close(fd)
