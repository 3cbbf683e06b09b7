"""Shared test options. Postgres tests take --pg-dsn (CI always passes it)."""

from __future__ import annotations

import os

import pytest

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


@pytest.fixture(scope="session")
def pg_dsn(request: pytest.FixtureRequest) -> str:
    dsn: str = request.config.getoption("--pg-dsn")
    if not dsn:
        pytest.skip("no --pg-dsn given")
    return dsn
