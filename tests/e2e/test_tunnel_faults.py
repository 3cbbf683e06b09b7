"""Faults on the tunnel between a real worker and a real server, made by a TCP proxy.

The worker dials the server through `tests.faultproxy.FaultProxy`, which cuts, blackholes or
delays the link the way a load balancer restart or a network blip does. Every scenario is
counted in answers (no 500, nothing slower than its own timeout + 2 s), in sandboxes (each
key made once) and in what is left on the worker host once it settled.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.faultproxy import FaultProxy
from tests.integration.api.conftest import (
    RUNTIME,
    Deployment,
    start_deployment,
    tear_down,
    wait_until,
)

pytestmark = [pytest.mark.bwrap, pytest.mark.slow]

EXEC_TIMEOUT = 10.0  # each execute's own timeout: no answer may take longer than this + 2 s
SLACK = 2.0


@pytest.fixture
def flaky(tmp_path: Path) -> Iterator[tuple[Deployment, FaultProxy]]:
    """A server on SQLite and a bwrap worker dialing it through a fault proxy."""
    yield from _flaky(tmp_path)


@pytest.fixture
def flaky_fast_start(tmp_path: Path) -> Iterator[tuple[Deployment, FaultProxy]]:
    """The same with a start timeout (4 s) shorter than the keepalive needs to notice a
    silent link (~15 s): a blackholed create then times out on a link that looks alive."""
    yield from _flaky(tmp_path, "--start-timeout", "4")


def _flaky(tmp_path: Path, *server_args: str) -> Iterator[tuple[Deployment, FaultProxy]]:
    if RUNTIME == "bwrap" and (os.geteuid() != 0 or shutil.which("bwrap") is None):
        pytest.skip("the bwrap runtime needs root and bubblewrap")
    dep = start_deployment(tmp_path, worker=False, server_args=server_args)
    with FaultProxy.to(dep.url) as proxy:
        try:
            dep.start_worker(server_url=proxy.url)
            yield dep, proxy
        finally:
            tear_down(dep, lines=30)


@dataclass
class Answers:
    """Every answer of a storm, Jepsen-style: status (or the transport error) and latency."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    statuses: Counter[str] = field(default_factory=Counter)
    slow: list[tuple[str, float, str]] = field(default_factory=list)
    bad: list[tuple[str, int, str]] = field(default_factory=list)

    def record(self, what: str, started: float, limit: float, response: httpx.Response) -> None:
        took = time.monotonic() - started
        with self.lock:
            self.statuses[f"{what} {response.status_code}"] += 1
            if took > limit:
                self.slow.append((what, round(took, 2), response.text[:200]))
            if response.status_code >= 500 and response.status_code != 503:
                self.bad.append((what, response.status_code, response.text[:300]))
            if response.status_code == 503 and "retry-after" not in response.headers:
                self.bad.append((what, 503, "no Retry-After: " + response.text[:200]))

    def failed(self, what: str, exc: Exception) -> None:
        with self.lock:
            self.statuses[f"{what} {type(exc).__name__}"] += 1
            self.bad.append((what, 0, repr(exc)))


def execute_loop(
    client: Callable[[], httpx.Client], name: str, stop: threading.Event, answers: Answers
) -> None:
    with client() as c:
        while not stop.is_set():
            started = time.monotonic()
            try:
                r = c.post(
                    f"/api/v1/sandboxes/{name}/execute",
                    json={"language": "bash", "code": "echo ok", "timeout": EXEC_TIMEOUT},
                )
            except httpx.HTTPError as exc:
                answers.failed("execute", exc)
                continue
            answers.record("execute", started, EXEC_TIMEOUT + SLACK, r)
            if r.status_code == 200:
                assert r.json()["stdout"] == "ok\n", r.text
            elif r.status_code == 503:
                time.sleep(min(float(r.headers.get("retry-after", "1")), 1.0))


