"""The two checks of scripts/multi-instance-check.sh that no other pytest made, on the same
footing as the rest of tests/e2e (PostgreSQL, real `sandgate server` instances A and B, one
real worker): the worker dials A through the tests' fault proxy (the `fault_proxy` fixture),
which partitions its link or moves it to the other instance without restarting the worker.

- a sandbox deleted while its create is still pending (the provision held in a partition) is
  never delivered once the worker comes back: not by the wake-up on its re-attach, not by
  recovery, not by the client's retry with the same Idempotency-Key;
- the worker moving between instances (its tunnel dropped and redialed to B, then back to A)
  keeps serving every sandbox it runs, and creates and executes work through either instance.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import (
    HEARTBEAT,
    RECOVERY_AFTER,
    RECOVERY_INTERVAL,
    WORKER,
    Cluster,
    Instance,
    running_cluster,
)
from tests.faultproxy import FaultProxy, OpenProxy
from tests.integration.api.conftest import wait_until

START_ALLOWANCE = 10.0  # seconds a delivery may take to start a sandbox on a loaded machine


@pytest.fixture
def behind_proxy(
    pg_dsn: str, tmp_path: Path, fault_proxy: OpenProxy
) -> Iterator[tuple[Cluster, FaultProxy]]:
    """A and B on a fresh database; worker w1 dials A through a fault proxy."""
    with running_cluster(pg_dsn, tmp_path, worker=False) as cl:
        a = cl.instances["A"]
        proxy = fault_proxy(a.url)
        cl.start_worker(a, server_url=proxy.url)
        yield cl, proxy


def create(c: httpx.Client, body: dict[str, object], key: str | None = None) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key else {}
    return c.post("/api/v1/sandboxes", json=body, headers=headers)


def execute(c: httpx.Client, name: str, code: str = "echo ok") -> httpx.Response:
    return c.post(f"/api/v1/sandboxes/{name}/execute", json={"language": "bash", "code": code})


def running_sandbox(cluster: Cluster, inst: Instance, **metadata: str) -> str:
    with cluster.client(inst) as c:
        r = create(c, {"metadata": metadata, "timeout": 900})
    assert r.status_code == 201, r.text
    assert r.json()["state"] == "running" and r.json()["worker"] == WORKER, r.text
    return str(r.json()["name"])


def rows_tagged(cluster: Cluster, tag: str) -> dict[str, str]:
    rows = cluster.sql("select name, state from sandboxes where metadata->>'moves' = $1", tag)
    return {r["name"]: r["state"] for r in rows}


def create_job(cluster: Cluster, name: str) -> str | None:
    rows = cluster.sql("select state from jobs where sandbox_name = $1 and kind = 'create'", name)
    return str(rows[0]["state"]) if rows else None


# -- a sandbox deleted while its create is pending ----------------------------------------------
@pytest.mark.timeout(180)
def test_a_sandbox_deleted_while_its_create_is_pending_is_never_delivered(
    behind_proxy: tuple[Cluster, FaultProxy],
) -> None:
    cl, proxy = behind_proxy
    a, b = cl.instances["A"], cl.instances["B"]
    tag = uuid.uuid4().hex[:10]
    key = f"moves-pending-{tag}"
    body: dict[str, object] = {"metadata": {"moves": tag}, "timeout": 600}

    # a partition: the link looks alive to both ends, nothing passes; A's provision frame
    # waits in the proxy and the create stays pending
    proxy.blackhole()
    answers: list[httpx.Response | Exception] = []

    def create_on_a() -> None:
        try:
            with cl.client(a, timeout=90) as c:
                answers.append(create(c, body, key))
        except httpx.HTTPError as exc:
            answers.append(exc)

    creating = threading.Thread(target=create_on_a)
    creating.start()
    wait_until(
        lambda: set(rows_tagged(cl, tag).values()) == {"pending"},
        timeout=20,
        what="the create accepted by A, pending",
    )
    (name,) = rows_tagged(cl, tag)
    assert create_job(cl, name) == "pending"

    # deleted through B while pending (B marks it first, then asks the owner A to destroy it,
    # which waits behind the partition)
    deleted: list[int] = []

    def delete_on_b() -> None:
        with cl.client(b, timeout=90) as c:
            deleted.append(c.delete(f"/api/v1/sandboxes/{name}").status_code)

    deleting = threading.Thread(target=delete_on_b)
    deleting.start()
    wait_until(
        lambda: rows_tagged(cl, tag) == {name: "deleted"}, timeout=20, what=f"{name} deleted"
    )

    # the partition ends with the link dropped (what it held is lost with it, as a real
    # partition's keepalives would), and the worker redials A: it is back
    accepted = proxy.accepted
    assert proxy.cut() >= 1
    proxy.heal()
    deleting.join(timeout=60)
    creating.join(timeout=60)
    assert deleted == [204], deleted
    assert len(answers) == 1, answers
    answer = answers[0]
    assert isinstance(answer, httpx.Response), answer
    # deferred: accepted, "delivered when the tunnel is reachable" (it never will be)
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "tunnel_unavailable", answer.text
    wait_until(lambda: proxy.accepted > accepted, timeout=30, what="the worker redialed")
    control = ""

    def serves_again() -> bool:  # a create made after the worker came back runs
        nonlocal control
        with cl.client(a) as c:
            r = create(c, {"metadata": {"moves": f"{tag}-control"}, "timeout": 600})
        if r.status_code == 201:
            control = r.json()["name"]
            return True
        assert r.status_code == 503, r.text  # the worker is still re-attaching
        return False

    wait_until(serves_again, timeout=30, interval=0.2, what="the worker serves A again")
    with cl.client(a) as c:
        assert execute(c, control).json()["stdout"] == "ok\n"

    # the client's retry with the same key, through either instance, does not bring it back
    retries = []
    for inst in (a, b):
        with cl.client(inst) as c:
            retry = create(c, body, key)
        assert retry.status_code != 201, retry.text
        if retry.is_success:
            assert retry.json()["name"] == name and retry.json()["state"] == "deleted", retry.text
        retries.append(f"{inst.name} {retry.status_code} {retry.text[:120]}")
    sys.stderr.write(f"(deleted while pending) retries with its key answered {retries}\n")

    # its create job ends failed, never completed: nothing (the wake-up on the re-attach,
    # recovery after --recovery-after) may claim it again
    limit = RECOVERY_AFTER + RECOVERY_INTERVAL + START_ALLOWANCE
    wait_until(
        lambda: create_job(cl, name) in ("failed", "completed"),
        timeout=limit,
        interval=0.2,
        what=f"the create job of {name} finished",
    )
    assert create_job(cl, name) == "failed"
    assert rows_tagged(cl, tag) == {name: "deleted"}
    for inst in (a, b):
        with cl.client(inst) as c:
            assert c.get(f"/api/v1/sandboxes/{name}").status_code == 404
            listed = c.get("/api/v1/sandboxes", params={"metadata.moves": tag, "state": "running"})
            assert listed.status_code == 200 and listed.json()["sandboxes"] == [], listed.text
    starts, repeats = cl.worker_events()
    assert starts[name] == 0 and repeats[name] == 0, "the deleted sandbox reached the worker"
    assert starts[control] == 1
    assert cl.worker is not None and cl.worker.poll() is None  # the same worker throughout


# -- the worker moving between instances --------------------------------------------------------
def move_worker(cl: Cluster, proxy: FaultProxy, here: Instance) -> None:
    """The balancer moves: the worker's tunnel drops and its redial reaches `here`."""
    accepted = proxy.accepted
    assert proxy.redirect(here.url) >= 1
    wait_until(lambda: proxy.accepted > accepted, timeout=30, what="the worker redialed")
    redialed = time.monotonic()

    def owned_by_here() -> bool:
        found = cl.owner()
        return found is not None and found[0] == here.url

    # recorded when the new tunnel serves, not left to a later heartbeat to repair
    wait_until(owned_by_here, timeout=HEARTBEAT, interval=0.1, what=f"owner -> {here.name}")
    took = time.monotonic() - redialed
    assert took < HEARTBEAT * 0.8, f"the owner row named {here.name} only {took:.1f} s after"
    cl.wait_connected(here)


