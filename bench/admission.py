"""sandgate admission benchmark: the cost of counting in the store.

    cd bench && ../.venv/bin/python admission.py [--pg postgresql://postgres@127.0.0.1:5432/test]
        [--rounds 5] [--creates 40] [--n 250] [--runtime process]

Creates a fresh PostgreSQL database, tenant `bench` with every limit configured but far too
high to ever refuse (rps, burst, max sandboxes, max exec jobs all 100000), tenant
`bench-unlimited` with none, one real worker (runtime `process` by default: the control plane's
cost is what is measured, bwrap would only add its own start-up noise) and one real server,
restarted on the same port between configurations (the worker redials), alternating in rounds:

    ON   admission on: `bench` (rate-limit UPDATE per request, quota lock on insert,
         admission_snapshot per create), then `bench-unlimited` (snapshot only)
    OFF  `sandgate server --no-admission`, tenant `bench`
    ON, OFF, ...

Each round measures `execute` of `echo ok` and create-to-running (POST /api/v1/sandboxes
until the 201; the DELETE afterwards is neither timed nor counted), and the store statements
per request from `sandgate_store_statements_total` on /metrics read around each batch, less
the background statements (reaper, recovery, worker heartbeat) counted in an idle window of
the same round. Targets: admission adds at most 2 ms to a create's p50 and nothing measurable
to `execute`: measurable means the ON p50 differs from the OFF p50 of the same round with the
same sign in every round (machine noise moves whole rounds and changes sign).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from bench import free_port, pct, sandgate, summary  # type: ignore[import-not-found]
from multi import admin, metric  # type: ignore[import-not-found]

from sandgate.cli import launch

STATEMENTS = "sandgate_store_statements_total"
HIGH = "100000"  # every limit configured, none ever reached


@dataclass
class Series:
    """What one configuration (and tenant) measured over all its rounds."""

    label: str
    execs: list[float] = field(default_factory=list)
    creates: list[float] = field(default_factory=list)
    round_exec_p50: list[float] = field(default_factory=list)
    round_create_p50: list[float] = field(default_factory=list)
    exec_statements: float = 0.0  # background already subtracted
    create_statements: float = 0.0
    background: list[float] = field(default_factory=list)  # idle statements/s, per round


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per configuration")
    parser.add_argument("--creates", type=int, default=40, help="timed creates per round")
    parser.add_argument("--n", type=int, default=250, help="timed executes per round")
    parser.add_argument("--idle", type=float, default=1.5, help="seconds of background count")
    parser.add_argument("--runtime", default="process", choices=["process", "bwrap"])
    args = parser.parse_args()
    if min(args.rounds, args.creates, args.n) < 1:
        parser.error("--rounds, --creates and --n need at least 1")

    began = time.monotonic()
    database = f"sandgate_bench_{uuid.uuid4().hex[:8]}"
    db = args.pg.rsplit("/", 1)[0] + "/" + database
    work = Path(tempfile.mkdtemp(prefix="sandgate-admission-"))
    state_dir = Path("/var/lib/sandgate-bench") / uuid.uuid4().hex[:8]
    (work / "secret").write_text(secrets.token_urlsafe(32))
    log_path = work / "bench.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server: subprocess.Popen[bytes] | None = None
    worker: subprocess.Popen[bytes] | None = None
    try:
        admin(args.pg, f"CREATE DATABASE {database}")
        sandgate("migrate", "--db", db)
        limited = sandgate("keys", "create", "--db", db, "--tenant", "bench")
        unlimited = sandgate("keys", "create", "--db", db, "--tenant", "bench-unlimited")
        token = sandgate("keys", "create", "--db", db, "--worker")
        limits = sandgate(
            "tenants", "limit", "--db", db, "bench", "--rps", HIGH, "--burst", HIGH,
            "--max-sandboxes", HIGH, "--max-exec-jobs", HIGH,
        )  # fmt: skip

        def start_server(admission: bool) -> subprocess.Popen[bytes]:
            proc = launch.start(
                launch.server_argv(
                    "--db", db, "--port", str(port), "--node-url", url,
                    "--secret-file", str(work / "secret"), "--log-level", "WARNING",
                    "--admission" if admission else "--no-admission",
                ),
                log=log_path,
            )  # fmt: skip
            try:
                launch.wait_healthy(url, proc, log=log_path, what="the server")
            except launch.LaunchError as exc:
                stop(proc)
                raise SystemExit(str(exc)) from None
            return proc

        def wait_for_worker(client: httpx.Client) -> None:
            """Connected, and its tunnel held by this very instance (not a stale record)."""
            try:
                launch.wait_for(
                    lambda: launch.worker_listed(client) and metric(url, "sandgate_tunnels") >= 1,
                    what="the worker",
                    proc=worker,
                    log=log_path,
                )
            except launch.LaunchError as exc:
                raise SystemExit(str(exc)) from None

        on = Series("ON, all limits set")
        bare = Series("ON, tenant without limits")
        off = Series("OFF (--no-admission)")
        rounds = [(True, [(on, limited), (bare, unlimited)]), (False, [(off, limited)])]
        for round_no in range(args.rounds):
            for admission, measured in rounds:
                server = start_server(admission)
                if worker is None:
                    worker = launch.start(
                        launch.worker_argv(
                            url, "bench", runtime=args.runtime, capacity=128,
                            state_dir=state_dir, extra=("--log-level", "WARNING"),
                        ),
                        log=log_path,
                        env=launch.child_env(token=token),
                    )  # fmt: skip
                clients = {
                    key: httpx.Client(
                        base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60
                    )
                    for key in (limited, unlimited)
                }
                try:
                    wait_for_worker(clients[limited])
                    status = clients[limited].get("/api/v1/admission").json()
                    assert status["enabled"] is admission, status
                    if admission:
                        assert status["tenant_limits"]["max_sandboxes"] == int(HIGH), status
                    if round_no == 0 and admission:
                        print(
                            f"sandgate admission bench  runtime={args.runtime}  "
                            f"cpus={os.cpu_count()}  load={os.getloadavg()[0]:.2f}  "
                            f"store=PostgreSQL  rounds={args.rounds} x ({args.n} executes, "
                            f"{args.creates} creates) per configuration"
                        )
                        print(f"          {limits}")
                    rate = background(url, args.idle)
                    # the two ON series take turns going first
                    for series, key in measured[:: 1 if round_no % 2 == 0 else -1]:
                        series.background.append(rate)
                        run_batches(clients[key], url, series, rate, args)
                finally:
                    for client in clients.values():
                        client.close()
                stop(server)
                server = None
        elapsed = time.monotonic() - began
    finally:
        stop(server)
        stop(worker)
        shutil.rmtree(state_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        admin(args.pg, f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")

    report(on, bare, off, args, elapsed)


def background(url: str, seconds: float) -> float:
    """Statements per second the idle instance sends (reaper, recovery, worker heartbeat)."""
    before, t0 = metric(url, STATEMENTS), time.perf_counter()
    time.sleep(seconds)
    return (metric(url, STATEMENTS) - before) / (time.perf_counter() - t0)


def run_batches(
    client: httpx.Client, url: str, series: Series, rate: float, args: argparse.Namespace
) -> None:
    def create() -> tuple[str, float]:
        start = time.perf_counter()
        r = client.post("/api/v1/sandboxes", json={})
        elapsed = (time.perf_counter() - start) * 1000
        assert r.status_code == 201 and r.json()["state"] == "running", r.text
        return r.json()["name"], elapsed

    def execute(name: str) -> float:
        start = time.perf_counter()
        r = client.post(f"/api/v1/sandboxes/{name}/execute", json={"code": "echo ok"})
        elapsed = (time.perf_counter() - start) * 1000
        assert r.status_code == 200 and r.json()["stdout"] == "ok\n", r.text
        return elapsed

    # warm up the fresh server: pools, prepared statements, caches
    target, _ = create()
    for name in [create()[0] for _ in range(3)]:
        client.delete(f"/api/v1/sandboxes/{name}")
    for _ in range(20):
        execute(target)

    before, t0 = metric(url, STATEMENTS), time.perf_counter()
    execs = [execute(target) for _ in range(args.n)]
    spent = time.perf_counter() - t0
    series.exec_statements += metric(url, STATEMENTS) - before - rate * spent

    before, t0 = metric(url, STATEMENTS), time.perf_counter()
    made = [create() for _ in range(args.creates)]
    spent = time.perf_counter() - t0
    series.create_statements += metric(url, STATEMENTS) - before - rate * spent

    for name, _ in made:  # not timed, not counted
        client.delete(f"/api/v1/sandboxes/{name}")
    client.delete(f"/api/v1/sandboxes/{target}")

    creates = [ms for _, ms in made]
    series.execs += execs
    series.creates += creates
    series.round_exec_p50.append(statistics.median(execs))
    series.round_create_p50.append(statistics.median(creates))


def report(on: Series, bare: Series, off: Series, args: argparse.Namespace, elapsed: float) -> None:
    everything = (on, bare, off)
    print()
    for s in everything:
        print(f"execute   {s.label:27s} {summary(s.execs)}")
    for s in everything:
        print(f"create    {s.label:27s} {summary(s.creates)}")
    for s in everything:
        rounds = len(s.round_exec_p50)
        print(
            f"store     {s.label:27s} statements {s.create_statements / (rounds * args.creates):5.2f}"
            f" per create  {s.exec_statements / (rounds * args.n):5.2f} per execute"
        )
    idle = statistics.mean(off.background + on.background)
    print(f"          (idle background {idle:.1f} statements/s measured each round, subtracted)")
    print()

    # Machine noise moves whole rounds; ON and OFF of the same round are neighbours in time, so
    # the per-round differences of the p50s say whether admission costs anything: an effect
    # that is real shows in every round, noise changes sign.
    paired: dict[str, list[float]] = {}
    for what, a, b in (
        ("execute", on.round_exec_p50, off.round_exec_p50),
        ("create", on.round_create_p50, off.round_create_p50),
    ):
        pairs = "  ".join(f"{x:5.2f}/{y:5.2f}" for x, y in zip(a, b, strict=True))
        paired[what] = [x - y for x, y in zip(a, b, strict=True)]
        print(f"rounds    {what:7s} p50 ON/OFF (ms)  {pairs}")
    print()

    def delta(a: list[float], b: list[float]) -> float:
        return statistics.median(a) - statistics.median(b)

    def per_round(what: str) -> str:
        d = paired[what]
        return f"per round {statistics.median(d):+.2f} ms, from {min(d):+.2f} to {max(d):+.2f}"

    create_delta = delta(on.creates, off.creates)
    exec_delta = delta(on.execs, off.execs)
    per = len(on.round_exec_p50) * args.creates
    extra = (on.create_statements - off.create_statements) / per
    consistent = min(paired["execute"]) > 0 or max(paired["execute"]) < 0
    print(
        f"delta     create p50  ON - OFF         {create_delta:+6.2f} ms   ({per_round('create')})"
        f"   target <= 2 ms: {'met' if create_delta <= 2 else 'MISSED'}"
    )
    print(
        f"delta     execute p50 ON - OFF         {exec_delta:+6.2f} ms   ({per_round('execute')})"
        "   target nothing measurable: "
        + ("MISSED, the same sign in every round" if consistent else "met, within noise")
    )
    print(
        f"delta     without limits - OFF         {delta(bare.creates, off.creates):+6.2f} ms create"
        f"   {delta(bare.execs, off.execs):+6.2f} ms execute"
    )
    print(f"delta     store statements per create  {extra:+6.2f}")
    print(
        f"          p99 ON/OFF: execute {pct(on.execs, 99) / pct(off.execs, 99):4.2f}x   "
        f"create {pct(on.creates, 99) / pct(off.creates, 99):4.2f}x   whole run {elapsed:.0f} s"
    )


if __name__ == "__main__":
    main()