def create_loop(
    client: Callable[[], httpx.Client],
    stop: threading.Event,
    answers: Answers,
    made: dict[str, str],
    limit: float,
) -> None:
    """Keyed creates, each retried with its key until it answers a sandbox; then deleted."""
    with client() as c:
        while not stop.is_set():
            key = uuid.uuid4().hex
            while True:
                started = time.monotonic()
                try:
                    r = c.post(
                        "/api/v1/sandboxes", json={"timeout": 120}, headers={"Idempotency-Key": key}
                    )
                except httpx.HTTPError as exc:
                    answers.failed("create", exc)
                    continue
                answers.record("create", started, limit, r)
                if r.status_code in (200, 201):
                    name = r.json()["name"]
                    with answers.lock:
                        assert made.setdefault(key, name) == name, (key, made[key], name)
                    break
                assert r.status_code in (429, 503), r.text
                time.sleep(min(float(r.headers.get("retry-after", "1")), 1.0))
            # delete it so the worker does not fill up (a cut delete is another test's business)
            for _ in range(20):
                try:
                    if c.delete(f"/api/v1/sandboxes/{name}").status_code in (204, 404):
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)


def storm(
    cut: Callable[[], object],
    clients: list[Callable[[], httpx.Client]],
    names: list[str],
    answers: Answers,
    made: dict[str, str],
    create_limit: float,
    cuts: int = 15,
) -> None:
    """6 clients looping execute on their sandbox and 2 making keyed creates (8 in all,
    spread over `clients`), while `cut()` resets the links `cuts` times 3 s apart. Then: no 500,
    nothing slower than its bound, every 503 with Retry-After."""
    stop = threading.Event()
    threads = [
        threading.Thread(target=execute_loop, args=(clients[i % len(clients)], n, stop, answers))
        for i, n in enumerate(names)
    ] + [
        threading.Thread(
            target=create_loop,
            args=(clients[i % len(clients)], stop, answers, made, create_limit),
        )
        for i in range(2)
    ]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        for _ in range(cuts):
            cut()
            time.sleep(3)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    print(dict(answers.statuses))  # noqa: T201
    assert not answers.bad, answers.bad[:10]
    assert not answers.slow, answers.slow[:10]
    assert answers.statuses["execute 200"] > 100
    assert len(made) >= 5  # creates got through between cuts


def test_a_flapping_tunnel_gives_no_500_no_hang_and_one_sandbox_per_key(
    flaky: tuple[Deployment, FaultProxy],
) -> None:
    dep, proxy = flaky
    with dep.client() as c:
        names = []
        for _ in range(6):
            r = c.post("/api/v1/sandboxes", json={"timeout": 600})
            assert r.status_code == 201, r.text
            names.append(r.json()["name"])
    answers = Answers()
    made: dict[str, str] = {}
    start_limit = 30.0 + SLACK  # a create's own bound: the server's start timeout
    storm(proxy.cut, [dep.client], names, answers, made, start_limit)
    # each key made exactly one sandbox, started once on the worker
    started = dep.worker_sandboxes("sandbox.started")
    for key, name in made.items():
        assert started[name] == 1, (key, name, started[name])
    # the tunnel is healthy again afterwards
    with dep.client() as c:
        wait_until(
            lambda: (
                c.post(
                    f"/api/v1/sandboxes/{names[0]}/execute", json={"code": "echo ok"}
                ).status_code
                == 200
            ),
            what="execute after the storm",
        )


