"""Templates built from steps, end to end: `run` steps in real sandboxes of the image so far,
their root changes exported by the worker as layers (deletions as whiteouts), `copy` steps
from an uploaded context, config steps, the step cache, and a failing step's kept log."""

from __future__ import annotations

import io
import json
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.images import base_layer, oci_archive, top_layer
from tests.integration.api.conftest import Deployment

pytestmark = pytest.mark.bwrap


@pytest.fixture(scope="module")
def base(deployment: Deployment, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    archive = oci_archive(
        tmp_path_factory.mktemp("base") / "image.tar", [base_layer(), top_layer()]
    )
    name = f"base-{uuid.uuid4().hex[:8]}"
    with deployment.client("alpha") as alpha:
        answer = alpha.post(
            "/api/v1/templates", params={"name": name}, content=archive.read_bytes(), timeout=120
        )
        assert answer.status_code == 201, answer.text
        yield name
        alpha.delete(f"/api/v1/templates/{name}")


def context_tar(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def build(
    client: httpx.Client, name: str, document: dict[str, Any], context: bytes | None = None
) -> tuple[int, list[dict[str, Any]]]:
    files: dict[str, Any] = {"build": (None, json.dumps(document))}
    if context is not None:
        files["context"] = ("context.tar", context, "application/x-tar")
    with client.stream(
        "POST", "/api/v1/templates", params={"name": name}, files=files, timeout=300
    ) as answer:
        if answer.status_code != 200:
            answer.read()
            return answer.status_code, [answer.json()]
        assert answer.headers["content-type"].startswith("application/x-ndjson")
        return 200, [json.loads(line) for line in answer.iter_lines() if line]


def sh(client: httpx.Client, sandbox: str, script: str) -> str:
    answer = client.post(
        f"/api/v1/sandboxes/{sandbox}/execute",
        json={"language": "sh", "code": script, "timeout": 60},
        timeout=90,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["exit_code"] == 0, answer.json()
    out: str = answer.json()["stdout"]
    return out


def steps_document(base: str) -> dict[str, Any]:
    return {
        "from": base,
        "steps": [
            {"run": "echo building; echo built > /etc/built; rm /etc/greeting"},
            {"env": {"STAGE": "two"}},
            {"workdir": "/srv"},
            {"run": "pwd > /etc/where; echo $STAGE > /etc/stage"},
            {"copy": "app", "to": "/app"},
        ],
        "cmd": ["/bin/sh"],
    }


def test_build_from_steps_then_cached(alpha: httpx.Client, base: str) -> None:
    name = f"built-{uuid.uuid4().hex[:8]}"
    context = context_tar({"app/hello.txt": b"copied in\n", "app/sub/x": b"x\n", "other": b"no"})
    status, events = build(alpha, name, steps_document(base), context)
    assert status == 200, events
    kinds = [e["event"] for e in events]
    assert kinds[0] == "build" and kinds[-1] == "done", events
    assert {"index": 1, "text": "building\n"}.items() <= next(
        e for e in events if e["event"] == "log"
    ).items()
    done = [e for e in events if e["event"] == "step_done"]
    assert [e["cached"] for e in done] == [False] * 5
    template = events[-1]["template"]
    assert template["source"] == "build" and template["env"]["STAGE"] == "two"
    assert template["workdir"] == "/srv" and template["cmd"] == ["/bin/sh"]
    assert template["layers"] == 2 + 3, "the base's two, two run steps', one copy's"
    try:
        made = alpha.post("/api/v1/sandboxes", json={"template": name, "pool": False})
        assert made.status_code == 201, made.text
        sandbox = made.json()["name"]
        try:
            seen = sh(
                alpha,
                sandbox,
                "cat /etc/built /etc/where /etc/stage /app/hello.txt /app/sub/x; echo $STAGE; "
                "test -e /etc/greeting || echo greeting-deleted; test -e /app/other || echo only",
            )
            assert seen == "built\n/srv\ntwo\ncopied in\nx\ntwo\ngreeting-deleted\nonly\n"
        finally:
            alpha.delete(f"/api/v1/sandboxes/{sandbox}")
        # the same steps again: every step's layer is reused, nothing runs
        again = f"{name}-again"
        status, events = build(alpha, again, steps_document(base), context)
        assert status == 200, events
        # run and copy steps reused; env and workdir only change the config
        cached = [e["cached"] for e in events if e["event"] == "step_done"]
        assert cached == [True, False, False, True, True], events
        assert [e for e in events if e["event"] == "log"] == []
        assert events[-1]["template"]["digest"] == template["digest"]
        alpha.delete(f"/api/v1/templates/{again}")
        # no step sandbox is left behind
        left = alpha.get("/api/v1/sandboxes").json()["sandboxes"]
        assert not [s for s in left if "sandgate-build" in s["metadata"]], left
    finally:
        alpha.delete(f"/api/v1/templates/{name}")


def test_a_failing_step_keeps_its_log_and_records_nothing(alpha: httpx.Client, base: str) -> None:
    name = f"fails-{uuid.uuid4().hex[:8]}"
    document = {"from": base, "steps": [{"run": "echo about to fail; exit 3"}]}
    status, events = build(alpha, name, document)
    assert status == 200, events
    error = events[-1]
    assert error["event"] == "error" and error["step"] == 1, events
    assert "exited with code 3" in error["message"]
    record = alpha.get(f"/api/v1/templates/builds/{error['build']}")
    assert record.status_code == 200, record.text
    assert record.json()["state"] == "failed" and "about to fail" in record.json()["log"]
    assert alpha.get(f"/api/v1/templates/{name}").status_code == 404


def test_bad_builds_are_refused_before_anything_runs(
    alpha: httpx.Client, beta: httpx.Client, base: str
) -> None:
    name = f"bad-{uuid.uuid4().hex[:8]}"
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"from": base, "steps": []}, 400, "invalid_build"),
        ({"from": base, "steps": [{"run": "x", "copy": "y"}]}, 400, "invalid_build"),
        ({"from": base, "steps": [{"copy": "../etc", "to": "/x"}]}, 400, "invalid_build"),
        ({"from": base, "steps": [{"copy": "app", "to": "/x"}]}, 400, "invalid_build"),
        ({"from": "default", "steps": [{"run": "true"}]}, 400, "invalid_build"),
        ({"from": "no-such", "steps": [{"run": "true"}]}, 404, "template_not_found"),
    ]
    for document, status, code in cases:
        answer, events = build(alpha, name, document)
        assert answer == status, (document, events)
        assert events[0]["error"]["code"] == code, (document, events)
    # another tenant cannot build from alpha's template, nor read its builds
    answer, events = build(beta, name, {"from": base, "steps": [{"run": "true"}]})
    assert answer == 404, events
    assert beta.get("/api/v1/templates/builds/nope").status_code == 404


