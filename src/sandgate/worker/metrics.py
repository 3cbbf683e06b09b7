"""What one running sandbox uses, measured by its worker: the `metrics` tunnel op.

Real figures only: each comes from what the kernel reports about this very sandbox; where
the host has no exact figure (no cgroup, no disk of its own), the list below says what is
measured instead.
The parsing functions are pure; `read_cpu`, `read_usage` and `walk_usage` read the files
(blocking: call them in a thread); `measure` puts them together.

Where each figure comes from, the first source the sandbox has:

* CPU time: its cgroup v2 group's `cpu.stat` `usage_usec` (every v2 group has it, with or
  without the cpu controller, so a hybrid host's v2 group for `cgroup.kill` gives it), a v1
  `cpuacct.usage` (ns) where cpuacct is mounted with cpu, else its process tree in /proc
  (utime + stime of each process, and of the children they reaped). `cpu_used_pct` is that
  time over a wall-clock window, as a share of `cpu_count`: against the previous sample of
  this sandbox when it is 0.1 to 30 s old (the time since the last metrics call), else over
  a fresh 0.1 s window.
* `cpu_count`: its cgroup CPU limit (v2 `cpu.max`, v1 `cpu.cfs_quota_us`/`cpu.cfs_period_us`)
  rounded up, at least 1; the host's CPU count when it has none (the process runtime).
* memory: v2 `memory.current`, `memory.max` and `memory.stat` `file`; v1
  `memory.usage_in_bytes`, `memory.limit_in_bytes` and `memory.stat` `total_cache`. Without a
  memory cgroup (the process runtime): the summed PSS of its process tree as used, the
  file-backed part of it (`Pss_File`) as cache, the host's memory as total. The total is
  never more than the host's memory (a v1 group without a limit reports 2^63).
* disk: with a file system of its own (`worker/disk.py`, the kernel's quota): statvfs of it,
  so used is everything on it, /workspace and /tmp together, and total the image's size less
  what ext4 keeps for itself (inode tables, bitmaps).
  Without one: total is the size of the file system its workspace is on, and used is what
  its writable directories hold (the blocks of every file, walked), or, when they hold more
  than `MAX_WALK_ENTRIES` entries, the whole file system's used space (`disk_scope` says
  which).
"""

from __future__ import annotations

import asyncio
import math
import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sandgate.worker.runtime.base import RunningSandbox

CPU_WINDOW = 0.1  # seconds between two CPU samples when there is no recent previous one
SAMPLE_MAX_AGE = 30.0  # a previous sample older than this is stale: a fresh window instead
MAX_WALK_ENTRIES = 20_000  # a shared-disk sandbox's directories walked for their usage
V1_NO_LIMIT = 1 << 62  # a v1 memory limit at or above this is "none" (the kernel's is ~2^63)

DiskScope = Literal["sandbox", "directories", "file_system"]


# -- parsing (pure) -------------------------------------------------------------------------


def parse_keyed(text: str) -> dict[str, int]:
    """A flat-keyed cgroup file (`cpu.stat`, `memory.stat`): `key value` per line."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        try:
            found[key] = int(value.strip())
        except ValueError:
            continue
    return found


def parse_cpu_max(text: str) -> float | None:
    """v2 `cpu.max` (`$QUOTA $PERIOD`, quota `max` when unlimited): the CPUs it allows."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    return cpu_limit(int(parts[0]), int(parts[1]))


def cpu_limit(quota_us: int, period_us: int) -> float | None:
    """CPUs a CFS quota allows (v1 `cpu.cfs_quota_us` is -1 when unlimited)."""
    if quota_us <= 0 or period_us <= 0:
        return None
    return quota_us / period_us


def parse_memory_max(text: str) -> int | None:
    """v2 `memory.max` or v1 `memory.limit_in_bytes`: the limit in bytes, None for none."""
    value = text.strip()
    if value == "max":
        return None
    limit = int(value)
    return None if limit >= V1_NO_LIMIT else limit


def parse_meminfo_total(text: str) -> int:
    """`MemTotal` of /proc/meminfo, in bytes."""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise ValueError("no MemTotal in /proc/meminfo")


def parse_proc_stat(data: bytes) -> tuple[int, int]:
    """(parent pid, CPU clock ticks: utime + stime + cutime + cstime) of a /proc/<pid>/stat."""
    # the comm field may contain spaces and parentheses: the fields start after the last ')'
    fields = data[data.rfind(b")") + 2 :].split()
    return int(fields[1]), sum(int(f) for f in fields[11:15])


