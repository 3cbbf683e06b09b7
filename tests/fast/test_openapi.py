"""The API's description: a valid OpenAPI document (checked by openapi-spec-validator) with
security schemes, raw bodies, the system routes, and `/docs` working without the internet."""

from __future__ import annotations

import re

import pytest
from openapi_spec_validator import validate

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
