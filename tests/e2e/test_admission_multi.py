"""Admission on two instances over one PostgreSQL: every limit holds for the deployment,
never once per instance.

- 100 keys x 20 concurrent retries over both instances: exactly 100 sandboxes; and exec jobs
  at the same scale run each command exactly once (the command counts itself in a file);
- the scheduling breaker opens on exactly the 3rd timeout whichever instance saw it, refuses
  creates on both at once, and closes after the open period through one half-open trial;
- with a queue limit of 10 and no capacity, exactly 10 creates wait across both instances
  and the 11th gets 429; the queue is FIFO and a client that leaves gives its place back;
- tenants take turns in the queue: a tenant flooding it does not hold back another's create,
  and with `--tenant-share` a tenant at its share waits while one below it waits;
- a tenant limited to 5 requests/s gets 5/s (plus the burst) through both together, and its
  quotas of live sandboxes and running exec jobs are exact.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandgate.control.admission import instance_label
from tests.e2e.conftest import Cluster, Instance, running_cluster, stop_process
from tests.integration.api.conftest import sandgate, wait_until

KEYS = 100
RETRIES = 20
BATCH = 10  # keys in flight at once: 200 concurrent requests


def admission(cluster: Cluster, inst: Instance, key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with cluster.client(inst) as c:
        response = c.get("/api/v1/admission", headers=headers)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body


async def _retries(
    cluster: Cluster, path: str, body: dict[str, Any], keys: list[str]
) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """Every key sent RETRIES times at once, alternately to A and B."""
    a, b = cluster.instances["A"], cluster.instances["B"]
    headers = {"Authorization": f"Bearer {cluster.key}"}
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    async with (
        httpx.AsyncClient(base_url=a.url, headers=headers, timeout=120, limits=limits) as ca,
        httpx.AsyncClient(base_url=b.url, headers=headers, timeout=120, limits=limits) as cb,
    ):
        results: dict[str, list[tuple[int, dict[str, Any]]]] = defaultdict(list)

        async def one(client: httpx.AsyncClient, key: str) -> None:
            for _ in range(20):  # a retrying client: 503 means "retry with the same key"
                try:
                    response = await client.post(
                        path,
                        json=body | {"command": body["command"].format(key=key)}
                        if "command" in body
                        else body,
                        headers={"Idempotency-Key": key},
                    )
                except (httpx.ReadError, httpx.RemoteProtocolError):
                    # a kept-alive connection the server closed as it was reused (uvicorn's
                    # idle timeout racing the next request): a retrying client sends again,
                    # with the same key, which is what the key is for
                    await asyncio.sleep(0.5)
                    continue
                if response.status_code != 503:
                    results[key].append((response.status_code, response.json()))
                    return
                await asyncio.sleep(0.5)
            raise AssertionError(f"{key}: still 503 after 20 tries")

        for start in range(0, len(keys), BATCH):
            batch = keys[start : start + BATCH]
            await asyncio.gather(
                *(one(ca if i % 2 else cb, k) for k in batch for i in range(RETRIES))
            )
    return results


def test_100_keys_x_20_retries_over_both_make_100_sandboxes_and_run_once(
    cluster: Cluster,
) -> None:
    keys = [f"create-{i:03d}" for i in range(KEYS)]
    results = asyncio.run(_retries(cluster, "/api/v1/sandboxes", {"timeout": 600}, keys))
    names = set()
    for key in keys:
        statuses = Counter(status for status, _ in results[key])
        assert set(statuses) <= {200, 201}, (key, results[key][:3])
        assert statuses[201] <= 1, (key, statuses)
        created = {body["name"] for _, body in results[key]}
        assert len(created) == 1, (key, created)  # every retry answered the same sandbox
        names |= created
    assert len(names) == KEYS
    rows = cluster.sql("select count(*) as n from sandboxes where metadata::text like '%idem%'")
    assert rows[0]["n"] == KEYS  # in the store: exactly one sandbox per key
    starts, _ = cluster.worker_events()
    assert all(starts[n] == 1 for n in names), "a sandbox was started twice"

    # exec jobs at the same scale, in one of those sandboxes: each command counts itself
    target = sorted(names)[0]
    job_keys = [f"job-{i:03d}" for i in range(KEYS)]
    body = {"command": "echo {key} >> ran.txt", "timeout": 30}
    jobs = asyncio.run(_retries(cluster, f"/api/v1/sandboxes/{target}/exec-jobs", body, job_keys))
    ids = set()
    for key in job_keys:
        assert {status for status, _ in jobs[key]} == {202}, (key, jobs[key][:3])
        seen = {job["id"] for _, job in jobs[key]}
        assert len(seen) == 1, (key, seen)
        ids |= seen
    assert len(ids) == KEYS
    a = cluster.instances["A"]
    with cluster.client(a) as c:

        def all_done() -> bool:
            listed = c.get(f"/api/v1/sandboxes/{target}/exec-jobs", params={"limit": 1000})
            states = Counter(j["state"] for j in listed.json()["exec_jobs"])
            return states["succeeded"] == KEYS

        wait_until(all_done, timeout=120, what="every exec job succeeded")
        ran = c.post(f"/api/v1/sandboxes/{target}/execute", json={"code": "cat ran.txt"})
        assert ran.status_code == 200, ran.text
    counted = Counter(ran.json()["stdout"].split())
    assert counted == Counter({k: 1 for k in job_keys})  # every command ran exactly once
    cluster.delete_everything()


# ------------------------------------------------------------------ the breaker

BREAKER_ARGS = (
    "--start-timeout",
    "1",
    "--breaker-threshold",
    "3",
    "--breaker-window",
    "600",
    "--breaker-open",
    "4",
)


@pytest.fixture
def hanging(pg_dsn: str, tmp_path: Path) -> Iterator[Cluster]:
    """A and B; worker w1 (dialing A) whose sandboxes never get ready."""
    with running_cluster(pg_dsn, tmp_path, extra=BREAKER_ARGS, worker_faults="hang-start") as cl:
        yield cl


def create(cluster: Cluster, inst: Instance, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with cluster.client(inst) as c:
        return c.post("/api/v1/sandboxes", json={}, headers=headers)


def test_breaker_opens_on_the_3rd_timeout_across_instances_and_closes_by_trial(
    hanging: Cluster,
) -> None:
    cl = hanging
    a, b = cl.instances["A"], cl.instances["B"]
    for i, inst in enumerate((a, b, a)):
        if i == 2:  # the last one is seen by B: the hanging worker now dials B
            stop_process(cl.worker, signal.SIGKILL)
            token = sandgate("keys", "create", "--db", cl.db_url, "--worker", "--name", "w2")
            cl.start_worker(b, name="w2", token=token, faults="hang-start")
        assert admission(cl, b)["breaker"]["state"] == "closed", f"open before timeout {i + 1}"
        response = create(cl, inst)
        assert response.status_code == 504, response.text
        assert response.json()["error"]["code"] == "timeout"
    # the 3rd opened it; A saw two timeouts (w1's tunnel owner) and B the third (w2's)
    status = admission(cl, b)
    assert status["breaker"]["state"] == "open", status
    assert status["breaker"]["counted_timeouts"] == 3
    seen_by = {t["instance"] for t in status["recent_timeouts"]}
    assert seen_by == {instance_label(a.url), instance_label(b.url)}  # no internal addresses
    assert all(t["sandbox"] for t in status["recent_timeouts"])  # our own sandboxes: named

    # both instances refuse at once, with the reason and when it closes (a create that waited
    # the 4 s open period out would be let in as the trial: 504, not this 503)
    for inst in (a, b):
        refused = create(cl, inst)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "scheduling_breaker_open"
        assert "not ready within the start timeout" in error["message"]
        assert "trial create" in error["message"]
        assert 1 <= int(refused.headers["Retry-After"]) <= 4

    # after the open period one trial goes through; it times out too: open again
    wait_until(lambda: create_probe(cl, a) != 503, timeout=10, what="the trial is let in")
    reopened = admission(cl, a)["breaker"]
    assert reopened["state"] == "open" and "trial" in reopened["reason"], reopened

    # the scheduler recovers: the hanging workers go, a healthy one comes
    for proc in [*cl.extra_workers, cl.worker]:
        stop_process(proc, signal.SIGKILL)
    token = sandgate("keys", "create", "--db", cl.db_url, "--worker", "--name", "w3")
    cl.start_worker(b, capacity=4, name="w3", token=token)

    def trial_succeeds() -> bool:
        response = create(cl, a)
        if response.status_code == 503:
            assert response.json()["error"]["code"] == "scheduling_breaker_open"
            return False
        assert response.status_code == 201, response.text
        return True

    wait_until(trial_succeeds, timeout=15, what="a successful trial create")
    closed = admission(cl, b)["breaker"]
    assert closed["state"] == "closed" and closed["counted_timeouts"] == 0, closed
    assert create(cl, b).status_code == 201


def create_probe(cluster: Cluster, inst: Instance) -> int:
    """One create; while the breaker is open it is refused (503), else it is the trial."""
    response = create(cluster, inst)
    if response.status_code == 503:
        assert response.json()["error"]["code"] == "scheduling_breaker_open", response.text
    else:
        assert response.status_code == 504, response.text  # the trial, on a hanging worker
    return response.status_code


def test_only_one_trial_runs_while_half_open(hanging: Cluster) -> None:
    cl = hanging
    a, b = cl.instances["A"], cl.instances["B"]
    for inst in (a, b, a):
        assert create(cl, inst).status_code == 504
    opened = admission(cl, a)["breaker"]
    assert opened["state"] == "open"
    closes_at = datetime.fromisoformat(opened["closes_at"])
    wait_until(  # the open period is over: the next create is the trial
        lambda: datetime.now(UTC) > closes_at, timeout=10, what=f"the breaker's {closes_at}"
    )
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        codes = list(pool.map(lambda i: create(cl, (a, b)[i % 2]).status_code, range(8)))
    # exactly one create was let through (and timed out); all the others were refused
    assert sorted(codes) == [503] * 7 + [504], codes


# ------------------------------------------------------------------ the queue

QUEUE_ARGS = ("--queue-limit", "10", "--queue-timeout", "120")


@pytest.fixture
def full(pg_dsn: str, tmp_path: Path) -> Iterator[Cluster]:
    """A and B with a queue of 10; worker w1 of capacity 1, already running one sandbox."""
    with running_cluster(pg_dsn, tmp_path, extra=QUEUE_ARGS, capacity=1) as cl:
        yield cl


async def _queue_scenario(cl: Cluster) -> None:
    a, b = cl.instances["A"], cl.instances["B"]
    headers = {"Authorization": f"Bearer {cl.key}"}
    fleet = {"Authorization": f"Bearer {cl.admin_key}"}  # the whole queue: an admin's view
    async with (
        httpx.AsyncClient(base_url=a.url, headers=headers, timeout=120) as ca,
        httpx.AsyncClient(base_url=b.url, headers=headers, timeout=120) as cb,
        httpx.AsyncClient(base_url=a.url, headers=fleet, timeout=120) as fa,
        httpx.AsyncClient(base_url=b.url, headers=fleet, timeout=120) as fb,
    ):
        filler = await ca.post("/api/v1/sandboxes", json={})
        assert filler.status_code == 201, filler.text
        waiting: list[asyncio.Task[httpx.Response]] = []
        for i in range(10):  # one after another, alternating instances: a known FIFO order
            client = (ca, cb)[i % 2]
            waiting.append(asyncio.create_task(client.post("/api/v1/sandboxes", json={})))
            for _ in range(50):
                status = (await fa.get("/api/v1/admission")).json()
                if status["queue"]["length"] == i + 1:
                    break
                await asyncio.sleep(0.1)
            assert status["queue"]["length"] == i + 1, status
        # the 11th, on either instance, is over the limit at once
        for client in (ca, cb):
            over = await client.post("/api/v1/sandboxes", json={})
            assert over.status_code == 429, over.text
            assert over.json()["error"]["code"] == "queue_full"
            assert over.json()["error"]["limit"] == "queue_limit"
            assert int(over.headers["Retry-After"]) >= 1
        assert not any(t.done() for t in waiting)
        for client in (fa, fb):
            assert (await client.get("/api/v1/admission")).json()["queue"]["length"] == 10
        for client in (ca, cb):  # all 10 are this tenant's: its own view counts the same
            assert (await client.get("/api/v1/admission")).json()["queue"]["your_queued"] == 10

        # capacity comes free: the head of the queue (the first one queued) gets it
        assert (await cb.delete(f"/api/v1/sandboxes/{filler.json()['name']}")).status_code == 204
        first = await asyncio.wait_for(asyncio.shield(waiting[0]), timeout=30)
        assert first.status_code == 201, first.text
        assert not any(t.done() for t in waiting[1:])
        length = (await fa.get("/api/v1/admission")).json()["queue"]["length"]
        assert length == 9

        # clients that leave give their places back
        for task in waiting[1:]:
            task.cancel()
        await asyncio.gather(*waiting[1:], return_exceptions=True)
        for _ in range(50):
            length = (await fb.get("/api/v1/admission")).json()["queue"]["length"]
            if length == 0:
                break
            await asyncio.sleep(0.2)
        assert length == 0
        assert (await ca.delete(f"/api/v1/sandboxes/{first.json()['name']}")).status_code == 204


def test_queue_limit_10_admits_exactly_10_across_both_instances(full: Cluster) -> None:
    asyncio.run(_queue_scenario(full))
    # nobody who left got a sandbox: only the filler and the head were ever created
    rows = full.sql("select count(*) as n from sandboxes")
    assert rows[0]["n"] == 2


# ------------------------------------------------------------------ rate limits and quotas


def tenant_key(cl: Cluster, tenant: str, *limits: str) -> str:
    key = sandgate("keys", "create", "--db", cl.db_url, "--tenant", tenant)
    sandgate("tenants", "limit", "--db", cl.db_url, tenant, *limits)
    return key


def test_a_5_rps_tenant_gets_5_per_second_through_both_instances(cluster: Cluster) -> None:
    key = tenant_key(cluster, "slow", "--rps", "5", "--burst", "5")
    a, b = cluster.instances["A"], cluster.instances["B"]
    duration = 3.0
    codes: list[int] = []
    refusals: list[httpx.Response] = []

    def hammer(inst: Instance) -> None:
        with httpx.Client(
            base_url=inst.url, headers={"Authorization": f"Bearer {key}"}, timeout=10
        ) as c:
            while time.monotonic() < stop_at:
                response = c.get("/api/v1/sandboxes")
                codes.append(response.status_code)
                if response.status_code == 429 and len(refusals) < 3:
                    refusals.append(response)

    stop_at = time.monotonic() + duration
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        list(pool.map(hammer, (a, b) * 3))
    allowed = codes.count(200)
    assert set(codes) <= {200, 429}, Counter(codes)
    # 5 at once (the burst) plus 5 per second, all instances together; per-instance
    # counting would have let about twice that through
    assert 5 * duration <= allowed <= 5 + 5 * duration + 2, (allowed, Counter(codes))
    assert refusals, "nothing was refused"
    error = refusals[0].json()["error"]
    assert error["code"] == "rate_limited" and error["limit"] == "rps"
    assert "5 requests per second" in error["message"]
    assert int(refusals[0].headers["Retry-After"]) >= 1


def test_quotas_are_exact_across_both_instances(cluster: Cluster) -> None:
    key = tenant_key(cluster, "quota", "--max-sandboxes", "3", "--max-exec-jobs", "2")
    a, b = cluster.instances["A"], cluster.instances["B"]
    with concurrent.futures.ThreadPoolExecutor(max_workers=10) as pool:
        made = list(pool.map(lambda i: create(cluster, (a, b)[i % 2], key), range(10)))
    codes = Counter(r.status_code for r in made)
    assert codes == Counter({201: 3, 429: 7}), codes
    refused = next(r for r in made if r.status_code == 429).json()["error"]
    assert refused["code"] == "quota_exceeded" and refused["limit"] == "max_sandboxes"
    sandbox = next(r for r in made if r.status_code == 201).json()["name"]

    def submit(i: int) -> int:
        inst = (a, b)[i % 2]
        with httpx.Client(
            base_url=inst.url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        ) as c:
            response = c.post(f"/api/v1/sandboxes/{sandbox}/exec-jobs", json={"command": "sleep 5"})
            return response.status_code

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        jobs = Counter(pool.map(submit, range(8)))
    assert jobs == Counter({202: 2, 429: 6}), jobs
    with httpx.Client(base_url=a.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        for r in made:
            if r.status_code == 201:
                assert c.delete(f"/api/v1/sandboxes/{r.json()['name']}").status_code == 204


# ------------------------------------------------------------------ fairness across tenants


def queued(cl: Cluster) -> int:
    rows = cl.sql("select count(*) as n from admission_tickets where expires_at >= now()")
    return int(rows[0]["n"])


async def _wait_queued(cl: Cluster, n: int) -> None:
    for _ in range(100):
        if queued(cl) == n:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{queued(cl)} creates queued, not {n}")


class Tenants:
    """A client per (tenant, instance), each with its own key."""

    def __init__(self, cl: Cluster, *tenants: str) -> None:
        self.cl = cl
        self.keys = {
            t: sandgate("keys", "create", "--db", cl.db_url, "--tenant", t) for t in tenants
        }

    def client(self, tenant: str, inst: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.cl.instances[inst].url,
            headers={"Authorization": f"Bearer {self.keys[tenant]}"},
            timeout=120,
        )

    async def create(self, tenant: str, inst: str = "A") -> httpx.Response:
        async with self.client(tenant, inst) as c:
            return await c.post("/api/v1/sandboxes", json={})

    async def delete(self, tenant: str, name: str) -> None:
        async with self.client(tenant, "B") as c:
            assert (await c.delete(f"/api/v1/sandboxes/{name}")).status_code == 204

    async def fill(self, tenant: str) -> str:
        made = await self.create(tenant)
        assert made.status_code == 201, made.text
        name: str = made.json()["name"]
        return name


async def _next_placed(tasks: dict[str, asyncio.Task[httpx.Response]]) -> str:
    """The label of the next queued create to be placed (and it alone)."""
    pending = [t for t in tasks.values() if not t.done()]
    done, _ = await asyncio.wait(pending, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1, f"{len(done)} creates finished at once"
    (task,) = done
    response = task.result()
    assert response.status_code == 201, response.text
    finished = {label for label, t in tasks.items() if t.done()}
    await asyncio.sleep(1.0)  # nothing else is placed: the freed slot was taken
    assert {label for label, t in tasks.items() if t.done()} == finished
    return next(label for label, t in tasks.items() if t is task)


async def _give_up(tasks: dict[str, asyncio.Task[httpx.Response]]) -> None:
    for task in tasks.values():
        task.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)


@pytest.fixture
def two_slots(pg_dsn: str, tmp_path: Path) -> Iterator[Cluster]:
    """A and B with a queue of 10; worker w1 of capacity 2."""
    with running_cluster(pg_dsn, tmp_path, extra=QUEUE_ARGS, capacity=2) as cl:
        yield cl


async def _flood_scenario(cl: Cluster) -> None:
    ts = Tenants(cl, "flooder", "other")
    held = [await ts.fill("flooder") for _ in range(2)]  # the flooder holds both slots
    tasks: dict[str, asyncio.Task[httpx.Response]] = {}
    for i in range(6):  # one after another, alternating instances: a known order
        tasks[f"B{i + 1}"] = asyncio.create_task(ts.create("flooder", ("A", "B")[i % 2]))
        await _wait_queued(cl, i + 1)
    tasks["A1"] = asyncio.create_task(ts.create("other", "B"))
    await _wait_queued(cl, 7)
    try:
        order = []
        for name in held:  # free the slots one at a time: who gets each?
            await ts.delete("flooder", name)
            order.append(await _next_placed(tasks))
        # B1 was at the head before A came; then A's create, not B's next 5
        assert order == ["B1", "A1"], order
        assert not any(tasks[f"B{i}"].done() for i in range(2, 7))
    finally:
        await _give_up(tasks)


def test_a_tenant_flooding_the_queue_does_not_hold_back_another(two_slots: Cluster) -> None:
    asyncio.run(_flood_scenario(two_slots))


@pytest.fixture
def shared(pg_dsn: str, tmp_path: Path) -> Iterator[Cluster]:
    """A and B with `--tenant-share 0.5`; worker w1 of capacity 4."""
    extra = (*QUEUE_ARGS, "--tenant-share", "0.5")
    with running_cluster(pg_dsn, tmp_path, extra=extra, capacity=4) as cl:
        yield cl


async def _share_scenario(cl: Cluster) -> None:
    ts = Tenants(cl, "big", "small", "third")
    big = [await ts.fill("big") for _ in range(2)]  # 2 of 4: at its share of 0.5
    await ts.fill("small")
    third = await ts.fill("third")
    tasks = {"big1": asyncio.create_task(ts.create("big", "A"))}
    await _wait_queued(cl, 1)
    for i in range(2):
        tasks[f"small{i + 1}"] = asyncio.create_task(ts.create("small", ("B", "A")[i]))
        await _wait_queued(cl, i + 2)
    try:
        # big's create is older and, by turns alone, next; but big is at its share while
        # small (1 of 4) waits: small's goes first
        await ts.delete("third", third)
        assert await _next_placed(tasks) == "small1"
        # small now holds 2 (its share too), big drops to 1: big's create is not refused,
        # it places next
        await ts.delete("big", big[0])
        assert await _next_placed(tasks) == "big1"
        assert not tasks["small2"].done()
    finally:
        await _give_up(tasks)


def test_a_tenant_at_its_share_waits_while_others_wait(shared: Cluster) -> None:
    asyncio.run(_share_scenario(shared))
