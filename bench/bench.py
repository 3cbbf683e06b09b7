"""sandgate benchmark: API latencies against baselines measured in the same run.

    .venv/bin/python bench/bench.py [--runtime bwrap] [--n 300] [--creates 40] [--no-e2b]

Starts a real `sandgate server` (SQLite) and `sandgate worker`, then measures:
- create-to-running latency (POST /api/v1/sandboxes until the 201), p50/p99;
- `execute` of `echo ok` through the API, p50/p99, and throughput with 8 concurrent clients;
- baselines: `subprocess.run(["bash", "-c", "echo ok"])` on the host, and the same command
  sent straight to an in-sandbox agent over its pipes (no HTTP, no tunnel);
- memory (PSS) per idle sandbox;
- with E2B's official Python SDK (sync, pointed at sandgate, on by default): `commands.run`
  of `echo ok` on one sandbox, p50/p99 over the same n as `execute`, and create-to-first-command
  (`Sandbox.create` until its first `commands.run` returns), p50/p99;
and prints the ratios API/baseline and the E2B overhead over the native `execute`. Numbers are
medians of one run on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

from sandgate.cli import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import pss_kib

ROOT = Path(__file__).resolve().parent.parent


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def summary(values: list[float]) -> str:
    return f"p50 {statistics.median(values):7.2f} ms   p99 {pct(values, 99):7.2f} ms   (n={len(values)})"


def sandgate(*args: str, env: dict[str, str] | None = None) -> str:
    return subprocess.run(
        [sys.executable, "-m", "sandgate", *args],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    ).stdout.strip()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def baseline_spawn(n: int) -> list[float]:
    times = []
    for i in range(n + 20):
        start = time.perf_counter()
        subprocess.run(["bash", "-c", "echo ok"], capture_output=True, check=True)
        if i >= 20:
            times.append((time.perf_counter() - start) * 1000)
    return times


async def baseline_agent(runtime_name: str, n: int, state_dir: Path) -> list[float]:
    """The same command through an in-sandbox agent, no HTTP and no tunnel in between."""
    from sandgate.worker.agent_link import AgentLink
    from sandgate.worker.main import install_agent
    from sandgate.worker.runtime.base import SandboxSpec

    agent_dir = state_dir / "agent"
    install_agent(agent_dir)
    if runtime_name == "bwrap":
        from sandgate.worker.runtime.bwrap import BwrapRuntime

        runtime = BwrapRuntime(state_dir, agent_dir, worker_name="bench-agent")
    else:
        from sandgate.worker.runtime.process import ProcessRuntime

        runtime = ProcessRuntime(state_dir, agent_dir, worker_name="bench-agent")
    await runtime.prepare()
    running = await runtime.start(SandboxSpec(name="bench-agent-sbx"))
    link = AgentLink("bench", running.process)
    serve = asyncio.ensure_future(link.serve())
    try:
        await asyncio.wait_for(link.ready.wait(), 20)
        times = []
        for i in range(n + 20):
            start = time.perf_counter()
            reply, output = await link.channel.call(
                "exec", language="bash", code="echo ok", timeout=10, env={}, cwd="/workspace"
            )
            assert output == b"ok\n" and reply["stdout_bytes"] == 3, reply
            if i >= 20:
                times.append((time.perf_counter() - start) * 1000)
        return times
    finally:
        await link.close()
        await runtime.stop(running)
        serve.cancel()
        await asyncio.gather(serve, return_exceptions=True)
        await runtime.close()  # its worker's cgroups too, as a worker's exit does


def pss_of_sandboxes(state_dir: Path, worker: str) -> tuple[float, int] | None:
    """Mean PSS (MiB) of the processes of each sandbox, read from its cgroup."""
    totals = []
    for group in Path("/sys/fs/cgroup/pids").glob(f"**/sandgate/{worker}-*/sbx-*"):
        pids = (group / "cgroup.procs").read_text().split()
        totals.append(sum(pss_kib(int(pid)) for pid in pids) / 1024)
    return (statistics.mean(totals), len(totals)) if totals else None


def e2b_run(url: str, key: str, n: int) -> list[float]:
    """`commands.run("echo ok")` through E2B's sync SDK on one sandbox, after 20 warm-up calls."""
    from e2b import Sandbox

    sbx = Sandbox.create(api_key=key, api_url=url, sandbox_url=url)
    try:
        times = []
        for i in range(n + 20):
            start = time.perf_counter()
            ran = sbx.commands.run("echo ok")
            elapsed = (time.perf_counter() - start) * 1000
            assert (ran.stdout, ran.exit_code) == ("ok\n", 0), ran
            if i >= 20:
                times.append(elapsed)
        return times
    finally:
        sbx.kill()


