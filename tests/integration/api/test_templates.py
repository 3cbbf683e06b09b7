"""Templates from image archives, end to end: imported over the REST API, fetched by a real
bwrap worker over its tunnel, unpacked with whiteouts and opaque directories honoured, and
seen by real sandboxes read-only under a copy-on-write layer inside their disk quota."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.images import base_layer, docker_archive, oci_archive, top_layer
from tests.integration.api.conftest import Deployment

pytestmark = pytest.mark.bwrap


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


def create(client: httpx.Client, template: str, **body: Any) -> str:
    answer = client.post(
        "/api/v1/sandboxes", json={"template": template, "pool": False, **body}, timeout=120
    )
    assert answer.status_code == 201, answer.text
    name: str = answer.json()["name"]
    return name


@pytest.fixture(scope="module")
def oci_template(deployment: Deployment, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    archive = oci_archive(tmp_path_factory.mktemp("oci") / "image.tar", [base_layer(), top_layer()])
    name = f"oci-{uuid.uuid4().hex[:8]}"
    with deployment.client("alpha") as alpha:
        answer = upload(alpha, name, archive)
        assert answer.status_code == 201, answer.text
        yield name
        alpha.delete(f"/api/v1/templates/{name}")


def test_oci_image_layers_config_and_copy_on_write(alpha: httpx.Client, oci_template: str) -> None:
    record = alpha.get(f"/api/v1/templates/{oci_template}").json()
    assert record["source"] == "oci" and record["layers"] == 2 and record["public"] is False
    assert record["env"]["GREETING"] == "from-config" and record["workdir"] == "/app"
    assert record["digest"].startswith("sha256:")

    first = create(alpha, oci_template, env={"MINE": "yes"})
    try:
        seen = sh(
            alpha,
            first,
            "cat /etc/greeting; echo $GREETING $MINE; ls /opq 2>&1; cat /keep/below /keep/above; "
            "test -e /removed || echo removed-is-gone; id -u; ls /usr/lib/python3* 2>&1 | head -1",
        )
        assert seen["exit_code"] == 0, seen
        lines = seen["stdout"].splitlines()
        assert lines[0] == "hello from the image"
        assert lines[1] == "from-config yes"  # the image's env, then the sandbox's own
        assert lines[2] == "new", "the opaque directory hides what the base had there"
        assert lines[3:5] == ["from the base", "from the top"]
        assert lines[5] == "removed-is-gone", "the whiteout deletes the base's file"
        assert lines[6] == "0", "an image whose user is root runs as root (in its namespace)"
        assert "No such file" in lines[7], "the host's /usr is not this sandbox's"
        assert sh(alpha, first, "pwd")["stdout"] == "/app\n", "WorkingDir is where commands start"
        wait = "i=0; while ! test -e /tmp/cmd-ran && [ $i -lt 200000 ]; do i=$((i+1)); done"
        ran = sh(alpha, first, f"{wait}; cat /tmp/cmd-ran")
        assert ran["stdout"] == "started\n", "the image's Cmd ran in the background"
        # the files API reaches the whole root of a template sandbox (it is the sandbox's own)
        put = alpha.put(
            f"/api/v1/sandboxes/{first}/toolbox/files",
            params={"path": "/etc/from-api"},
            content=b"written by the files API\n",
        )
        assert put.status_code in (200, 201), put.text
        assert sh(alpha, first, "cat /etc/from-api")["stdout"] == "written by the files API\n"
        listed = alpha.get(f"/api/v1/sandboxes/{first}/toolbox/files/list", params={"path": "/opq"})
        assert [e["name"] for e in listed.json()["entries"]] == ["new"], listed.text
        # the root is writable: copy-on-write, inside this sandbox only
        wrote = sh(alpha, first, "echo mine > /usr/bin/added && rm /etc/greeting && echo ok")
        assert wrote["stdout"] == "ok\n", wrote
        second = create(alpha, oci_template)
        try:
            other = sh(alpha, second, "cat /etc/greeting; test -e /usr/bin/added || echo clean")
            assert other["stdout"] == "hello from the image\nclean\n", other
        finally:
            alpha.delete(f"/api/v1/sandboxes/{second}")
    finally:
        alpha.delete(f"/api/v1/sandboxes/{first}")


def test_root_writes_count_against_the_disk_quota(alpha: httpx.Client, oci_template: str) -> None:
    name = create(alpha, oci_template, resources={"disk_mb": 64})
    try:
        full = sh(alpha, name, "dd if=/dev/zero of=/usr/big bs=1M count=100 2>&1; echo rc=$?")
        assert "No space left on device" in full["stdout"] and "rc=1" in full["stdout"], full
    finally:
        alpha.delete(f"/api/v1/sandboxes/{name}")


def test_docker_save_archive(alpha: httpx.Client, tmp_path: Path) -> None:
    archive = docker_archive(tmp_path / "saved.tar", [base_layer(), top_layer()])
    name = f"docker-{uuid.uuid4().hex[:8]}"
    answer = upload(alpha, name, archive)
    assert answer.status_code == 201, answer.text
    assert answer.json()["source"] == "docker"
    try:
        sandbox = create(alpha, name)
        try:
            seen = sh(alpha, sandbox, "cat /etc/greeting; ls /opq")
            assert seen["stdout"] == "hello from the image\nnew\n", seen
        finally:
            alpha.delete(f"/api/v1/sandboxes/{sandbox}")
    finally:
        assert alpha.delete(f"/api/v1/templates/{name}").status_code == 204


def test_root_filesystem_tarball(alpha: httpx.Client, tmp_path: Path) -> None:
    archive = tmp_path / "rootfs.tar.gz"
    layer = base_layer()
    layer.gzip = True
    archive.write_bytes(layer.tar())
    name = f"rootfs-{uuid.uuid4().hex[:8]}"
    answer = upload(alpha, name, archive)
    assert answer.status_code == 201, answer.text
    assert answer.json()["source"] == "rootfs" and answer.json()["layers"] == 1
    try:
        sandbox = create(alpha, name)
        try:
            assert sh(alpha, sandbox, "cat /removed")["stdout"] == "deleted by the next layer\n"
        finally:
            alpha.delete(f"/api/v1/sandboxes/{sandbox}")
    finally:
        alpha.delete(f"/api/v1/templates/{name}")


def test_bad_archives_are_refused_and_nothing_is_recorded(
    alpha: httpx.Client, tmp_path: Path
) -> None:
    good = oci_archive(tmp_path / "good.tar", [base_layer(), top_layer()])
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    mismatch = oci_archive(tmp_path / "bad.tar", [base_layer(), top_layer()], corrupt_layer=1)
    garbage = tmp_path / "garbage.tar.gz"
    garbage.write_bytes(b"\x1f\x8b" + b"not really gzip" * 100)
    for archive, words in (
        (truncated, "truncated"),
        (mismatch, "digest mismatch"),
        (garbage, "corrupt"),
    ):
        name = f"bad-{uuid.uuid4().hex[:8]}"
        answer = upload(alpha, name, archive)
        assert answer.status_code == 400, (archive.name, answer.text)
        assert answer.json()["error"]["code"] == "invalid_template_archive"
        assert words in answer.json()["error"]["message"], answer.text
        assert alpha.get(f"/api/v1/templates/{name}").status_code == 404
    assert upload(alpha, "default", good).status_code == 409, "a built-in name is never taken"
    assert upload(alpha, "Bad Name", good).status_code in (400, 422)


def test_base_is_the_default_template(alpha: httpx.Client) -> None:
    made = alpha.post("/api/v1/sandboxes", json={"template": "base"})
    assert made.status_code == 201, made.text
    assert made.json()["template"] == "default"
    alpha.delete(f"/api/v1/sandboxes/{made.json()['name']}")


def test_unknown_template_and_tenancy(
    alpha: httpx.Client, beta: httpx.Client, deployment: Deployment, oci_template: str
) -> None:
    missing = alpha.post("/api/v1/sandboxes", json={"template": "no-such-template"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "template_not_found"
    # another tenant neither sees nor starts alpha's template
    assert oci_template not in [t["name"] for t in beta.get("/api/v1/templates").json()]
    assert beta.get(f"/api/v1/templates/{oci_template}").status_code == 404
    assert beta.delete(f"/api/v1/templates/{oci_template}").status_code == 404
    refused = beta.post("/api/v1/sandboxes", json={"template": oci_template})
    assert refused.status_code == 404, refused.text
    assert alpha.get(f"/api/v1/templates/{oci_template}").status_code == 200


def test_public_template_from_an_admin(
    deployment: Deployment, beta: httpx.Client, tmp_path: Path
) -> None:
    archive = oci_archive(tmp_path / "public.tar", [base_layer(), top_layer()])
    name = f"pub-{uuid.uuid4().hex[:8]}"
    with deployment.admin() as admin:
        answer = upload(admin, name, archive)
        assert answer.status_code == 201, answer.text
        assert answer.json()["public"] is True
        try:
            assert name in [t["name"] for t in beta.get("/api/v1/templates").json()]
            sandbox = create(beta, name)
            try:
                assert sh(beta, sandbox, "cat /etc/greeting")["exit_code"] == 0
            finally:
                beta.delete(f"/api/v1/sandboxes/{sandbox}")
            assert beta.delete(f"/api/v1/templates/{name}").status_code == 404, "not beta's"
        finally:
            assert admin.delete(f"/api/v1/templates/{name}").status_code == 204
    assert beta.post("/api/v1/sandboxes", json={"template": name}).status_code == 404


def test_cli_imports_a_directory_and_the_sdk_sees_it(
    deployment: Deployment, alpha: httpx.Client, tmp_path: Path
) -> None:
    import json
    import os
    import subprocess
    import sys

    from sandgate.client import Sandgate

    root = tmp_path / "root"
    for path, content in base_layer().entries.items():
        target = root / path
        if content is None:
            target.mkdir(parents=True, exist_ok=True)
        elif isinstance(content, str):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(content.removeprefix("->"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
            target.chmod(0o755)
    (root / "etc" / "from-dir").write_text("packed by the CLI\n")
    env = {
        **os.environ,
        "SANDGATE_URL": deployment.url,
        "SANDGATE_API_KEY": deployment.keys["alpha"],
    }
    name = f"dir-{uuid.uuid4().hex[:8]}"
    cli = [str(Path(sys.executable).parent / "sandgate"), "templates"]
    made = subprocess.run(
        [*cli, "import", name, str(root), "--json"], env=env, capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["source"] == "rootfs"
    try:
        listed = subprocess.run([*cli, "list"], env=env, capture_output=True, text=True)
        assert name in listed.stdout and "code-interpreter" in listed.stdout
        with Sandgate(deployment.url, deployment.keys["alpha"]) as client:
            assert client.templates.get(name).layers == 1
            box = client.sandboxes.create(template=name)
            try:
                assert box.run("cat /etc/from-dir", language="sh").stdout == "packed by the CLI\n"
            finally:
                box.delete()
        gone = subprocess.run([*cli, "delete", name], env=env, capture_output=True, text=True)
        assert gone.returncode == 0, gone.stderr
        missing = subprocess.run([*cli, "show", name], env=env, capture_output=True, text=True)
        assert missing.returncode != 0 and "not found" in missing.stderr
    finally:
        alpha.delete(f"/api/v1/templates/{name}")


def test_e2b_sdk_starts_an_imported_template(deployment: Deployment, oci_template: str) -> None:
    from tests import e2b_scenarios as sdk

    e2b = sdk.E2B(deployment.keys["alpha"], deployment.url)
    sbx = e2b.create(template=oci_template)
    try:
        assert sbx.commands.run("cat /etc/greeting").stdout == "hello from the image\n"
        sbx.files.write("/home/user/note.txt", "from e2b")
        assert sbx.commands.run("cat /workspace/note.txt").stdout == "from e2b"
    finally:
        sbx.kill()


def test_an_image_whose_links_point_out_of_its_root(alpha: httpx.Client, tmp_path: Path) -> None:
    """bwrap sets mounts up while the host's root is still reachable (as /oldroot): an image
    whose /etc, /tmp or WorkingDir are links out of its root must not make it create
    anything on the host. They are resolved inside the image's own root instead."""
    marker = f"sandgate-escape-{uuid.uuid4().hex[:8]}"
    base = base_layer()
    base.entries = {
        k: v for k, v in base.entries.items() if k != "etc" and not k.startswith("etc/")
    }
    base.entries["etc"] = f"->/oldroot/tmp/{marker}-etc"
    base.entries["workspace"] = f"->../oldroot/tmp/{marker}-ws"
    config: dict[str, object] = {"Env": ["PATH=/usr/bin:/bin"], "WorkingDir": f"/w/{marker}"}
    base.entries["w"] = f"->/oldroot/tmp/{marker}-wd"
    archive = oci_archive(tmp_path / "links.tar", [base], config)
    name = f"links-{uuid.uuid4().hex[:8]}"
    assert upload(alpha, name, archive).status_code == 201
    try:
        sandbox = create(alpha, name)
        try:
            seen = sh(alpha, sandbox, "pwd; cat /etc/hosts | head -1; ls /oldroot 2>&1 | head -1")
            assert seen["exit_code"] == 0, seen
            lines = seen["stdout"].splitlines()
            assert lines[0].endswith(f"-wd/{marker}"), (
                "WorkingDir made where the link leads, inside"
            )
            assert "localhost" in lines[1]
        finally:
            alpha.delete(f"/api/v1/sandboxes/{sandbox}")
        assert not list(Path("/tmp").glob(f"{marker}*")), "nothing was made on the host"
    finally:
        alpha.delete(f"/api/v1/templates/{name}")
