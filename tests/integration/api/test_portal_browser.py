"""The portal in a real browser: Debian's Chromium, headless, driven by Playwright (the system
browser: nothing is downloaded), against the real server and worker.

A tenant signs in with its key, creates a sandbox, types in the terminal and reads the
shell's answer back, uploads a file and sees it listed, deletes the sandbox; an admin sees
the workers, the admission queue and breaker, and the state table. Screenshots of each step
go to test-artifacts/portal/ (or $SANDGATE_TEST_ARTIFACTS/portal/)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from sandgate.api.portal import STATIC
from tests.integration.api.conftest import Deployment

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# a closed network: Chromium's own background connections only fail, and slow it down
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(os.environ.get("SANDGATE_TEST_ARTIFACTS", "test-artifacts")) / "portal"

pytestmark = [
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(), reason="needs chromium (scripts/install --dev)"
    ),
    pytest.mark.skipif(
        not (STATIC / "index.html").is_file(), reason="the portal is not built: scripts/install"
    ),
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    opened = context.new_page()
    opened.set_default_timeout(30_000)
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield opened
    finally:
        context.close()
    assert errors == [], errors  # no uncaught exception in the page


def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def sign_in(page: Page, url: str, key: str, lands_on: str = "Sandboxes") -> None:
    page.goto(f"{url}/ui/")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name=lands_on)).to_be_visible()


def test_a_tenant_runs_a_sandbox_from_the_browser(
    deployment: Deployment, page: Page, tmp_path: Path
) -> None:
    page.goto(f"{deployment.url}/ui/")
    page.get_by_label("API key").fill("sg_not-a-key")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_contain_text("key")  # the server's own words
    shot(page, "01-wrong-key")

    sign_in(page, deployment.url, deployment.keys["alpha"])
    assert page.evaluate("sessionStorage.getItem('sandgate.key')") == deployment.keys["alpha"]
    assert page.evaluate("localStorage.length") == 0  # the key is kept in the session only
    page.get_by_placeholder("KEY=VALUE, …").fill("made=browser")
    page.get_by_role("button", name="Create sandbox").click()
    page.wait_for_url(re.compile(r"/ui/sandboxes/sbx-[a-z0-9]+$"))
    name = page.get_by_test_id("sandbox-name").inner_text()
    expect(page.locator("h2 .state")).to_have_text("running")
    expect(page.get_by_test_id("overview")).to_contain_text("made=browser")
    page.get_by_role("button", name="Extend").click()
    expect(page.get_by_text("Extended: it now expires")).to_be_visible()
    shot(page, "02-created")

    page.get_by_role("link", name="terminal").click()
    expect(page.get_by_test_id("terminal-status")).to_have_text("connected")
    page.get_by_test_id("terminal").click()
    page.keyboard.type("echo hi-$((40+2))\n")  # the shell's arithmetic: not just our echo
    expect(page.locator(".xterm-rows")).to_contain_text("hi-42")
    shot(page, "03-terminal")

    page.get_by_role("link", name="processes").click()
    page.get_by_placeholder("a command, run by bash", exact=False).fill(
        r"printf 'caf\xc3\xa9 \xff\n';"  # UTF-8 and a byte that is not: sent as base64
        " for i in 1 2 3; do echo tick-$i; sleep 0.3; done; read line; echo got-$line"
    )
    page.get_by_role("button", name="Start").click()
    output = page.get_by_test_id("process-output")
    expect(output).to_contain_text("tick-3")  # streamed while the process runs
    expect(output).to_contain_text("café \ufffd")  # decoded as UTF-8, not as Latin-1
    page.get_by_placeholder("a line to its stdin").fill("typed")
    page.get_by_role("button", name="Send").click()
    expect(output).to_contain_text("got-typed")
    expect(page.locator(".logs h3")).to_contain_text("exited (0)")
    shot(page, "04-processes")

    page.get_by_role("link", name="jobs").click()
    page.get_by_placeholder("a command to run as a job", exact=False).fill("echo job-$((6*7))")
    page.get_by_role("button", name="Submit job").click()
    expect(page.locator(".logs pre")).to_contain_text("job-42")
    expect(page.locator(".logs h3")).to_contain_text("succeeded")
    shot(page, "05-jobs")

    upload = tmp_path / "from-the-browser.txt"
    upload.write_text("uploaded through the portal\n")
    page.get_by_role("link", name="files").click()
    expect(page.get_by_test_id("files")).to_be_visible()
    page.get_by_test_id("upload").set_input_files(str(upload))
    expect(page.locator('tr[data-file="from-the-browser.txt"]')).to_be_visible()
    shot(page, "06-files")
    page.get_by_role("button", name="Up").click()  # "/" is not this sandbox's: its roots
    expect(page.get_by_text("This sandbox's files are under /workspace and /tmp.")).to_be_visible()
    page.get_by_role("link", name="workspace/").click()
    expect(page.locator('tr[data-file="from-the-browser.txt"]')).to_be_visible()
    with deployment.client("alpha") as api:
        got = api.get(
            f"/api/v1/sandboxes/{name}/toolbox/files",
            params={"path": "/workspace/from-the-browser.txt"},
        )
        assert got.content == b"uploaded through the portal\n"

    page.reload()  # the app's own path survives a reload: the server answers the page
    expect(page.get_by_test_id("files")).to_be_visible()

    page.get_by_role("link", name="overview").click()
    page.once("dialog", lambda dialog: dialog.accept())  # "Delete sbx-…?"
    page.get_by_test_id("delete-sandbox").click()
    page.wait_for_url(re.compile(r"/ui/$"))
    expect(page.locator(f'tr[data-sandbox="{name}"]')).to_have_count(0)
    shot(page, "07-deleted")
    page.goto(f"{deployment.url}/ui/sandboxes/{name}")  # no stale "running" for a gone one
    expect(page.get_by_text("It was deleted, or it is another tenant's.")).to_be_visible()
    expect(page.locator("nav.tabs")).to_have_count(0)
    with deployment.client("alpha") as api:
        gone = api.get(f"/api/v1/sandboxes/{name}")
        assert gone.status_code == 404 or gone.json()["state"] == "deleted", gone.text

    page.get_by_test_id("sign-out").click()
    expect(page.get_by_label("API key")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('sandgate.key')") is None


def test_an_admin_sees_the_workers_the_queue_and_the_state(
    deployment: Deployment, page: Page
) -> None:
    failed: list[str] = []
    page.on("response", lambda r: failed.append(r.url) if r.status >= 400 else None)
    sign_in(page, deployment.url, deployment.admin_key, lands_on="Workers")
    assert page.get_by_role("link", name="Sandboxes").count() == 0  # an admin key runs none
    page.get_by_role("link", name="Admin").click()
    expect(page.get_by_test_id("workers")).to_contain_text("w1")
    expect(page.get_by_test_id("admission")).to_contain_text("closed")
    expect(page.get_by_test_id("state")).to_contain_text("ServerLocalState.tunnels")
    shot(page, "08-admin")
    assert failed == [], failed  # no tenant's page was tried with the admin key first


def test_a_tenant_key_sees_no_admin_view(deployment: Deployment, page: Page) -> None:
    sign_in(page, deployment.url, deployment.keys["beta"])
    expect(page.get_by_role("link", name="Templates")).to_be_visible()
    assert page.get_by_role("link", name="Admin").count() == 0
    page.goto(f"{deployment.url}/ui/admin")
    expect(page.get_by_text("The admin views take an admin key.")).to_be_visible()
    with httpx.Client(base_url=deployment.url) as client:
        assert client.get("/api/v1/admin/state").status_code == 401