def parse_smaps_rollup(text: str) -> tuple[int, int]:
    """(PSS, file-backed PSS) in bytes of a /proc/<pid>/smaps_rollup."""
    values = {"Pss:": 0, "Pss_File:": 0}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in values:
            values[parts[0]] = int(parts[1]) * 1024
    return values["Pss:"], values["Pss_File:"]


def descendants(parents: dict[int, int], root: int) -> list[int]:
    """`root` and every pid below it, from a pid -> parent pid map."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], [root] if root in parents else []
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def cpu_count_of(limit: float | None, host_cpus: int) -> int:
    """The sandbox's CPUs: its limit rounded up (at least 1), else the host's."""
    if limit is None:
        return max(1, host_cpus)
    return max(1, math.ceil(limit - 1e-9))


def cpu_percent(used_usec: int, window_s: float, cpu_count: int) -> float:
    """CPU time used over a wall-clock window, as a percentage of `cpu_count` CPUs."""
    if window_s <= 0:
        return 0.0
    share = used_usec / (window_s * 1e6 * cpu_count) * 100.0
    return round(min(100.0, max(0.0, share)), 2)


def disk_of(st: os.statvfs_result) -> tuple[int, int]:
    """(used, total) bytes of a file system."""
    total = st.f_blocks * st.f_frsize
    return total - st.f_bfree * st.f_frsize, total


# -- reading (blocking) ---------------------------------------------------------------------


@dataclass(frozen=True)
class CpuSample:
    """A sandbox's CPU time (µs) at a moment of the worker's monotonic clock."""

    at: float
    usec: int


@dataclass(frozen=True)
class Usage:
    cpu_limit: float | None  # CPUs its cgroup allows; None: no limit
    mem_used: int
    mem_limit: int | None  # bytes its cgroup allows; None: no limit (or no memory cgroup)
    mem_cache: int
    disk_used: int
    disk_total: int
    disk_scope: DiskScope


@dataclass(frozen=True)
class Metrics:
    timestamp: float  # unix seconds
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    mem_cache: int
    disk_used: int
    disk_total: int
    disk_scope: DiskScope

    def header(self) -> dict[str, Any]:
        return {
            "timestamp": self.timestamp,
            "cpu_count": self.cpu_count,
            "cpu_used_pct": self.cpu_used_pct,
            "mem_used": self.mem_used,
            "mem_total": self.mem_total,
            "mem_cache": self.mem_cache,
            "disk_used": self.disk_used,
            "disk_total": self.disk_total,
            "disk_scope": self.disk_scope,
        }


def _read(path: Path) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _tree(root: int) -> list[int]:
    """`root` and its live descendants, from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    parents[int(entry)] = parse_proc_stat(f.read())[0]
            except (OSError, ValueError, IndexError):
                continue
    return descendants(parents, root)


def _tree_ticks(root: int) -> int:
    ticks = 0
    for pid in _tree(root):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                ticks += parse_proc_stat(f.read())[1]
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile: what it used is in its parent's cutime once reaped
    return ticks


