"""The portal's serving on the shared deployment: the page under /ui only, its assets, and the
admin state view. What it does in a browser: tests/e2e/test_portal_browser.py."""

from __future__ import annotations

import re

import httpx
import pytest

from sandgate.api.portal import STATIC
from tests.integration.api.conftest import Deployment

pytestmark = pytest.mark.skipif(
    not (STATIC / "index.html").is_file(), reason="the portal is not built: run scripts/install"
)


def test_every_path_under_ui_answers_the_page_and_its_assets_are_served(
    deployment: Deployment,
) -> None:
    with httpx.Client(base_url=deployment.url) as client:
        home = client.get("/")
        assert home.status_code == 307 and home.headers["location"] == "/ui/"
        for path in ("/ui", "/ui/", "/ui/sandboxes/sbx-x/terminal", "/ui/admin", "/ui/a%2Fb"):
            page = client.get(path)
            assert page.status_code == 200, path
            assert page.headers["content-type"].startswith("text/html"), path
            assert page.headers["cache-control"] == "no-cache"
            assert '<div id="app">' in page.text
        head = client.head("/ui/sandboxes")  # uptime checks and curl -I
        assert head.status_code == 200 and head.headers["content-type"].startswith("text/html")
        assets = re.findall(r'(?:src|href)="(/ui/assets/[^"]+)"', client.get("/ui/").text)
        assert any(a.endswith(".js") for a in assets) and any(a.endswith(".css") for a in assets)
        for asset in assets:
            got = client.get(asset)
            assert got.status_code == 200 and "immutable" in got.headers["cache-control"]
            assert not got.headers["content-type"].startswith("text/html")
        missing = client.get("/ui/assets/index-missing.js")
        assert missing.status_code == 404 and "html" not in missing.headers["content-type"]


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/nothing-here",
        "/api/v1/sandboxes/sbx-none/toolbox/files/list",
        "/internal/anything",
        "/tunnel",
        "/v2/sandboxes",
        "/sandboxes/nothing",
        "/uix",
        "/ui.html",
        "/docs/assets/missing.js",
    ],
)
def test_no_path_outside_ui_answers_html(deployment: Deployment, path: str) -> None:
    with httpx.Client(base_url=deployment.url) as client:
        for headers in ({}, {"Accept": "text/html"}, {"Authorization": "Bearer nope"}):
            got = client.get(path, headers=headers)
            assert got.status_code >= 400, (path, got.status_code)
            assert "html" not in got.headers.get("content-type", ""), (path, got.text[:200])
            assert '<div id="app">' not in got.text


def test_the_state_table_takes_an_admin_key(deployment: Deployment, alpha: httpx.Client) -> None:
    refused = alpha.get("/api/v1/admin/state")
    assert refused.status_code == 403, refused.text
    assert "admin key" in refused.json()["error"]["message"]
    with deployment.admin() as admin:
        state = admin.get("/api/v1/admin/state")
    assert state.status_code == 200, state.text
    rows = {row["name"]: row for row in state.json()["rows"]}
    assert rows["ServerLocalState.tunnels"]["size"] >= 1  # the worker's tunnel
    assert rows["ServerLocalState.tunnels"]["bound"]
    assert state.json()["instance"]
