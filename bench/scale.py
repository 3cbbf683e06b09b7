"""Create and execute as one worker fills up: N = 10, 100, 500, 1,000 sandboxes held.

    .venv/bin/python bench/scale.py [--steps 10,100,500,1000] [--m 30] [--memory-mb 32]

Starts a sandgate server (SQLite) and one bwrap worker (bench/stack.py) with room for the
largest N (`--capacity`, memory and disk overcommitted: the sandboxes are idle), then at each
step fills the worker up to N sandboxes (`memory_mb` small, made 4 at a time, not measured),
waits for the machine to be idle again (at most 30 s) and measures with N held:

- `execute` of `echo ok` on a held sandbox, 3 `--m` times;
- `GET /api/v1/sandboxes?limit=100` (one page of the tenant's list), `--m` times;
- create-to-running of `--m` more sandboxes, one at a time, each deleted after (outside the
  timing), so N stays N (last: what the kernel still does for a delete after it has been
  answered would otherwise be timed as the executes');
- memory: PSS of every process below the worker (sandboxes' bwrap, init and agent) / N.

Prints one line per step and the ratio create p50 at the largest N over the smallest (the
target: at most 1.15).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import Stack, pss_kib, running


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def pss_mib(pids: list[int]) -> float:
    return sum(pss_kib(pid) for pid in pids) / 1024


# memory and disk overcommitted: the sandboxes held are idle
WORKER_ARGS = ("--memory-overcommit", "64", "--disk-overcommit", "64")


def cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields)  # idle + iowait


def settle(quiet: float = 0.8, window: float = 0.5, most: float = 30.0) -> float:
    """Wait until the machine is idle (`quiet` of its CPU time in two windows running), or
    `most` seconds: what a fill leaves behind (the kernel ending namespaces and cgroups, the
    worker's heartbeats and spare namespaces) must not be timed as create. Seconds waited."""
    started, calm = time.monotonic(), 0
    while calm < 2 and time.monotonic() - started < most:
        idle0, total0 = cpu_times()
        time.sleep(window)
        idle1, total1 = cpu_times()
        calm = calm + 1 if (idle1 - idle0) >= quiet * max(1, total1 - total0) else 0
    return time.monotonic() - started


def fill(stack: Stack, body: dict[str, Any], count: int) -> list[str]:
    """Create `count` sandboxes of `body`, 4 at a time (not measured); their names."""
    headers = {"Authorization": f"Bearer {stack.key}"}

    def create(_: int) -> str:
        with httpx.Client(base_url=stack.url, headers=headers, timeout=120) as own:
            made = own.post("/api/v1/sandboxes", json=body)
            assert made.status_code == 201, made.text
            return str(made.json()["name"])

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(create, range(count)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", default="10,100,500,1000")
    parser.add_argument("--m", type=int, default=30, help="timed operations of each kind")
    parser.add_argument("--memory-mb", type=int, default=32)
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    body = {"resources": {"memory_mb": args.memory_mb}, "timeout": 7200}
    capacity = max(steps) + 50
    rows = []
    with running(*WORKER_ARGS, capacity=capacity) as stack:
        headers = {"Authorization": f"Bearer {stack.key}"}
        client = httpx.Client(base_url=stack.url, headers=headers, timeout=120)
        held: list[str] = []

        for n in steps:
            started = time.monotonic()
            held += fill(stack, body, n - len(held))
            fill_s = time.monotonic() - started
            settled_s = settle()
            executes = []
            target = held[len(held) // 2]
            for _ in range(args.m * 3):
                t = time.perf_counter()
                ran = client.post(f"/api/v1/sandboxes/{target}/execute", json={"code": "echo ok"})
                executes.append((time.perf_counter() - t) * 1000)
                assert ran.json()["stdout"] == "ok\n", ran.text
            lists = []
            for _ in range(args.m):
                t = time.perf_counter()
                assert client.get("/api/v1/sandboxes", params={"limit": 100}).is_success
                lists.append((time.perf_counter() - t) * 1000)
            creates = []
            for _ in range(args.m):
                t = time.perf_counter()
                made = client.post("/api/v1/sandboxes", json=body)
                creates.append((time.perf_counter() - t) * 1000)
                assert made.status_code == 201, made.text
                client.delete(f"/api/v1/sandboxes/{made.json()['name']}")
            per_sandbox = pss_mib(descendants(stack.worker_pid)) / len(held)
            rows.append((n, creates, executes, lists, per_sandbox))
            print(
                f"N={n:>5}  create p50 {statistics.median(creates):7.2f} ms p99 "
                f"{pct(creates, 99):7.2f}   execute p50 {statistics.median(executes):6.2f} ms   "
                f"list p50 {statistics.median(lists):6.2f} ms   {per_sandbox:5.2f} MiB/sandbox"
                f"   (filled in {fill_s:.1f} s, settled in {settled_s:.1f} s)",
                flush=True,
            )
    first, last = rows[0], rows[-1]
    ratio = statistics.median(last[1]) / statistics.median(first[1])
    verdict = "met" if ratio <= 1.15 else "not met"
    print(
        f"\ncreate p50 at N={last[0]} / at N={first[0]}: {ratio:.2f}x   target <= 1.15x: {verdict}"
    )


if __name__ == "__main__":
    main()