def read_cpu(running: RunningSandbox) -> CpuSample:
    """The sandbox's CPU time now (see the module docstring for the source)."""
    for d in running.cgroup_dirs:
        text = _read(d / "cpu.stat")
        if text is not None and "usage_usec" in (stats := parse_keyed(text)):
            return CpuSample(time.monotonic(), stats["usage_usec"])
    for d in running.cgroup_dirs:
        text = _read(d / "cpuacct.usage")
        if text is not None:
            return CpuSample(time.monotonic(), int(text) // 1000)
    ticks = _tree_ticks(running.process.pid)
    return CpuSample(time.monotonic(), ticks * 1_000_000 // os.sysconf("SC_CLK_TCK"))


def _cpu_limit(dirs: Iterable[Path]) -> float | None:
    for d in dirs:
        text = _read(d / "cpu.max")
        if text is not None:
            return parse_cpu_max(text)
        quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        if quota is not None and period is not None:
            return cpu_limit(int(quota), int(period))
    return None


def read_oom_kills(counter: Path) -> int | None:
    """How many processes the kernel has killed at a group's memory limit: `oom_kill` of v2
    `memory.events` or v1 `memory.oom_control` (`RunningSandbox.oom_counter`). None if
    unreadable (the group is gone, or a kernel before 4.13 has no such line)."""
    try:
        return parse_keyed(_read(counter) or "").get("oom_kill")
    except OSError:
        return None


def _cgroup_memory(dirs: Iterable[Path]) -> tuple[int, int | None, int] | None:
    """(used, limit, cache) from the sandbox's memory cgroup; None without one."""
    for d in dirs:
        current = _read(d / "memory.current")  # v2
        if current is not None:
            limit = _read(d / "memory.max") or "max"
            cache = parse_keyed(_read(d / "memory.stat") or "").get("file", 0)
            return int(current), parse_memory_max(limit), cache
        usage = _read(d / "memory.usage_in_bytes")  # v1
        if usage is not None:
            limit = _read(d / "memory.limit_in_bytes") or str(V1_NO_LIMIT)
            stats = parse_keyed(_read(d / "memory.stat") or "")
            cache = stats.get("total_cache", stats.get("cache", 0))
            return int(usage), parse_memory_max(limit), cache
    return None


def _tree_memory(root: int) -> tuple[int, int]:
    """(PSS, file-backed PSS) of the process tree below `root`."""
    used = cache = 0
    for pid in _tree(root):
        text = _read(Path(f"/proc/{pid}/smaps_rollup"))
        if text is not None:
            pss, pss_file = parse_smaps_rollup(text)
            used, cache = used + pss, cache + pss_file
    return used, cache


def walk_usage(tops: Iterable[Path], limit: int = MAX_WALK_ENTRIES) -> int | None:
    """Bytes allocated to every file and directory below `tops` (hard links once, other file
    systems skipped, symbolic links never followed: the walk is by descriptor, so a sandbox
    renaming its directories meanwhile cannot lead it elsewhere). None past `limit` entries."""
    seen: set[tuple[int, int]] = set()
    total = entries = 0
    for top in tops:
        try:
            top_st = os.lstat(top)
        except OSError:
            continue
        if not stat.S_ISDIR(top_st.st_mode):
            continue
        total += top_st.st_blocks * 512
        for _, dirs, files, dir_fd in os.fwalk(top, follow_symlinks=False):
            below = []
            for name in (*dirs, *files):
                entries += 1
                if entries > limit:
                    return None
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile
                if st.st_dev != top_st.st_dev:
                    continue  # a mount point: another file system's
                if stat.S_ISDIR(st.st_mode):
                    below.append(name)
                elif st.st_nlink > 1:
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
            dirs[:] = below
    return total


def read_usage(running: RunningSandbox) -> Usage:
    """Memory and disk of the sandbox now, and its CPU limit."""
    dirs = running.cgroup_dirs
    memory = _cgroup_memory(dirs)
    if memory is None:
        pss, pss_file = _tree_memory(running.process.pid)
        memory = (pss, None, pss_file)
    scope: DiskScope
    if running.disk is not None:
        disk_used, disk_total = disk_of(os.statvfs(running.disk))
        scope = "sandbox"
    else:
        fs_used, disk_total = disk_of(os.statvfs(running.workspace))
        walked = walk_usage(running.scratch or (running.workspace,))
        disk_used, scope = (fs_used, "file_system") if walked is None else (walked, "directories")
    return Usage(_cpu_limit(dirs), *memory, disk_used, disk_total, scope)


def host_memory() -> int:
    return parse_meminfo_total(_read(Path("/proc/meminfo")) or "")


async def measure(running: RunningSandbox, previous: CpuSample | None) -> tuple[Metrics, CpuSample]:
    """The sandbox's metrics now, and the CPU sample to keep for the next call.

    CPU use is measured against `previous` when it is recent (see the module docstring),
    else over a fresh `CPU_WINDOW`. The reads run in a thread: /proc and a walk take time.
    """
    sample = await asyncio.to_thread(read_cpu, running)
    if (
        previous is None
        or not CPU_WINDOW <= sample.at - previous.at <= SAMPLE_MAX_AGE
        or sample.usec < previous.usec  # a process tree's time lost an exited process
    ):
        previous = sample
        await asyncio.sleep(CPU_WINDOW)
        sample = await asyncio.to_thread(read_cpu, running)
    usage = await asyncio.to_thread(read_usage, running)
    memory = await asyncio.to_thread(host_memory)
    cpus = cpu_count_of(usage.cpu_limit, os.cpu_count() or 1)
    mem_total = memory if usage.mem_limit is None else min(usage.mem_limit, memory)
    metrics = Metrics(
        timestamp=time.time(),
        cpu_count=cpus,
        cpu_used_pct=cpu_percent(
            max(0, sample.usec - previous.usec), sample.at - previous.at, cpus
        ),
        mem_used=usage.mem_used,
        mem_total=mem_total,
        mem_cache=usage.mem_cache,
        disk_used=usage.disk_used,
        disk_total=usage.disk_total,
        disk_scope=usage.disk_scope,
    )
    return metrics, sample