def e2b_create_to_first_command(url: str, key: str, m: int) -> list[float]:
    """From the `Sandbox.create` call to the end of its first `commands.run`, one sandbox at
    a time, each killed after (outside the timing); the first 2 are warm-ups."""
    from e2b import Sandbox

    times = []
    for i in range(m + 2):
        start = time.perf_counter()
        sbx = Sandbox.create(api_key=key, api_url=url, sandbox_url=url)
        try:
            ran = sbx.commands.run("echo ok")
            elapsed = (time.perf_counter() - start) * 1000
            assert (ran.stdout, ran.exit_code) == ("ok\n", 0), ran
        finally:
            sbx.kill()
        if i >= 2:
            times.append(elapsed)
    return times


def pss_of_sandbox(name: str) -> float | None:
    """PSS (MiB) of one sandbox's processes, read from its cgroup."""
    kib = 0
    found = False
    for group in Path("/sys/fs/cgroup/pids").glob(f"**/sandgate/*/{name}"):
        found = True
        kib += sum(pss_kib(int(pid)) for pid in (group / "cgroup.procs").read_text().split())
    return kib / 1024 if found else None


POOLS = {"default": 10, "code-interpreter": 3}  # the bench worker's --pool


def pooled_creates(client: httpx.Client, m: int) -> list[float]:
    """Create-to-running of creates the worker serves from its warm pool (each waits for the
    pool to refill first: what is measured is a hand-out, not a start)."""
    times = []
    for _ in range(m):
        time.sleep(0.5)
        start = time.perf_counter()
        response = client.post("/api/v1/sandboxes", json={})
        times.append((time.perf_counter() - start) * 1000)
        assert response.status_code == 201, response.text
        client.delete(f"/api/v1/sandboxes/{response.json()['name']}")
    return times


