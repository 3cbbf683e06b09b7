"""Sandboxes through the real API: lifecycle, idempotent create, execute."""

from __future__ import annotations

import asyncio
import hashlib
import uuid

import httpx

from tests.integration.api.conftest import Deployment, wait_until


def test_create_get_list_delete(alpha: httpx.Client) -> None:
    response = alpha.post(
        "/api/v1/sandboxes",
        json={"timeout": 120, "metadata": {"team": "a b", "run": "1"}, "env": {"GREETING": "hi"}},
    )
    assert response.status_code == 201, response.text
    body = response.json()
    name = body["name"]
    assert body["state"] == "running"
    assert body["metadata"]["team"] == "a b"
    assert body["worker"] == "w1"
    assert body["created_at"] and body["expires_at"]

    assert alpha.get(f"/api/v1/sandboxes/{name}").json()["name"] == name
    listed = alpha.get("/api/v1/sandboxes", params={"state": "running", "metadata.team": "a b"})
    assert [s["name"] for s in listed.json()["sandboxes"]] == [name]
    assert alpha.get("/api/v1/sandboxes", params={"metadata.team": "zzz"}).json()["sandboxes"] == []

    out = alpha.post(f"/api/v1/sandboxes/{name}/execute", json={"code": "echo $GREETING"})
    assert out.json()["stdout"] == "hi\n"

    assert alpha.delete(f"/api/v1/sandboxes/{name}").status_code == 204
    assert alpha.get(f"/api/v1/sandboxes/{name}").status_code == 404
    assert alpha.post(f"/api/v1/sandboxes/{name}/execute", json={"code": "true"}).status_code == 404
    assert alpha.delete(f"/api/v1/sandboxes/{name}").status_code == 404


