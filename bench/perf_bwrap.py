"""Where the kernel spends a bwrap start as a worker fills: `perf record` of 100 starts.

    .venv/bin/python bench/perf_bwrap.py
    perf report -i /tmp/perf-bwrap-1000.data --no-children --sort comm,sym --stdio

Fills one worker (bench/stack.py) to N = 10, then 1,000 sandboxes and, with the machine idle
again, records all CPUs (`perf record -a -g`) while 100 runs of a bwrap with what a
sandbox's bwrap does (a user and a pid namespace, /proc, /dev, `--disable-userns`) execute
one after another. Writes /tmp/perf-bwrap-<N>.data and prints how long the 100 took
(docs/benchmarks.md, "Scale, session 12").
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ns_parts import BASE, held_steps

ARGV = [*BASE, "--unshare-pid", "--proc", "/proc", "--dev", "/dev", "--disable-userns", "true"]


def main() -> None:
    loop = f"for i in $(seq 100); do {shlex.join(ARGV)}; done"
    for n in held_steps():
        started = time.perf_counter()
        record = ["perf", "record", "-q", "-a", "-g", "-o", f"/tmp/perf-bwrap-{n}.data"]
        subprocess.run([*record, "--", "sh", "-c", loop], check=True, stderr=subprocess.DEVNULL)
        print(f"N={n:>5}  100 bwrap starts in {time.perf_counter() - started:.2f} s", flush=True)


if __name__ == "__main__":
    main()
