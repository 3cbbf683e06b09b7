"""The flapping tunnel with two instances on PostgreSQL: the worker dials A through a fault
proxy, B reaches A through another (both cut together), and the clients talk to A and B
alike (B forwards to A, and B's creates are delivered through A). The same bounds as on one
instance hold."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Cluster, running_cluster
from tests.e2e.test_tunnel_faults import SLACK, Answers, storm
from tests.faultproxy import FaultProxy
from tests.integration.api.conftest import free_port


@pytest.fixture
def flaky_cluster(pg_dsn: str, tmp_path: Path) -> Iterator[tuple[Cluster, FaultProxy, FaultProxy]]:
    """A and B; the worker dials A through one proxy, and B reaches A (its node URL, as a
    balancer in front of each instance would) through a second."""
    a_port = free_port()
    with (
        FaultProxy.to(f"http://127.0.0.1:{a_port}") as peer_proxy,
        running_cluster(
            pg_dsn, tmp_path, worker=False, a_port=a_port, a_node_url=peer_proxy.url
        ) as cl,
    ):
        a = cl.instances["A"]
        with FaultProxy.to(a.url) as proxy:
            cl.start_worker(a, server_url=proxy.url)
            yield cl, proxy, peer_proxy


def test_a_flapping_tunnel_behind_two_instances(
    flaky_cluster: tuple[Cluster, FaultProxy, FaultProxy],
) -> None:
    cl, proxy, peer_proxy = flaky_cluster

    def cut_both() -> None:
        proxy.cut()
        peer_proxy.cut()

    def via(name: str) -> httpx.Client:
        return cl.client(name, timeout=60.0)

    names = []
    for i in range(6):
        with via("AB"[i % 2]) as c:
            r = c.post("/api/v1/sandboxes", json={"timeout": 600})
            assert r.status_code == 201, r.text
            names.append(r.json()["name"])
    answers = Answers()
    made: dict[str, str] = {}
    # B's create loop goes to B (delivered through A), A's to A
    storm(cut_both, [lambda: via("B"), lambda: via("A")], names, answers, made, 30.0 + SLACK)
    starts, _ = cl.worker_events()
    for key, name in made.items():
        assert starts[name] == 1, (key, name, starts[name])
