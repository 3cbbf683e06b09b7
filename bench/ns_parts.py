"""What grows in a bwrap start as a worker fills: bwrap variants timed on the host.

    .venv/bin/python bench/ns_parts.py

Fills one worker (bench/stack.py) to N = 10, then 1,000 sandboxes and, with the machine idle
again, times 30 runs of `bwrap … true` with a user namespace and the sandbox's read-only
binds (A), then that plus one more of what a sandbox's bwrap does: a /proc (B), a /dev (C),
a pid namespace (D), both (E), an ipc namespace (F), `--disable-userns` (G), a cgroup
namespace (H). Each line prints the p50 in ms (docs/benchmarks.md, "Scale, session 12").
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import WORKER_ARGS, fill, settle
from stack import running

BASE = [
    "bwrap", "--unshare-user", "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib",
    "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/bin", "/bin",
]  # fmt: skip
VARIANTS = {
    "A user+binds": [],
    "B +proc": ["--proc", "/proc"],
    "C +dev": ["--dev", "/dev"],
    "D +pid": ["--unshare-pid"],
    "E +pid+proc": ["--unshare-pid", "--proc", "/proc"],
    "F +ipc": ["--unshare-ipc"],
    "G +disable-userns": ["--disable-userns"],
    "H +cgroup": ["--unshare-cgroup-try"],
}


def timed(argv: list[str], m: int = 30) -> float:
    times = []
    for _ in range(m):
        started = time.perf_counter()
        subprocess.run(argv, check=True)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def held_steps(steps: tuple[int, ...] = (10, 1000)) -> Iterator[int]:
    """One worker filled to each N of `steps` in turn (small, idle sandboxes), the machine
    idle again: yields N while they are held."""
    with running(*WORKER_ARGS, capacity=max(steps) + 50) as stack:
        held = 0
        for n in steps:
            fill(stack, {"resources": {"memory_mb": 32}, "timeout": 7200}, n - held)
            held = n
            settle()
            yield n


def main() -> None:
    for n in held_steps():
        parts = (f"{k} {timed([*BASE, *extra, 'true']):.2f}" for k, extra in VARIANTS.items())
        print(f"N={n:>5}  " + "  ".join(parts), flush=True)


if __name__ == "__main__":
    main()
