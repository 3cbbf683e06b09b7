"""Where the sandbox path's time goes: py-spy on the server, the worker and the sandbox's
agent while a client drives one kind of request, summed into buckets per process.

    .venv/bin/python bench/profile_path.py [--seconds 15] [--rate 2000] [--size 1048576]

Starts a sandgate server (SQLite) and one bwrap worker (bench/stack.py) and one sandbox, then
for each scenario (`execute` of `echo ok`, a `--size` upload, a `--size` download) runs the
client in a loop for `--seconds` while `py-spy record --nonblocking` samples the three
processes (the server, the worker, the agent in the sandbox). Each sample is put in the bucket
of its innermost frame that a rule below knows (JSON inside the frame code counts as frames,
pydantic inside FastAPI as validation...); only samples of a thread holding the GIL count
(`--gil`: Python running, not waiting), and a bucket's CPU per request is its samples /
rate / requests. Wall time the processes do not spend on a CPU (the kernel's pipes, sockets,
fork and exec, the shell itself) is what the sum leaves of the client's latency.

Needs root (py-spy reads the other processes' memory) and py-spy (`pip install py-spy`).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import running

# (bucket, a pattern of the frame's file) in the order a frame is tried against them
RULES: tuple[tuple[str, str], ...] = (
    ("frames: encode/decode, JSON", r"sandgate/agent/frames\.py|/json/|msgpack"),
    (
        "logging, metrics",
        r"/logging/|structlog|prometheus_client|sandgate/log_context|sandgate/api/metrics",
    ),
    ("validation (pydantic)", r"pydantic"),
    ("HTTP server (uvicorn, h11)", r"uvicorn/|/h11/|httptools"),
    ("routing, middleware (starlette, fastapi)", r"starlette/|fastapi/"),
    ("HTTP client (httpx)", r"httpx/|httpcore/|anyio/"),
    ("WebSocket (websockets)", r"websockets/"),
    ("store (SQLAlchemy, SQLite)", r"sandgate/store/|sqlalchemy|aiosqlite|sqlite3"),
    ("auth, caches", r"sandgate/api/deps|sandgate/control/state"),
    ("tunnel RPC", r"sandgate/tunnel/"),
    ("API routes and middleware", r"sandgate/api/"),
    ("control services", r"sandgate/control/|sandgate/workers/"),
    ("worker dispatch", r"sandgate/worker/"),
    (
        "agent: spawn, pipes",
        r"subprocess\.py|_posixsubprocess|sandgate/agent/(execute|children|pump|output)",
    ),
    ("agent: files", r"sandgate/agent/files|sandgate/agent/paths"),
    ("agent: other", r"sandgate/agent/"),
    ("event loop (asyncio, selectors)", r"asyncio/|selectors\.py|uvloop"),
)


def bucket_of(stack: str) -> str:
    frames = stack.split(";")
    for frame in reversed(frames):  # innermost first
        for name, pattern in RULES:
            if re.search(pattern, frame):
                return name
    return "other (interpreter, C code)"


def read_raw(path: Path) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    if not path.exists():
        return counts
    for raw in path.read_text(errors="replace").splitlines():
        stack, _, n = raw.rpartition(" ")
        if stack.endswith("(asyncio/runners.py:118)"):
            continue  # the loop waiting in epoll (seen as running without the GIL check)
        if n.isdigit():
            counts[bucket_of(stack)] += int(n)
    return counts


def agent_pid(worker_pid: int) -> int | None:
    """The newest agent below the worker: a python running agent.py (the sandbox's)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    commands: dict[int, bytes] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            commands[int(entry.name)] = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        children[ppid].append(int(entry.name))
    below, todo = [], [worker_pid]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            below.append(child)
            todo.append(child)
    agents = [pid for pid in below if b"agent.py" in commands.get(pid, b"")]
    return max(agents) if agents else None


def profile(
    label: str,
    action: Callable[[], None],
    pids: dict[str, int],
    seconds: float,
    rate: int,
    work: Path,
) -> None:
    for _ in range(20):
        action()  # warm-up
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    outputs = {role: work / f"{label}-{role}.txt" for role in pids}
    spies = [
        subprocess.Popen(
            [
                py_spy,
                "record",
                "--pid",
                str(pid),
                "--rate",
                str(rate),
                "--duration",
                str(int(seconds)),
                "--format",
                "raw",
                "--nonblocking",
                "--gil",
                "--output",
                str(outputs[role]),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for role, pid in pids.items()
    ]
    time.sleep(1.0)  # py-spy attached
    latencies: list[float] = []
    stop = threading.Event()
    threading.Timer(seconds - 1.5, stop.set).start()
    while not stop.is_set():
        start = time.perf_counter()
        action()
        latencies.append((time.perf_counter() - start) * 1000)
    for spy in spies:
        spy.wait(seconds + 30)
    n = len(latencies)
    p50 = statistics.median(latencies)
    print(f"\n## {label}: {n} requests, client p50 {p50:.3f} ms")
    total = 0.0
    for role in pids:
        counts = read_raw(outputs[role])
        cpu = sum(counts.values()) / rate / n * 1000
        total += cpu
        print(f"  {role:<7} CPU {cpu:6.3f} ms per request")
        for name, samples in counts.most_common():
            ms = samples / rate / n * 1000
            if ms >= 0.005:
                print(f"    {ms:6.3f} ms  {name}")
    print(
        f"  sum of CPU in the three processes: {total:.3f} ms; the rest of p50 "
        f"({max(0.0, p50 - total):.3f} ms) is off-CPU: kernel I/O, fork/exec, the shell, "
        "the client"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--rate", type=int, default=2000)
    parser.add_argument("--size", type=int, default=1 << 20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sandgate-profile-"))
    payload = bytes(range(256)) * (args.size // 256)
    with running(capacity=4) as stack:
        client = httpx.Client(
            base_url=stack.url, headers={"Authorization": f"Bearer {stack.key}"}, timeout=60
        )
        made = client.post("/api/v1/sandboxes", json={"timeout": 3600})
        made.raise_for_status()
        name = made.json()["name"]
        agent = agent_pid(stack.worker_pid)
        pids = {"server": stack.server_pid, "worker": stack.worker_pid}
        if agent is not None:
            pids["agent"] = agent
        files = f"/api/v1/sandboxes/{name}/toolbox/files"
        client.put(files, params={"path": "down.bin"}, content=payload).raise_for_status()

        def execute() -> None:
            got = client.post(f"/api/v1/sandboxes/{name}/execute", json={"code": "echo ok"})
            assert got.json()["stdout"] == "ok\n"

        def upload() -> None:
            assert client.put(files, params={"path": "up.bin"}, content=payload).is_success

        def download() -> None:
            assert client.get(files, params={"path": "down.bin"}).content == payload

        mib = args.size / (1 << 20)
        profile("execute echo", execute, pids, args.seconds, args.rate, work)
        profile(f"upload {mib:g} MiB", upload, pids, args.seconds, args.rate, work)
        profile(f"download {mib:g} MiB", download, pids, args.seconds, args.rate, work)
    print(f"\nraw py-spy stacks: {work}")


if __name__ == "__main__":
    main()