def test_json_build_without_context(alpha: httpx.Client, base: str, tmp_path: Path) -> None:
    name = f"json-{uuid.uuid4().hex[:8]}"
    document = {"from": base, "steps": [{"run": "echo hi > /etc/json-built"}]}
    with alpha.stream(
        "POST", "/api/v1/templates", params={"name": name}, json=document, timeout=300
    ) as answer:
        assert answer.status_code == 200
        events = [json.loads(line) for line in answer.iter_lines() if line]
    assert events[-1]["event"] == "done", events
    alpha.delete(f"/api/v1/templates/{name}")


def test_cli_build_from_a_toml_file(deployment: Deployment, base: str, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "index.html").write_text("<h1>hi</h1>\n")
    (tmp_path / "template.toml").write_text(
        f'from = "{base}"\n'
        'cmd = ["/bin/sh"]\n\n'
        '[[steps]]\nrun = "echo from-cli > /etc/cli"\n\n'
        '[[steps]]\ncopy = "site"\nto = "/srv/site"\n'
    )
    (tmp_path / "broken.toml").write_text(
        f'from = "{base}"\n[[steps]]\nrun = "echo the-cause; exit 7"\n'
    )
    env = {**os.environ, "SANDGATE_URL": deployment.url}
    env["SANDGATE_API_KEY"] = deployment.keys["alpha"]
    cli = [str(Path(sys.executable).parent / "sandgate"), "templates"]
    name = f"cli-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(
        [*cli, "build", name, "-f", str(tmp_path / "template.toml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    assert (
        "#1 run echo from-cli > /etc/cli" in made.stderr and "#2 copy site /srv/site" in made.stderr
    )
    assert made.stdout.startswith(f"{name}: ")
    try:
        with deployment.client("alpha") as alpha:
            box = alpha.post("/api/v1/sandboxes", json={"template": name, "pool": False})
            assert box.status_code == 201, box.text
            try:
                assert sh(alpha, box.json()["name"], "cat /etc/cli /srv/site/index.html") == (
                    "from-cli\n<h1>hi</h1>\n"
                )
            finally:
                alpha.delete(f"/api/v1/sandboxes/{box.json()['name']}")
        failed = subprocess.run(
            [*cli, "build", f"{name}-x", "-f", str(tmp_path / "broken.toml")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert failed.returncode == 1, failed.stderr
        assert "the-cause" in failed.stderr and "step 1 failed" in failed.stderr
        build_id = failed.stderr.split("build-log ")[1].split(")")[0]
        shown = subprocess.run(
            [*cli, "build-log", build_id], env=env, capture_output=True, text=True, timeout=60
        )
        assert "the-cause" in shown.stdout and "-- failed" in shown.stdout, shown
    finally:
        with deployment.client("alpha") as alpha:
            alpha.delete(f"/api/v1/templates/{name}")