def _create_cut_on_delivery(
    dep: Deployment, proxy: FaultProxy, c: httpx.Client, key: str | None
) -> httpx.Response:
    """A create accepted while the link is up, whose delivery the link drops: the proxy
    resets the tunnel at the first byte it passes (the provision frame, or a ping just
    before it, in which case nothing was accepted and it is tried again)."""
    for _ in range(10):
        proxy.drop_after(1)
        headers = {"Idempotency-Key": key} if key else {}
        r = c.post("/api/v1/sandboxes", json={}, headers=headers)
        if r.status_code == 503 and r.json()["error"]["code"] == "tunnel_unavailable":
            return r
        assert r.status_code in (201, 503), r.text  # 503 no_capacity: the link went first
        if r.status_code == 201:
            c.delete(f"/api/v1/sandboxes/{r.json()['name']}")
        proxy.heal()
        dep.wait_worker("w1", connected=True)
    raise AssertionError("never caught a delivery on the cut")


def test_a_reattached_worker_gets_the_creates_waiting_for_it_at_once(
    flaky: tuple[Deployment, FaultProxy],
) -> None:
    """A create accepted while the tunnel is down is delivered when the worker is back,
    not after --recovery-after (45 s); its keyed retry answers as soon as it runs."""
    dep, proxy = flaky
    with dep.client() as c:
        r = _create_cut_on_delivery(dep, proxy, c, "back-soon")
        assert "retry-after" in r.headers
        assert "same Idempotency-Key" in r.json()["error"]["message"]
        proxy.heal()
        started = time.monotonic()
        r = c.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": "back-soon"})
        took = time.monotonic() - started
        assert r.status_code == 200, r.text  # the same sandbox, replayed
        assert r.json()["state"] == "running"
        assert took < 10, took  # not the 45 s recovery wait
        started_on_worker = dep.worker_sandboxes("sandbox.started")
        assert started_on_worker[r.json()["name"]] == 1


def test_an_unkeyed_create_answered_an_error_is_never_made_later(
    flaky: tuple[Deployment, FaultProxy],
) -> None:
    dep, proxy = flaky
    with dep.client() as c:
        r = _create_cut_on_delivery(dep, proxy, c, None)
        assert "Idempotency-Key" in r.json()["error"]["message"]  # advice to send one
        assert "same Idempotency-Key" not in r.json()["error"]["message"]
        proxy.heal()
        dep.wait_worker("w1", connected=True)
        time.sleep(3)  # a wake-up delivery would have happened by now
        live = [
            s
            for s in c.get("/api/v1/sandboxes").json()["sandboxes"]
            if s["state"] in ("pending", "running")
        ]
        assert live == [], live
    assert not worker_leftovers(dep)


def test_a_partition_is_tunnel_loss_not_a_scheduling_timeout(
    flaky_fast_start: tuple[Deployment, FaultProxy],
) -> None:
    """Creates and executes caught by a blackholed tunnel answer 503 tunnel_unavailable
    within their bound, and the breaker does not count them: three such creates (its
    threshold) leave creates open for everyone."""
    dep, proxy = flaky_fast_start
    with dep.client(timeout=120.0) as c:
        r = c.post("/api/v1/sandboxes", json={"timeout": 600})
        assert r.status_code == 201, r.text
        name = r.json()["name"]
        for _ in range(3):
            proxy.blackhole()  # the link looks alive: nothing is closed, nothing passes
            started = time.monotonic()
            r = c.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": uuid.uuid4().hex})
            took = time.monotonic() - started
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "tunnel_unavailable", r.text
            assert took < 4 + SLACK, took  # its start timeout, + the probe of the link
            proxy.heal()
            dep.wait_worker("w1", connected=True)
        proxy.blackhole()
        started = time.monotonic()
        r = c.post(f"/api/v1/sandboxes/{name}/execute", json={"code": "sleep 0", "timeout": 1})
        assert r.status_code == 503, r.text
        assert time.monotonic() - started < 1 + 5 + SLACK
        proxy.heal()
        dep.wait_worker("w1", connected=True)
        admission = c.get("/api/v1/admission").json()
        assert admission["breaker"]["state"] == "closed", admission
        r = c.post("/api/v1/sandboxes", json={})
        assert r.status_code == 201, r.text
        metrics = c.get("/metrics").text
        assert "sandgate_tunnel_losses_total 4.0" in metrics, metrics


