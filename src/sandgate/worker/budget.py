"""What this worker's host can give its sandboxes (`core.placement` has the rules).

Measured once at start:
- memory: MemTotal less a reserve for the host itself (10 %, at least 256 MiB), times
  `--memory-overcommit` (1.0: the sum of the sandboxes' memory limits never exceeds what the
  host has; above 1 the kernel's OOM killer may have to choose between sandboxes);
- disk: the space free for the state directory (after the images of sandboxes left behind
  are removed), less 5 %, times `--disk-overcommit` (images are sparse: above 1 they can
  together fill the disk only if every sandbox fills its quota);
- one sandbox: at most the whole budget of memory and disk, the host's CPUs, and a quarter
  of the host's `kernel.pid_max`, and never so many processes that even at the smallest
  descriptor limit (`fds.MIN_NOFILE`) they could hold more than `fd_share` of `file-max`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sandgate.worker import fds

MEMORY_RESERVE_SHARE = 0.10
MEMORY_RESERVE_MIN_MB = 256
DISK_RESERVE_SHARE = 0.05
PIDS_SHARE = 0.25


def mem_total_mb(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise ValueError("no MemTotal in /proc/meminfo")


def measure(
    state_dir: Path,
    *,
    memory_overcommit: float = 1.0,
    disk_overcommit: float = 1.0,
    disk_quota: bool = True,
    fd_share: float = fds.DEFAULT_FD_SHARE,
) -> dict[str, Any]:
    """The `enforces` entry of this worker's features."""
    total = mem_total_mb()
    reserve = max(MEMORY_RESERVE_MIN_MB, int(total * MEMORY_RESERVE_SHARE))
    memory = int(max(0, total - reserve) * memory_overcommit)
    st = os.statvfs(state_dir)
    free_mb = (st.f_bavail * st.f_frsize) >> 20
    disk = int(free_mb * (1 - DISK_RESERVE_SHARE) * disk_overcommit)
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text().split()[0])
    file_max, _ = fds.host_file_limits()
    budget = {"memory_mb": memory}
    sandbox_max: dict[str, float] = {
        "memory_mb": memory,
        "cpus": float(os.cpu_count() or 1),
        "pids": min(int(pid_max * PIDS_SHARE), int(fd_share * file_max) // fds.MIN_NOFILE),
    }
    if disk_quota:  # without a quota a sandbox's disk use is not bounded: nothing to count
        budget["disk_mb"] = disk
        sandbox_max["disk_mb"] = disk
    return {
        "budget": budget,
        "sandbox_max": sandbox_max,
        "overcommit": {"memory": memory_overcommit, "disk": disk_overcommit},
    }
