"""Shared test options and fixtures. Postgres tests take --pg-dsn (CI always passes it)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator

import pytest

from tests.faultproxy import FaultProxy, OpenProxy, Rule
from tests.nethosts import Internet, internet_hosts

# Workers the tests start hold up to 160 small, mostly idle sandboxes: more than this host's
# memory and disk budget gives them at the real defaults (512 MiB and 1 GiB each, overcommit
# 1). The tests of the budget itself pass --memory-overcommit/--disk-overcommit explicitly.
os.environ.setdefault("SANDGATE_MEMORY_OVERCOMMIT", "8")
os.environ.setdefault("SANDGATE_DISK_OVERCOMMIT", "8")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--pg-dsn",
        default=os.environ.get("SANDGATE_TEST_PG_DSN", ""),
        help="PostgreSQL DSN of a server where tests may create databases, "
        "e.g. postgresql://postgres@127.0.0.1:5432/test",
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Once every test has ended: in the controlling process, not in each xdist worker (the
    first to finish once unmounted a workspace from under a test still running on the
    other)."""
    if hasattr(session.config, "workerinput"):
        return
    from tests.statedirs import unmount_test_leftovers

    unmount_test_leftovers()  # a killed worker's mounts would keep their loop devices


@pytest.fixture(scope="session")
def pg_dsn(request: pytest.FixtureRequest) -> str:
    dsn: str = request.config.getoption("--pg-dsn")
    if not dsn:
        pytest.skip("no --pg-dsn given")
    return dsn


@pytest.fixture(scope="module")
def internet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Internet]:
    """The tests' own internet hosts (tests/nethosts.py), one per module. When a test of the
    module failed, what the hosts answer now and their logs go to the real stderr (a module
    fixture's teardown output is not shown otherwise)."""
    failed = request.session.testsfailed
    with internet_hosts(tmp_path_factory.mktemp("internet")) as net:
        yield net
        if request.session.testsfailed > failed:
            print(net.report(), file=sys.__stderr__, flush=True)


@pytest.fixture
def fault_proxy() -> Iterator[OpenProxy]:
    """Open fault proxies (tests/faultproxy.py, the only proxy of the tests): each call starts
    one to a URL, listening on `port` (or a free one), with an optional HTTP `rule`. Every one
    is stopped after the test. May be called from any thread."""
    opened: list[FaultProxy] = []
    lock = threading.Lock()

    def open_proxy(url: str, *, rule: Rule | None = None, port: int = 0) -> FaultProxy:
        proxy = FaultProxy.at(url, rule=rule, port=port)
        with lock:
            opened.append(proxy)
        return proxy

    yield open_proxy
    with lock:
        for proxy in reversed(opened):
            proxy.stop()
