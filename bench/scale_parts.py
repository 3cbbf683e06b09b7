"""What a sandbox start is made of, timed on the host as one worker fills up.

    .venv/bin/python bench/scale_parts.py [--steps 10,500] [--m 10] [--memory-mb 32]

Starts a sandgate server (SQLite) and one bwrap worker (bench/stack.py), fills the worker to
each N (idle sandboxes, as in bench/scale.py), then times from the host, N held, the pieces
a start is built from, each outside sandgate: a new mount namespace (`unshare -m true`), a
minimal bwrap (`true` with /usr, /proc and /dev), the same bwrap running `python3 -c pass`,
`python3 -c pass` on the host, and a loop mount plus unmount of a fresh ext4 image
(`mount -o loop`, as `worker/disk.py` does). Also prints the host's mount count and the CPU
the held sandboxes, the worker and the server use while idle. A piece that grows with N is
one whose cost follows the host's mount table or its loop devices, not sandgate's own code.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import WORKER_ARGS, descendants, fill
from stack import running

MINIMAL_BWRAP = [
    "bwrap",
    "--unshare-all",
    "--ro-bind",
    "/usr",
    "/usr",
    "--symlink",
    "usr/lib",
    "/lib",
    "--symlink",
    "usr/lib64",
    "/lib64",
    "--symlink",
    "usr/bin",
    "/bin",
    "--proc",
    "/proc",
    "--dev",
    "/dev",
]


def timed(argv: list[str], m: int) -> float:
    """p50 of `m` runs of `argv`, in ms."""
    times = []
    for _ in range(m):
        started = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def loop_mount_ms(work: Path, m: int) -> float:
    image, point = work / "image", work / "point"
    if not image.exists():
        subprocess.run(["truncate", "-s", "32M", str(image)], check=True)
        subprocess.run(["mkfs.ext4", "-q", str(image)], check=True)
        point.mkdir()
    times = []
    for _ in range(m):
        started = time.perf_counter()
        subprocess.run(["mount", "-o", "loop", str(image), str(point)], check=True)
        subprocess.run(["umount", str(point)], check=True)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def cpu_s(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", default="10,500")
    parser.add_argument("--m", type=int, default=10, help="timed runs of each piece")
    parser.add_argument("--memory-mb", type=int, default=32)
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    body = {"resources": {"memory_mb": args.memory_mb}, "timeout": 7200}
    with (
        tempfile.TemporaryDirectory(prefix="sg-parts-") as tmp,
        running(*WORKER_ARGS, capacity=max(steps) + 50) as stack,
    ):
        held = 0
        for n in steps:
            held += len(fill(stack, body, n - held))
            time.sleep(2.0)  # let the worker settle (heartbeats, pool refills)
            groups = {
                "sandboxes": descendants(stack.worker_pid),
                "worker": [stack.worker_pid],
                "server": [stack.server_pid],
            }
            before, started = {k: cpu_s(v) for k, v in groups.items()}, time.monotonic()
            time.sleep(5.0)
            idle = {
                k: (cpu_s(v) - before[k]) / (time.monotonic() - started) for k, v in groups.items()
            }
            mounts = len(Path("/proc/self/mountinfo").read_text().splitlines())
            print(
                f"N={n:>5}  mounts {mounts:>5}   unshare -m {timed(['unshare', '-m', 'true'], args.m):6.2f} ms"
                f"   bwrap true {timed([*MINIMAL_BWRAP, 'true'], args.m):6.2f} ms"
                f"   bwrap python {timed([*MINIMAL_BWRAP, '/usr/bin/python3', '-c', 'pass'], args.m):6.2f} ms"
                f"   host python {timed(['/usr/bin/python3', '-c', 'pass'], args.m):6.2f} ms"
                f"   mount -o loop+umount {loop_mount_ms(Path(tmp), args.m):6.2f} ms"
                f"   idle cores: sandboxes {idle['sandboxes']:.3f} worker {idle['worker']:.3f}"
                f" server {idle['server']:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