def test_list_pages_with_cursor(alpha: httpx.Client) -> None:
    tag = uuid.uuid4().hex
    names = sorted(
        alpha.post("/api/v1/sandboxes", json={"metadata": {"page": tag}}).json()["name"]
        for _ in range(3)
    )
    seen: list[str] = []
    cursor = None
    while True:
        params = {"metadata.page": tag, "limit": "2"} | ({"cursor": cursor} if cursor else {})
        page = alpha.get("/api/v1/sandboxes", params=params).json()
        seen += [s["name"] for s in page["sandboxes"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == names
    for name in names:
        alpha.delete(f"/api/v1/sandboxes/{name}")


def test_idempotent_create_replays(alpha: httpx.Client) -> None:
    key = uuid.uuid4().hex
    first = alpha.post("/api/v1/sandboxes", json={"timeout": 60}, headers={"Idempotency-Key": key})
    assert first.status_code == 201, first.text
    again = alpha.post("/api/v1/sandboxes", json={"timeout": 60}, headers={"Idempotency-Key": key})
    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["name"] == first.json()["name"]
    meta = first.json()["metadata"]
    tenant_scope = meta["idem_owner"]
    assert (
        meta["idem"]
        == hashlib.sha256(f"tenant:{tenant_scope}\x00key:{key}".encode()).hexdigest()[:8]
    )

    other_body = alpha.post(
        "/api/v1/sandboxes", json={"timeout": 61}, headers={"Idempotency-Key": key}
    )
    assert other_body.status_code == 422
    assert other_body.json()["error"]["code"] == "idempotency_key_reused"
    alpha.delete(f"/api/v1/sandboxes/{first.json()['name']}")


def test_same_key_other_tenant_gets_its_own_sandbox(
    alpha: httpx.Client, beta: httpx.Client
) -> None:
    key = uuid.uuid4().hex
    a = alpha.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": key})
    b = beta.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": key})
    assert a.status_code == 201 and b.status_code == 201
    assert a.json()["name"] != b.json()["name"]
    assert a.json()["metadata"]["idem_owner"] != b.json()["metadata"]["idem_owner"]
    # and neither sees, runs in, or deletes the other's
    name_a = a.json()["name"]
    assert beta.get(f"/api/v1/sandboxes/{name_a}").status_code == 404
    assert beta.post(f"/api/v1/sandboxes/{name_a}/execute", json={"code": "id"}).status_code == 404
    assert beta.delete(f"/api/v1/sandboxes/{name_a}").status_code == 404
    assert beta.get(f"/api/v1/sandboxes/{name_a}/toolbox/files/list").status_code == 404
    assert name_a not in [s["name"] for s in beta.get("/api/v1/sandboxes").json()["sandboxes"]]
    assert alpha.get(f"/api/v1/sandboxes/{name_a}").json()["state"] == "running"
    alpha.delete(f"/api/v1/sandboxes/{name_a}")
    beta.delete(f"/api/v1/sandboxes/{b.json()['name']}")


def test_200_concurrent_creates_with_one_key_make_one_sandbox(deployment: Deployment) -> None:
    key = uuid.uuid4().hex

    async def storm() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(
            base_url=deployment.url,
            headers={"Authorization": f"Bearer {deployment.keys['alpha']}", "Idempotency-Key": key},
            timeout=120,
            limits=limits,
        ) as client:
            return await asyncio.gather(
                *(
                    client.post("/api/v1/sandboxes", json={"metadata": {"storm": key}})
                    for _ in range(200)
                )
            )

    responses = asyncio.run(storm())
    statuses = sorted({r.status_code for r in responses})
    assert statuses in ([200, 201], [201]), statuses
    assert sum(r.status_code == 201 for r in responses) == 1
    assert len({r.json()["name"] for r in responses}) == 1
    with deployment.client() as alpha:
        found = alpha.get("/api/v1/sandboxes", params={"metadata.storm": key}).json()["sandboxes"]
        assert len(found) == 1
        alpha.delete(f"/api/v1/sandboxes/{found[0]['name']}")


def test_execute_basics(alpha: httpx.Client, sandbox: str) -> None:
    ok = alpha.post(
        f"/api/v1/sandboxes/{sandbox}/execute", json={"language": "bash", "code": "echo ok"}
    )
    assert ok.status_code == 200
    assert ok.json()["stdout"] == "ok\n"
    assert ok.json()["exit_code"] == 0
    assert ok.json()["duration_ms"] >= 0

    by_query = alpha.post(
        "/api/v1/sandboxes/execute",
        params={"sandbox": sandbox},
        json={"code": "echo q >&2; exit 3"},
    )
    assert by_query.json()["stderr"] == "q\n"
    assert by_query.json()["exit_code"] == 3

    py = alpha.post(
        f"/api/v1/sandboxes/{sandbox}/execute",
        json={
            "language": "python",
            "code": "import os; print(os.getcwd(), os.environ['X'])",
            "env": {"X": "y"},
        },
    )
    assert py.json()["stdout"] == "/workspace y\n"
    sh = alpha.post(
        f"/api/v1/sandboxes/{sandbox}/execute",
        json={"language": "sh", "code": "pwd", "cwd": "/tmp"},
    )
    assert sh.json()["stdout"] == "/tmp\n"


def test_execute_timeout_kills_the_process_group(alpha: httpx.Client, sandbox: str) -> None:
    marker = uuid.uuid4().hex[:8]
    out = alpha.post(
        f"/api/v1/sandboxes/{sandbox}/execute",
        json={"code": f"sleep 300 & exec -a sleeper-{marker} sleep 300", "timeout": 1},
    ).json()
    assert out["timed_out"] is True
    assert out["exit_code"] == 124
    left = alpha.post(
        f"/api/v1/sandboxes/{sandbox}/execute",
        json={"code": "ps -eo args | grep -c '[s]leep 300' || true"},
    ).json()
    assert left["stdout"].strip() == "0"


def test_execute_output_is_capped(alpha: httpx.Client, sandbox: str) -> None:
    out = alpha.post(
        f"/api/v1/sandboxes/{sandbox}/execute",
        json={"language": "python", "code": "import sys; sys.stdout.write('x' * (3 << 20))"},
    ).json()
    assert out["stdout_truncated"] is True
    assert len(out["stdout"]) == 1 << 20
    assert out["exit_code"] == 0


def test_extend_timeout_and_reaper(alpha: httpx.Client) -> None:
    name = alpha.post("/api/v1/sandboxes", json={"timeout": 2}).json()["name"]
    extended = alpha.post(f"/api/v1/sandboxes/{name}/timeout", json={"timeout": 600})
    assert extended.status_code == 200
    assert (
        extended.json()["expires_at"] > alpha.get(f"/api/v1/sandboxes/{name}").json()["created_at"]
    )

    short = alpha.post("/api/v1/sandboxes", json={"timeout": 1}).json()["name"]
    marker = alpha.post(f"/api/v1/sandboxes/{short}/execute", json={"code": "echo $$"})
    assert marker.status_code == 200
    wait_until(
        lambda: alpha.get(f"/api/v1/sandboxes/{short}").json()["state"] == "stopped",
        timeout=15,
        what="reaper stops the sandbox",
    )
    stopped = alpha.post(f"/api/v1/sandboxes/{short}/execute", json={"code": "true"})
    assert stopped.status_code == 409
    assert alpha.get(f"/api/v1/sandboxes/{name}").json()["state"] == "running"
    alpha.delete(f"/api/v1/sandboxes/{name}")
    alpha.delete(f"/api/v1/sandboxes/{short}")


def test_execute_large_programs(alpha: httpx.Client, sandbox: str) -> None:
    # past the kernel's 128 KiB limit on one argument, and with characters JSON escapes
    lines = "\n".join(f"x{i} = {i}  # \x01é" for i in range(40_000))
    code = lines + "\nprint(x39999)\n"
    assert len(code.encode()) > 512 << 10
    out = alpha.post(
        f"/api/v1/sandboxes/{sandbox}/execute", json={"language": "python", "code": code}
    )
    assert out.status_code == 200, out.text
    assert out.json()["stdout"] == "39999\n"
    bash = alpha.post(
        f"/api/v1/sandboxes/{sandbox}/execute", json={"code": "true\n" * 40_000 + "echo done"}
    )
    assert bash.json()["stdout"] == "done\n"
