"""The API's description: a valid OpenAPI document (checked by openapi-spec-validator) with
security schemes, raw bodies, the system routes, and `/docs` working without the internet."""

from __future__ import annotations

import re
from typing import Any

import pytest
from openapi_spec_validator import validate

from sandgate.api.openapi import PUBLIC
from tests.fast.conftest import Fast

pytestmark = pytest.mark.anyio


async def test_the_document_is_valid_and_says_how_to_authenticate(fast: Fast) -> None:
    got = await fast.api.get("/openapi.json")
    assert got.status_code == 200
    doc = got.json()
    validate(doc)  # raises on any violation of the OpenAPI schema
    schemes = doc["components"]["securitySchemes"]
    assert schemes["bearer"]["scheme"] == "bearer" and schemes["apiKey"]["name"] == "X-API-Key"
    assert doc["security"] == [{"bearer": []}, {"apiKey": []}]
    paths = doc["paths"]
    for public in ("/healthz", "/readyz", "/metrics"):
        assert paths[public]["get"]["security"] == [], public
    upload = paths["/api/v1/sandboxes/{name}/toolbox/files"]["put"]["requestBody"]
    assert "application/octet-stream" in upload["content"]
    stdin = paths["/api/v1/sandboxes/{name}/toolbox/processes/{pid}/stdin"]["post"]
    assert "application/octet-stream" in stdin["requestBody"]["content"]
    listing = paths["/api/v1/sandboxes"]["get"]["description"]
    assert "metadata.KEY" in listing
    assert (
        "WebSocket" in doc["info"]["description"] and "/toolbox/pty" in doc["info"]["description"]
    )
    assert not any(p.startswith("/internal") for p in paths)


async def test_docs_are_served_from_the_package(fast: Fast) -> None:
    page = await fast.api.get("/docs")
    assert page.status_code == 200 and "swagger" in page.text.lower()
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert assets and all(a.startswith("/docs/assets/") for a in assets if "://" not in a)
    assert not any(a.startswith("http") for a in assets), assets  # no CDN
    for asset in assets:
        served = await fast.api.get(asset)
        assert served.status_code == 200 and len(served.content) > 100, asset


# every error status the document once listed for every route alike
ALL_ERRORS = {400, 401, 403, 404, 409, 413, 422, 502, 503, 504, 507}


def _errors(operation: dict[str, Any]) -> set[int]:
    return {int(s) for s in operation.get("responses", {}) if s.isdigit() and int(s) >= 400}


async def test_each_route_lists_only_the_errors_it_can_answer(fast: Fast) -> None:
    paths = (await fast.api.get("/openapi.json")).json()["paths"]
    assert _errors(paths["/healthz"]["get"]) == set()
    create = paths["/api/v1/sandboxes"]["post"]
    assert {401, 422, 429, 503} <= _errors(create) and 500 not in _errors(create)
    assert _errors(paths["/api/v1/sandboxes/{name}"]["get"]) == {401, 403, 404, 429, 503}
    download = paths["/api/v1/sandboxes/{name}/toolbox/files"]["get"]
    assert 404 in _errors(download) and 507 not in _errors(download)
    assert 507 in _errors(paths["/api/v1/sandboxes/{name}/toolbox/files"]["put"])
    assert 403 not in _errors(paths["/api/v1/templates"]["get"])  # an admin key reads them
    everything: set[str] = set()
    for path, operations in paths.items():
        for method, operation in operations.items():
            errors = _errors(operation)
            assert 500 not in errors, (method, path)
            if ALL_ERRORS <= errors:
                everything.add(f"{method} {path}")
            if path not in PUBLIC:
                assert 401 in errors, (method, path)  # every route behind a key
            if operation.get("requestBody", {}).get("content", {}).get("application/json"):
                assert {413, 422} <= errors, (method, path)
    # only the writes into a sandbox's or a workspace's files can answer them all (a body, the
    # agent, its worker, a full disk)
    assert everything == {
        "put /api/v1/sandboxes/{name}/toolbox/files",
        "post /api/v1/sandboxes/{name}/toolbox/files/mkdir",
        "post /api/v1/sandboxes/{name}/toolbox/files/move",
        "post /api/v1/workspaces/{name}/commits",
        "post /api/v1/workspaces/{name}/restore",
    }


async def test_errors_are_described_with_examples(fast: Fast) -> None:
    doc = (await fast.api.get("/openapi.json")).json()
    create = doc["paths"]["/api/v1/sandboxes"]["post"]
    for status, response in create["responses"].items():
        if int(status) < 400:
            continue
        assert response["description"] != "Additional Response", status
        body = response["content"]["application/json"]
        assert body["schema"] == {"$ref": "#/components/schemas/ErrorOut"}
        assert set(body["example"]["error"]) == {"code", "message"}, status
    assert create["responses"]["429"]["headers"]["Retry-After"]["required"] is True
    assert "Idempotent-Replayed" in create["responses"]["200"]["headers"]  # a replay is a 200
    schemas = doc["components"]["schemas"]
    assert schemas["ErrorOut"]["examples"][0]["error"]["code"]
    assert schemas["CreateSandbox"]["examples"] and schemas["Execute"]["examples"]