def serves_through_both(
    cl: Cluster, here: Instance, there: Instance, names: list[str], content: bytes
) -> list[str]:
    """Every sandbox in `names` answers through `here` (its tunnel's instance now) and
    `there` (forwarding); creates through either are delivered. Returns the new ones."""
    with cl.client(there) as c:

        def forwarded() -> bool:  # the old owner forwards to the new one
            r = execute(c, names[0])
            if r.status_code == 503:
                return False  # its cached route to itself is looked up again after a 503
            assert r.status_code == 200, r.text
            return bool(r.json()["stdout"] == "ok\n")

        wait_until(forwarded, timeout=15, interval=0.2, what=f"{there.name} forwards")
    for inst in (here, there):
        with cl.client(inst) as c:
            for name in names:
                r = execute(c, name)
                assert r.status_code == 200 and r.json()["stdout"] == "ok\n", (inst.name, r.text)
            got = c.get(f"/api/v1/sandboxes/{names[0]}/toolbox/files", params={"path": "moves.txt"})
            assert got.status_code == 200 and got.content == content, (inst.name, got.text)
    tag = names[0] + "-after"
    made = [running_sandbox(cl, inst, moves=tag) for inst in (there, here)]
    for inst, name in zip((here, there), made, strict=True):  # each through the other one
        with cl.client(inst) as c:
            r = execute(c, name)
            assert r.status_code == 200 and r.json()["stdout"] == "ok\n", (inst.name, r.text)
    return made


@pytest.mark.timeout(240)
def test_the_worker_moving_between_instances_keeps_serving_its_sandboxes(
    behind_proxy: tuple[Cluster, FaultProxy],
) -> None:
    cl, proxy = behind_proxy
    a, b = cl.instances["A"], cl.instances["B"]
    assert cl.worker is not None
    worker_pid = cl.worker.pid
    owner = cl.owner()
    assert owner is not None and owner[0] == a.url, owner
    tag = uuid.uuid4().hex[:10]
    names = [running_sandbox(cl, a, moves=tag), running_sandbox(cl, b, moves=tag)]
    content = f"moves-{tag}".encode()
    with cl.client(b) as c:
        files = f"/api/v1/sandboxes/{names[0]}/toolbox/files"
        put = c.put(files, params={"path": "moves.txt"}, content=content)
        assert put.status_code == 200, put.text

    for here, there in ((b, a), (a, b)):  # to B, and back to A
        move_worker(cl, proxy, here)
        names += serves_through_both(cl, here, there, names, content)

    assert cl.worker.poll() is None and cl.worker.pid == worker_pid, "the worker restarted"
    running = cl.sql("select name, state from sandboxes where name = any($1)", names)
    assert {r["name"]: r["state"] for r in running} == dict.fromkeys(names, "running")
    starts, repeats = cl.worker_events()
    assert {n: starts[n] for n in names if starts[n] != 1} == {}, "a sandbox started again"
    assert {n: repeats[n] for n in names if repeats[n]} == {}, "a create delivered twice"
