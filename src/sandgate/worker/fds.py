"""File descriptors per sandbox, bounded by a share of the host's file table.

Linux has no per-cgroup count of open files: `fs.file-max` is one table for the host, and
`RLIMIT_NOFILE` bounds each process. A sandbox can hold at most `pids` processes, so giving
each `nofile = share * file-max / pids` descriptors bounds the whole sandbox to `share` of
the table. Each process gets at least MIN_NOFILE; the worker therefore never gives one sandbox
more than `share * file-max / MIN_NOFILE` processes (`worker.budget`), so the floor cannot
take a sandbox past its share. (A file kept only by a mapping, with its descriptor closed,
is charged to the sandbox's memory cgroup instead: struct file is kernel memory accounted
to it.)
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_FD_SHARE = 0.1  # of the host's fs.file-max, per sandbox at its limits
MIN_NOFILE = 64  # below this hardly a shell runs
MAX_NOFILE = 1 << 20


def nofile_for(pids: int, *, share: float, file_max: int, nr_open: int) -> int:
    """RLIMIT_NOFILE (soft and hard) for every process of a sandbox of `pids` processes."""
    per_process = int(share * file_max) // max(pids, 1)
    return max(MIN_NOFILE, min(per_process, nr_open, MAX_NOFILE))


def host_file_limits(proc_sys: Path = Path("/proc/sys/fs")) -> tuple[int, int]:
    """(file-max, nr_open) of this host."""
    file_max = int((proc_sys / "file-max").read_text().split()[0])
    nr_open = int((proc_sys / "nr_open").read_text().split()[0])
    return file_max, nr_open
