"""Warm pools of public image templates, and an operator's image in a built-in's place.

A worker started with `--pool NAME=1` for a public template asks the control plane for its
image and keeps one sandbox of it started; a create takes it. When the template is replaced,
the pooled sandbox of the old image is never handed out: it goes, and the pool refills."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.images import Layer, base_layer, oci_archive, top_layer
from tests.integration.api.conftest import Deployment, start_deployment, tear_down

pytestmark = pytest.mark.bwrap


def image(path: Path, marker: bytes) -> bytes:
    top = top_layer()
    top.entries["etc/marker"] = marker
    return oci_archive(path, [base_layer(), top, Layer({"etc/extra": marker})]).read_bytes()


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    base = tmp_path_factory.mktemp("pools")
    dep = start_deployment(base, worker=False)
    try:
        with dep.admin() as admin:
            answer = admin.post(
                "/api/v1/templates",
                params={"name": "pubimg"},
                content=image(base / "one.tar", b"one\n"),
                timeout=120,
            )
            assert answer.status_code == 201, answer.text
        dep.start_worker(args=("--pool", "pubimg=1"))
        yield dep
    finally:
        tear_down(dep)


def pooled_count(dep: Deployment, template: str) -> int:
    return sum(
        1
        for r in dep.worker_records()
        if r.get("message") == "sandbox.pooled" and r.get("template") == template
    )


def wait_pooled(dep: Deployment, template: str, count: int) -> None:
    deadline = time.monotonic() + 60
    while pooled_count(dep, template) < count:
        assert time.monotonic() < deadline, f"no {count} pooled {template} sandboxes"
        time.sleep(0.1)


def handed_out(dep: Deployment, name: str) -> bool:
    return any(
        r.get("message") == "sandbox.started" and r.get("sandbox") == name and r.get("pooled")
        for r in dep.worker_records()
    )


def marker(client: httpx.Client, name: str) -> str:
    answer = client.post(
        f"/api/v1/sandboxes/{name}/execute",
        json={"language": "sh", "code": "cat /etc/marker"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    out: str = answer.json()["stdout"]
    return out


def test_a_public_image_pool_and_its_replacement(pooled: Deployment, tmp_path: Path) -> None:
    wait_pooled(pooled, "pubimg", 1)
    with pooled.client("beta") as beta:
        first = beta.post("/api/v1/sandboxes", json={"template": "pubimg"}, timeout=60)
        assert first.status_code == 201, first.text
        name = first.json()["name"]
        assert handed_out(pooled, name), "the create took the pooled sandbox"
        assert marker(beta, name) == "one\n"
        beta.delete(f"/api/v1/sandboxes/{name}")
        wait_pooled(pooled, "pubimg", 2)  # refilled
        with pooled.admin() as admin:
            replaced = admin.post(
                "/api/v1/templates",
                params={"name": "pubimg"},
                content=image(tmp_path / "two.tar", b"two\n"),
                timeout=120,
            )
            assert replaced.status_code == 201, replaced.text
        second = beta.post("/api/v1/sandboxes", json={"template": "pubimg"}, timeout=60)
        assert second.status_code == 201, second.text
        assert marker(beta, second.json()["name"]) == "two\n", "never the stale pooled one"
        assert not handed_out(pooled, second.json()["name"])
        beta.delete(f"/api/v1/sandboxes/{second.json()['name']}")
        wait_pooled(pooled, "pubimg", 3)  # the pool follows the new image
        third = beta.post("/api/v1/sandboxes", json={"template": "pubimg"}, timeout=60)
        assert handed_out(pooled, third.json()["name"])
        assert marker(beta, third.json()["name"]) == "two\n"
        beta.delete(f"/api/v1/sandboxes/{third.json()['name']}")


def test_an_operator_image_replaces_a_built_in(pooled: Deployment, tmp_path: Path) -> None:
    archive = image(tmp_path / "ci.tar", b"operator's\n")
    with pooled.client("alpha") as alpha, pooled.admin() as admin:
        taken = alpha.post(
            "/api/v1/templates", params={"name": "code-interpreter"}, content=archive
        )
        assert taken.status_code == 409, "a tenant cannot take a built-in's name"
        made = admin.post(
            "/api/v1/templates", params={"name": "code-interpreter"}, content=archive, timeout=120
        )
        assert made.status_code == 201, made.text
        try:
            box = alpha.post(
                "/api/v1/sandboxes", json={"template": "code-interpreter", "pool": False}
            )
            assert box.status_code == 201, box.text
            assert marker(alpha, box.json()["name"]) == "operator's\n"
            alpha.delete(f"/api/v1/sandboxes/{box.json()['name']}")
        finally:
            assert admin.delete("/api/v1/templates/code-interpreter").status_code == 204
        box = alpha.post("/api/v1/sandboxes", json={"template": "code-interpreter", "pool": False})
        assert box.status_code == 201, box.text
        back = alpha.post(
            f"/api/v1/sandboxes/{box.json()['name']}/execute",
            json={"language": "sh", "code": "test -e /etc/marker || echo host-root"},
        )
        assert back.json()["stdout"] == "host-root\n", back.text
        alpha.delete(f"/api/v1/sandboxes/{box.json()['name']}")