def test_deletes_cut_at_random_points_leave_nothing_on_the_worker(
    flaky: tuple[Deployment, FaultProxy],
) -> None:
    dep, proxy = flaky
    rng = random.Random(9)
    with dep.client() as c:
        for _ in range(20):
            r = c.post("/api/v1/sandboxes", json={})
            assert r.status_code == 201, r.text
            name = r.json()["name"]
            put = c.put(
                f"/api/v1/sandboxes/{name}/toolbox/files",
                params={"path": "secret.txt"},
                content=b"tenant data",
            )
            assert put.status_code in (200, 201, 204), put.text
            timer = threading.Timer(rng.uniform(0.0, 0.08), proxy.cut)
            timer.start()
            r = c.delete(f"/api/v1/sandboxes/{name}")
            timer.join()
            assert r.status_code in (204, 404), r.text
            dep.wait_worker("w1", connected=True)
    wait_until(lambda: not worker_leftovers(dep), timeout=30, what="the worker to settle")


def worker_leftovers(dep: Deployment) -> dict[str, object]:
    """What the worker still holds on the host: sandbox dirs, cgroups, uid leases, processes."""
    assert dep.worker is not None
    state = dep.state_dir / "w1"
    found: dict[str, object] = {}
    dirs = list((state / "sandboxes").iterdir()) if (state / "sandboxes").exists() else []
    if dirs:
        found["dirs"] = [d.name for d in dirs]
    cgroups = [
        p
        for p in Path("/sys/fs/cgroup").glob("*/sandgate/*/*")
        if p.is_dir() and _scope_of(state) in str(p)
    ]
    if cgroups:
        found["cgroups"] = [str(p) for p in cgroups]
    leases = _open_under(dep.worker.pid, "/run/sandgate/uids/")
    if leases:
        found["uid_leases"] = leases
    # the worker keeps two network namespaces of each kind ready (worker/netns.py SPARES),
    # and a link slot for each of the two with a link: nothing beyond those
    slots = _open_under(dep.worker.pid, "/run/sandgate/netslots/")
    if len(slots) > 2:
        found["net_slots"] = slots
    scope = _scope_of(state)
    listed = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    namespaces = [n for n in listed if n.startswith(f"sandgate-{scope}-")]
    if len(namespaces) > 4:
        found["namespaces"] = namespaces
    children = _descendants(dep.worker.pid)
    if children:
        found["processes"] = children
    return found


def _scope_of(state_dir: Path) -> str:
    from sandgate.worker.main import runtime_scope

    return runtime_scope("w1", state_dir)


def _open_under(pid: int, directory: str) -> list[str]:
    """The files under `directory` process `pid` holds open (a lease is an open lock file)."""
    held = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(directory):
            held.append(target)
    return held


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            pending += kids
    return found


def test_a_graceful_worker_stop_during_deletes_leaves_nothing(
    flaky: tuple[Deployment, FaultProxy],
) -> None:
    dep, _ = flaky
    assert dep.worker is not None
    with dep.client() as c:
        names = []
        for _ in range(4):
            r = c.post("/api/v1/sandboxes", json={})
            assert r.status_code == 201, r.text
            names.append(r.json()["name"])
        deletes = [
            threading.Thread(target=c.delete, args=(f"/api/v1/sandboxes/{n}",)) for n in names
        ]
        for t in deletes:
            t.start()
        time.sleep(0.2)
        state = dep.state_dir / "w1"
        scope = _scope_of(state)
        dep.stop_worker()  # SIGTERM while the destroys run
        for t in deletes:
            t.join(60)
    dirs = list((state / "sandboxes").iterdir())
    cgroups = [p for p in Path("/sys/fs/cgroup").glob("*/sandgate/*/*") if scope in str(p)]
    assert dirs == [] and cgroups == [], (dirs, cgroups)
