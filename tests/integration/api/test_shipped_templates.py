"""The template sandgate ships, built for real: `scripts/build-templates` bootstraps Debian
bookworm (minbase) from Debian's mirror, imports it, and builds templates/code-interpreter.toml
with sandgate's own builder on a worker that gives build steps network. Then E2B's code
interpreter SDK, unmodified and asking for its default template, runs on that image, and a
sandbox of it installs a Debian package with apt-get, which no other sandbox sees.

It downloads about 150 MB from Debian's mirror and builds a 1.3 GB image (about 4 minutes on
two cores): too long for every run of the suite, so it runs when SANDGATE_TEST_SHIPPED=1
(`SANDGATE_TEST_SHIPPED=1 ./scripts/test tests/integration/api/test_shipped_templates.py`)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b_code_interpreter import Sandbox

from tests.integration.api.conftest import Deployment, start_deployment, tear_down

pytestmark = [pytest.mark.bwrap, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
MIRROR = ("deb.debian.org", 80)


def mirror_reachable() -> bool:
    try:
        with socket.create_connection(MIRROR, timeout=5):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    if os.environ.get("SANDGATE_TEST_SHIPPED") != "1":
        pytest.skip("builds the shipped image from Debian's mirror: set SANDGATE_TEST_SHIPPED=1")
    if not mirror_reachable():
        pytest.skip(f"the Debian mirror {MIRROR[0]} is not reachable from this machine")
    dep = start_deployment(tmp_path_factory.mktemp("shipped"), worker=False)
    try:
        # the build's apt-get reaches the mirror through the egress gate; this machine's
        # mirror may sit in a reserved range the gate refuses by default
        mirror_ip = socket.gethostbyname(MIRROR[0])
        dep.start_worker(args=("--egress-permit", f"{mirror_ip}/32"))
        built = subprocess.run(
            [str(ROOT / "scripts" / "build-templates"), dep.url, dep.admin_key],
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert built.returncode == 0, built.stderr[-5000:]
        assert "code-interpreter: " in built.stdout, built.stdout
        yield dep
    finally:
        tear_down(dep)


@pytest.mark.timeout(600)
def test_code_interpreter_sdk_on_the_shipped_image(shipped: Deployment) -> None:
    options = {"api_key": shipped.keys["alpha"], "api_url": shipped.url, "sandbox_url": shipped.url}
    sbx = Sandbox.create(**options)  # the SDK's default template: code-interpreter-v1
    try:
        assert sbx.run_code("x = 1").error is None
        assert sbx.run_code("x + 1").text == "2"
        where = sbx.run_code("import sys, numpy, pandas; print(sys.executable, numpy.__file__)")
        executable, numpy_file = where.logs.stdout[0].split()
        assert executable == "/usr/bin/python3"  # the image's Python, not the host's
        assert numpy_file.startswith("/usr/lib/python3/dist-packages/numpy/")
        plot = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()")
        assert [bool(r.png) for r in plot.results] == [True]
        failed = sbx.run_code("1 / 0")
        assert failed.error is not None and failed.error.name == "ZeroDivisionError"
        other = sbx.create_code_context()
        isolated = sbx.run_code("x", context=other)
        assert isolated.error is not None and isolated.error.name == "NameError"
        release = sbx.commands.run("cat /etc/os-release").stdout
        assert "VERSION_CODENAME=bookworm" in release
    finally:
        sbx.kill()


@pytest.mark.timeout(600)
def test_apt_get_install_inside_and_it_vanishes(shipped: Deployment) -> None:
    options = {"api_key": shipped.keys["alpha"], "api_url": shipped.url, "sandbox_url": shipped.url}
    first = Sandbox.create(**options, allow_internet_access=True)
    try:
        installed = first.commands.run(
            "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q jq "
            "&& echo '{\"a\": 41}' | jq '.a + 1'",
            timeout=300,
        )
        assert installed.stdout.strip().endswith("42"), installed.stdout[-2000:]
        second = Sandbox.create(**options)
        try:
            assert second.commands.run("command -v jq || echo none").stdout == "none\n"
        finally:
            second.kill()
    finally:
        first.kill()
