"""Shared test options. Postgres tests take --pg-dsn (CI always passes it)."""

from __future__ import annotations

import os

import pytest


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