def code_interpreter(
    url: str, key: str, n: int, m: int
) -> tuple[list[float], list[float], list[float], float | None]:
    """E2B's code interpreter SDK: create-to-first-`run_code` result over `m` sandboxes one at
    a time (killed after), from the worker's code-interpreter pool (`Sandbox.create()`, after
    the pool refilled) and cold (a native create with `"pool": false`, then `connect`); warm
    `run_code("1+1")` on one; and the idle PSS of a sandbox whose kernel is up."""
    from e2b_code_interpreter import Sandbox

    firsts = []
    for _ in range(m):
        time.sleep(2.0)  # a pooled kernel takes about a second to start again
        start = time.perf_counter()
        sbx = Sandbox.create(api_key=key, api_url=url, sandbox_url=url)
        try:
            assert sbx.run_code("1+1").text == "2"
            elapsed = (time.perf_counter() - start) * 1000
        finally:
            sbx.kill()
        firsts.append(elapsed)
    colds = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        for _ in range(m):
            start = time.perf_counter()
            body = {"template": "code-interpreter", "pool": False}
            name = c.post("/api/v1/sandboxes", json=body).json()["name"]
            sbx = Sandbox.connect(name, api_key=key, api_url=url, sandbox_url=url)
            try:
                assert sbx.run_code("1+1").text == "2"
                elapsed = (time.perf_counter() - start) * 1000
            finally:
                sbx.kill()
            colds.append(elapsed)
    # a cold one (its cgroups are named after it, where a pooled one's are the pool's)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        body = {"template": "code-interpreter", "pool": False}
        name = c.post("/api/v1/sandboxes", json=body).json()["name"]
    sbx = Sandbox.connect(name, api_key=key, api_url=url, sandbox_url=url)
    try:
        warm = []
        for i in range(n + 20):
            start = time.perf_counter()
            text = sbx.run_code("1+1").text
            elapsed = (time.perf_counter() - start) * 1000
            assert text == "2", text
            if i >= 20:
                warm.append(elapsed)
        time.sleep(1)
        idle = pss_of_sandbox(sbx.sandbox_id)
    finally:
        sbx.kill()
    return firsts, colds, warm, idle


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runtime", default="bwrap", choices=["bwrap", "process"])
    parser.add_argument("--n", type=int, default=300, help="sequential execute samples")
    parser.add_argument("--creates", type=int, default=40, help="create samples")
    parser.add_argument("--seconds", type=float, default=5.0, help="throughput window")
    parser.add_argument(
        "--e2b",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure through E2B's Python SDK (commands.run, create-to-first-command)",
    )
    parser.add_argument(
        "--e2b-creates", type=int, default=20, help="E2B create-to-first-command samples"
    )
    parser.add_argument(
        "--code-interpreter",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure E2B's code interpreter SDK (run_code on a real kernel)",
    )
    parser.add_argument("--ci-n", type=int, default=100, help="warm run_code samples")
    parser.add_argument(
        "--ci-creates", type=int, default=10, help="create-to-first-run_code samples"
    )
    args = parser.parse_args()
    # sandboxes alive at once: the native creates, then (E2B) one more at a time, each killed
    # before the next is made
    held = args.creates + 3 + (1 if args.e2b else 0) + sum(POOLS.values()) + 2

    work = Path(tempfile.mkdtemp(prefix="sandgate-bench-"))
    state_dir = Path("/var/lib/sandgate-bench") / uuid.uuid4().hex[:8]
    db = f"sqlite:///{work / 'bench.db'}"
    key = sandgate("keys", "create", "--db", db, "--tenant", "bench")
    token = sandgate("keys", "create", "--db", db, "--worker")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = work / "bench.log"
    server = launch.start(
        launch.server_argv("--db", db, "--port", str(port), "--log-level", "WARNING"), log=log
    )
    worker = launch.start(
        launch.worker_argv(
            url,
            "bench",
            runtime=args.runtime,
            capacity=max(64, held),
            state_dir=state_dir,
            # it holds 44 idle sandboxes (default --creates) of the default 512 MiB / 1 GiB at
            # once: more than a small host's budget at overcommit 1, and what is measured is
            # latency, not that
            extra=(
                "--log-level",
                "WARNING",
                "--memory-overcommit",
                "4",
                "--disk-overcommit",
                "4",
                *(f"--pool={template}={size}" for template, size in POOLS.items()),
            ),
        ),
        log=log,
        env=launch.child_env(token=token),
    )
    headers = {"Authorization": f"Bearer {key}"}
    try:
        try:
            launch.wait_worker(url, key, proc=worker, log=log, interval=0.1, what="the worker")
        except launch.LaunchError as exc:
            raise SystemExit(str(exc)) from None
        with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
            print(
                f"sandgate bench  runtime={args.runtime}  cpus={os.cpu_count()}  load={os.getloadavg()[0]:.2f}"
            )
            spawn = baseline_spawn(args.n)
            agent = asyncio.run(baseline_agent(args.runtime, args.n, state_dir / "agent-baseline"))

            creates = []
            names = []
            for i in range(args.creates + 3):
                start = time.perf_counter()
                # cold starts: the worker's warm pool is measured apart (pooled_creates)
                response = client.post("/api/v1/sandboxes", json={"pool": False})
                elapsed = (time.perf_counter() - start) * 1000
                assert response.status_code == 201, response.text
                assert response.json()["state"] == "running"
                names.append(response.json()["name"])
                if i >= 3:
                    creates.append(elapsed)
            memory = pss_of_sandboxes(state_dir, "bench") if args.runtime == "bwrap" else None
            pooled = pooled_creates(client, 10)

            target = names[0]
            execs = []
            for i in range(args.n + 20):
                start = time.perf_counter()
                response = client.post(
                    f"/api/v1/sandboxes/{target}/execute", json={"code": "echo ok"}
                )
                elapsed = (time.perf_counter() - start) * 1000
                assert response.json()["stdout"] == "ok\n", response.text
                if i >= 20:
                    execs.append(elapsed)

            # E2B's SDK right after, in the same conditions (the native sandboxes still idle)
            e2b_runs = e2b_run(url, key, args.n) if args.e2b else []
            e2b_firsts = e2b_create_to_first_command(url, key, args.e2b_creates) if args.e2b else []
            ci = (
                code_interpreter(url, key, args.ci_n, args.ci_creates)
                if args.code_interpreter
                else None
            )

            # live output: lines a background process prints, as a follower receives them
            command = (
                'python3 -c "import time\nfor i in range(100):\n'
                '    print(time.time(), flush=True); time.sleep(0.02)"'
            )
            pid = client.post(
                f"/api/v1/sandboxes/{target}/toolbox/processes", json={"command": command}
            ).json()["pid"]
            lags = []
            pending = ""  # output chunks are not line-aligned
            with client.stream(
                "GET", f"/api/v1/sandboxes/{target}/toolbox/processes/{pid}/stream"
            ) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: ") and '"data"' in line:
                        received = time.time()
                        pending += json.loads(line[6:])["data"]
                        *stamps, pending = pending.split("\n")
                        lags.extend((received - float(stamp)) * 1000 for stamp in stamps)
                    if line.startswith("event: exit"):
                        break

            counts = [0] * 8
            stop_at = time.monotonic() + args.seconds

            def hammer(slot: int) -> None:
                with httpx.Client(base_url=url, headers=headers, timeout=60) as own:
                    while time.monotonic() < stop_at:
                        r = own.post(
                            f"/api/v1/sandboxes/{names[slot % len(names)]}/execute",
                            json={"code": "echo ok"},
                        )
                        if r.status_code == 200:
                            counts[slot] += 1

            threads = [threading.Thread(target=hammer, args=(i,)) for i in range(8)]
            began = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            throughput = sum(counts) / (time.monotonic() - began)

            for name in names:
                client.delete(f"/api/v1/sandboxes/{name}")

        spawn_p50 = statistics.median(spawn)
        print()
        print(f"baseline  host subprocess bash -c 'echo ok'  {summary(spawn)}")
        print(f"baseline  in-sandbox agent, no HTTP         {summary(agent)}")
        print(f"API       execute echo ok                   {summary(execs)}")
        print(f"API       create-to-running (cold)          {summary(creates)}")
        print(f"API       create-to-running (warm pool)     {summary(pooled)}")
        print(f"API       execute throughput, 8 clients     {throughput:7.1f} req/s")
        print(f"API       process line to SSE follower      {summary(lags[10:])}")
        if e2b_runs:
            print(f"E2B SDK   commands.run echo ok (sync)       {summary(e2b_runs)}")
            print(f"E2B SDK   create-to-first-command           {summary(e2b_firsts)}")
        if ci is not None:
            print(f"E2B CI    create-to-first-run_code (pool)   {summary(ci[0])}")
            print(f"E2B CI    create-to-first-run_code (cold)   {summary(ci[1])}")
            print(f"E2B CI    run_code('1+1') warm              {summary(ci[2])}")
        if memory:
            print(
                f"memory    PSS per idle sandbox              {memory[0]:7.2f} MiB (mean of {memory[1]})"
            )
        if ci is not None and ci[3] is not None:
            print(f"memory    PSS per idle sandbox with a kernel {ci[3]:6.2f} MiB (one sandbox)")
        print()
        print(
            f"ratio     API execute p50 / host spawn p50   {statistics.median(execs) / spawn_p50:5.2f}x  (target <= 3)"
        )
        print(
            f"ratio     API execute p50 / agent p50        {statistics.median(execs) / statistics.median(agent):5.2f}x"
        )
        print(
            f"target    create-to-running p50 <= 100 ms    {'met' if statistics.median(creates) <= 100 else 'MISSED'}"
        )
        pool_p50, cold_p50 = statistics.median(pooled), statistics.median(creates)
        print(
            f"target    warm pool p50 {pool_p50:.2f} ms <= 15 ms and <= 0.3x cold ({pool_p50 / cold_p50:.2f}x): "
            f"{'met' if pool_p50 <= 15 and pool_p50 <= 0.3 * cold_p50 else 'MISSED'}"
        )
        print(
            f"target    live output p50 < 50 ms            {'met' if statistics.median(lags[10:]) < 50 else 'MISSED'}"
        )
        if e2b_runs:
            e2b_p50, exec_p50 = statistics.median(e2b_runs), statistics.median(execs)
            print(
                f"target    e2b commands.run p50 {e2b_p50:.2f} ms vs native execute p50 {exec_p50:.2f} ms:"
                f" {e2b_p50 - exec_p50:+.2f} ms (target <= 1.5 ms: "
                f"{'met' if e2b_p50 - exec_p50 <= 1.5 else 'MISSED'})"
            )
            native_first = statistics.median(creates) + exec_p50
            print(
                f"delta     e2b create-to-first-command p50 vs native create p50 + execute p50"
                f" {native_first:.2f} ms: {statistics.median(e2b_firsts) - native_first:+.2f} ms"
            )
    finally:
        for proc in (worker, server):
            proc.send_signal(signal.SIGTERM)
        for proc in (worker, server):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(state_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
