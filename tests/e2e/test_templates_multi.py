"""Templates from image archives across instances on one PostgreSQL database.

Worker w1 (the bwrap runtime: the process runtime cannot start an image) dials instance A.
A template imported through B is in the shared database; a sandbox created through B from
it is provisioned through A, the tunnel owner, and the worker fetches the layers it lacks
over that tunnel from A, which reads them from the database. Both instances list the same
templates and see the same deletes; the same archive imported through A and B at once
stores each layer once (the blobs are content-addressed and shared).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import tarfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandgate.cli import launch as launcher
from tests.e2e.conftest import WORKER, Cluster, Instance, running_cluster
from tests.images import Layer, base_layer, oci_archive, top_layer

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.bwrap]

GREETING = "hello from the image\n"
BLOB_CHUNK = 1 << 20  # store/sql/templates.py: a blob's bytes are stored in pieces of this


# -- the cluster: A and B, and a bwrap worker dialing A ----------------------------------------
def start_bwrap_worker(cl: Cluster, via: Instance, capacity: int = 8) -> None:
    """Worker w1 with the bwrap runtime (Cluster.start_worker uses the e2e default runtime,
    `process`, which cannot start a template's own root file system) dialing `via`."""
    log_path = cl.base / f"worker-{WORKER}.log"
    env = launcher.child_env(token=cl.worker_token, faults="")
    env["SANDGATE_LOG_FORMAT"] = "json"  # read back by Cluster.worker_records()
    argv = launcher.worker_argv(
        via.url, WORKER, runtime="bwrap", capacity=capacity, state_dir=cl.state_dir / WORKER
    )
    cl.worker = launcher.start(argv, log=log_path, env=env)
    cl.worker_log = log_path
    cl.wait_connected(via)


@pytest.fixture(scope="module")
def cluster(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("a template's own root file system needs the bwrap runtime: root and bwrap")
    with running_cluster(pg_dsn, tmp_path_factory.mktemp("templates"), worker=False) as cl:
        start_bwrap_worker(cl, cl.instances["A"])
        yield cl


# -- helpers (as tests/integration/api/test_templates.py) ---------------------------------------
def upload(client: httpx.Client, name: str, archive: Path) -> httpx.Response:
    with open(archive, "rb") as body:
        return client.post(
            "/api/v1/templates", params={"name": name}, content=body.read(), timeout=120
        )


def sh(client: httpx.Client, sandbox: str, script: str) -> dict[str, Any]:
    answer = client.post(
        f"/api/v1/sandboxes/{sandbox}/execute",
        json={"language": "sh", "code": script, "timeout": 60},
        timeout=90,
    )
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


def create(client: httpx.Client, template: str) -> str:
    answer = client.post(
        "/api/v1/sandboxes", json={"template": template, "pool": False}, timeout=120
    )
    assert answer.status_code == 201, answer.text
    assert answer.json()["worker"] == WORKER, answer.text
    name: str = answer.json()["name"]
    return name


def unique_image(path: Path) -> tuple[Path, list[str]]:
    """An OCI archive of the base and top layers, each with a file of its own (so its layers
    are stored by no earlier test and on no worker yet), and its layer digests, bottom first,
    read from the archive's manifest."""
    nonce = uuid.uuid4().hex
    layers: list[Layer] = [base_layer(), top_layer()]
    for index, layer in enumerate(layers):
        layer.entries[f"etc/nonce-{index}"] = f"{nonce}\n".encode()
    archive = oci_archive(path, layers)
    return archive, layer_digests(archive)


def layer_digests(archive: Path) -> list[str]:
    with tarfile.open(archive) as tar:

        def blob(digest: str) -> Any:
            member = tar.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}")
            assert member is not None
            return json.loads(member.read())

        index_file = tar.extractfile("index.json")
        assert index_file is not None
        (entry,) = json.loads(index_file.read())["manifests"]
        return [str(x["digest"]) for x in blob(entry["digest"])["layers"]]


def fetched_layers(cluster: Cluster) -> list[str]:
    """The layers worker w1 logged fetching (images.LayerCache: image.layer_fetched)."""
    return [
        str(r["layer"])
        for r in cluster.worker_records()
        if r.get("message") == "image.layer_fetched"
    ]


def names(client: httpx.Client) -> list[str]:
    listed = client.get("/api/v1/templates")
    assert listed.status_code == 200, listed.text
    return [t["name"] for t in listed.json()]


# -- 1. imported through B, started through B: the worker on A fetches the layers via A ------
@pytest.mark.timeout(300)
def test_a_template_imported_through_the_other_instance_starts(
    cluster: Cluster, tmp_path: Path
) -> None:
    a, b = cluster.instances["A"], cluster.instances["B"]
    owner = cluster.owner()
    assert owner is not None and owner[0] == a.url, f"w1's tunnel is not held by A: {owner}"
    archive, digests = unique_image(tmp_path / "image.tar")
    template = f"multi-{uuid.uuid4().hex[:8]}"
    with cluster.client(b, timeout=120) as cb, cluster.client(a) as ca:
        imported = upload(cb, template, archive)
        assert imported.status_code == 201, imported.text
        try:
            record = imported.json()
            assert record["name"] == template and record["source"] == "oci", record
            assert record["layers"] == 2 and record["public"] is False, record
            assert ca.get(f"/api/v1/templates/{template}").json() == record, "A sees B's import"
            assert not set(digests) & set(fetched_layers(cluster)), "fetched before a create?"
            sandbox = create(cb, template)
            try:
                seen = sh(cb, sandbox, "cat /etc/greeting")
                assert seen["exit_code"] == 0, seen
                assert seen["stdout"] == GREETING, seen
                fetched = fetched_layers(cluster)
                for digest in digests:
                    assert fetched.count(digest) == 1, (digest, fetched)
            finally:
                cb.delete(f"/api/v1/sandboxes/{sandbox}")
        finally:
            cb.delete(f"/api/v1/templates/{template}")


# -- 2. both instances list the same templates and see the same delete ------------------------
@pytest.mark.timeout(300)
def test_both_instances_list_the_same_templates_and_see_a_delete(
    cluster: Cluster, tmp_path: Path
) -> None:
    archive, _ = unique_image(tmp_path / "image.tar")
    first, second = (f"listed-{uuid.uuid4().hex[:8]}" for _ in range(2))
    with cluster.client("A", timeout=120) as ca, cluster.client("B", timeout=120) as cb:
        try:
            assert upload(ca, first, archive).status_code == 201
            assert upload(cb, second, archive).status_code == 201
            via_a = ca.get("/api/v1/templates")
            via_b = cb.get("/api/v1/templates")
            assert via_a.status_code == via_b.status_code == 200, (via_a.text, via_b.text)
            assert via_a.json() == via_b.json()
            assert {first, second} <= set(names(ca)), via_a.json()
            for name in (first, second):
                assert ca.get(f"/api/v1/templates/{name}").json() == (
                    cb.get(f"/api/v1/templates/{name}").json()
                )

            assert ca.delete(f"/api/v1/templates/{first}").status_code == 204
            assert first not in names(cb) and second in names(cb)
            assert cb.get(f"/api/v1/templates/{first}").status_code == 404
            refused = cb.post("/api/v1/sandboxes", json={"template": first, "pool": False})
            assert refused.status_code == 404, refused.text
            assert refused.json()["error"]["code"] == "template_not_found", refused.text
            assert cb.delete(f"/api/v1/templates/{first}").status_code == 404
        finally:
            for name in (first, second):
                ca.delete(f"/api/v1/templates/{name}")


# -- 3. the same archive imported through A and B at once: each layer stored once --------------
@pytest.mark.timeout(300)
def test_the_same_archive_imported_through_both_at_once_is_stored_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    archive, digests = unique_image(tmp_path / "image.tar")
    distinct = sorted(set(digests))
    assert len(distinct) == 2
    assert cluster.sql("select digest from blobs where digest = any($1::text[])", distinct) == []
    suffix = uuid.uuid4().hex[:8]
    targets = {"A": f"race-a-{suffix}", "B": f"race-b-{suffix}"}
    barrier = threading.Barrier(len(targets))

    def one(instance: str) -> httpx.Response:
        with cluster.client(instance, timeout=120) as client:
            barrier.wait(timeout=30)
            return upload(client, targets[instance], archive)

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(targets)) as pool:
            answers = dict(zip(targets, pool.map(one, targets), strict=True))
        for instance, answer in answers.items():
            assert answer.status_code == 201, (instance, answer.text)
            assert answer.json()["name"] == targets[instance], answer.text
            assert answer.json()["layers"] == len(digests), answer.text
        assert answers["A"].json()["digest"] == answers["B"].json()["digest"]
        assert answers["A"].json()["size"] == answers["B"].json()["size"]

        # both templates name the archive's layers, in order
        rows = cluster.sql(
            "select name, image from templates where name = any($1::text[])",
            list(targets.values()),
        )
        recorded = {r["name"]: json.loads(r["image"]) for r in rows}
        assert set(recorded) == set(targets.values()), recorded
        for name, image in recorded.items():
            assert [x["digest"] for x in image["layers"]] == digests, (name, image)

        # one blob per distinct layer, complete, and its chunks holding exactly its bytes
        blobs = cluster.sql(
            "select digest, size, complete from blobs where digest = any($1::text[]) "
            "order by digest",
            distinct,
        )
        assert [r["digest"] for r in blobs] == distinct, blobs
        assert all(r["complete"] is True for r in blobs), blobs
        sizes = {str(x["digest"]): int(x["size"]) for x in next(iter(recorded.values()))["layers"]}
        chunks = cluster.sql(
            "select digest, count(*) as n, sum(length(data))::bigint as bytes, "
            "max(seq) as last from blob_chunks where digest = any($1::text[]) group by digest",
            distinct,
        )
        stored = {r["digest"]: (r["n"], r["bytes"], r["last"]) for r in chunks}
        for row in blobs:
            size = int(row["size"])
            assert size == sizes[row["digest"]], (row, sizes)
            pieces = -(-size // BLOB_CHUNK)
            assert stored.get(row["digest"]) == (pieces, size, pieces - 1), (row, stored)

        # and what the race stored is what the image is: a sandbox starts from it
        with cluster.client("B") as cb:
            sandbox = create(cb, targets["A"])
            try:
                assert sh(cb, sandbox, "cat /etc/greeting")["stdout"] == GREETING
            finally:
                cb.delete(f"/api/v1/sandboxes/{sandbox}")
    finally:
        with cluster.client("A") as ca:
            for name in targets.values():
                ca.delete(f"/api/v1/templates/{name}")
