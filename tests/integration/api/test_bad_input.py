"""Bad input always gets a clear 4xx with an error code, never a 500."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.api.conftest import Deployment, start_deployment, tear_down


def error_code(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) == {"error"}, body
    assert body["error"]["message"], body
    return str(body["error"]["code"])


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"Authorization": "Bearer nope"}, 401),
        ({"Authorization": "Basic Zm9vOmJhcg=="}, 401),
        ({"X-API-Key": "sg_not-a-real-key"}, 401),
    ],
)
def test_bad_auth(deployment: Deployment, headers: dict[str, str], status: int) -> None:
    response = httpx.get(f"{deployment.url}/api/v1/sandboxes", headers=headers)
    assert response.status_code == status
    assert error_code(response) == "unauthorized"


def test_x_api_key_header_works(deployment: Deployment) -> None:
    response = httpx.get(
        f"{deployment.url}/api/v1/sandboxes", headers={"X-API-Key": deployment.keys["alpha"]}
    )
    assert response.status_code == 200


def test_worker_token_cannot_call_the_api(deployment: Deployment) -> None:
    response = httpx.get(
        f"{deployment.url}/api/v1/sandboxes",
        headers={"Authorization": f"Bearer {deployment.worker_token}"},
    )
    assert response.status_code == 401


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b'{"unknown": 1}', 422, "validation_error"),
        (b'{"timeout": "soon"}', 422, "validation_error"),
        (b'{"network": "yes"}', 422, "validation_error"),
        (b'{"metadata": {"a": 1}}', 422, "validation_error"),
        (b'{"metadata": {"idem": "x"}}', 422, "validation_error"),
        (b'{"resources": {"memory_mb": 1}}', 422, "validation_error"),
        (b'{"timeout": -5}', 422, "validation_error"),
        (b"[]", 422, "validation_error"),
        (b'{"timeout": 99999999}', 400, "invalid_request"),
    ],
)
def test_bad_create_bodies(alpha: httpx.Client, body: bytes, status: int, code: str) -> None:
    response = alpha.post(
        "/api/v1/sandboxes", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == status, response.text
    assert error_code(response) == code


def test_bad_idempotency_keys(alpha: httpx.Client) -> None:
    for key in ("x" * 256, "has space", "tab\tkey"):
        response = alpha.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": key})
        assert response.status_code == 400, key
        assert error_code(response) == "invalid_idempotency_key"


def test_huge_body_is_413(alpha: httpx.Client) -> None:
    response = alpha.post(
        "/api/v1/sandboxes/sbx-x/execute",
        content=b'{"code": "' + b"x" * (3 << 20) + b'"}',
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 413
    assert error_code(response) == "payload_too_large"


def test_huge_chunked_body_is_413(alpha: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"code": "'
        for _ in range(40):
            yield b"x" * (100 << 10)
        yield b'"}'

    response = alpha.post(
        "/api/v1/sandboxes/sbx-x/execute",
        content=chunks(),
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 413


def test_unknown_sandbox_and_route(alpha: httpx.Client) -> None:
    for method, path in [
        ("GET", "/api/v1/sandboxes/sbx-nope"),
        ("DELETE", "/api/v1/sandboxes/sbx-nope"),
        ("POST", "/api/v1/sandboxes/sbx-nope/execute"),
        ("GET", "/api/v1/sandboxes/sbx-nope/toolbox/files/list"),
        ("GET", "/api/v1/nothing-here"),
    ]:
        response = alpha.request(method, path, json={"code": "true"})
        assert response.status_code == 404, (method, path, response.text)
        assert error_code(response) == "not_found"
    response = alpha.post("/api/v1/sandboxes/execute", json={"code": "true"})
    assert response.status_code == 422  # ?sandbox= missing
    response = alpha.put("/api/v1/sandboxes")
    assert response.status_code == 405
    assert error_code(response) == "method_not_allowed"


def test_bad_execute_bodies(alpha: httpx.Client, sandbox: str) -> None:
    for body in (
        {"code": ""},
        {"code": "true", "language": "ruby"},
        {"code": "true", "timeout": 0},
        {"code": "true", "timeout": "1"},
        {"code": 5},
        {"cmd": "true"},
    ):
        response = alpha.post(f"/api/v1/sandboxes/{sandbox}/execute", json=body)
        assert response.status_code == 422, (body, response.text)
    missing_cwd = alpha.post(
        f"/api/v1/sandboxes/{sandbox}/execute", json={"code": "true", "cwd": "/workspace/nope"}
    )
    assert missing_cwd.status_code == 404
    outside_cwd = alpha.post(
        f"/api/v1/sandboxes/{sandbox}/execute", json={"code": "true", "cwd": "/etc"}
    )
    assert outside_cwd.status_code == 403


def test_network_without_a_network_worker_is_refused(tmp_path: Path) -> None:
    dep = start_deployment(tmp_path, worker=False)
    try:
        dep.start_worker(args=("--no-network",))
        with dep.client("alpha") as alpha:
            response = alpha.post("/api/v1/sandboxes", json={"network": True})
            assert response.status_code == 422
            assert error_code(response) == "network_unavailable"
            assert "--no-network" in response.json()["error"]["message"]
            made = alpha.post("/api/v1/sandboxes", json={"network": False})
            assert made.status_code == 201
    finally:
        tear_down(dep)


def test_openapi(deployment: Deployment) -> None:
    spec = httpx.get(f"{deployment.url}/openapi.json").json()
    assert "/api/v1/sandboxes" in spec["paths"]
    assert "/api/v1/sandboxes/{name}/toolbox/files" in spec["paths"]
