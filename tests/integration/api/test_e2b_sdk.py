"""E2B's official Python SDK, unmodified, against a real server and worker (docs/e2b.md).

The scenarios are tests/e2b_scenarios.py (shared with the two-instance test in tests/e2e).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from e2b import Sandbox

from tests import e2b_scenarios as sdk
from tests.integration.api.conftest import Deployment


@pytest.fixture(scope="module")
def e2b(deployment: Deployment) -> sdk.E2B:
    return sdk.E2B(deployment.keys["alpha"], deployment.url)


@pytest.fixture
def sbx(e2b: sdk.E2B) -> Iterator[Sandbox]:
    sandbox = e2b.create(metadata={"suite": "e2b"}, envs={"SANDBOX_WIDE": "yes"})
    try:
        yield sandbox
    finally:
        sandbox.kill()


def test_commands(sbx: Sandbox) -> None:
    sdk.commands(sbx)


def test_background_commands_connect_list_kill_stdin(sbx: Sandbox) -> None:
    sdk.background(sbx)


def test_pty(sbx: Sandbox) -> None:
    sdk.pty(sbx)


def test_files(sbx: Sandbox) -> None:
    sdk.files(sbx)


def test_watch_dir(sbx: Sandbox) -> None:
    sdk.watch(sbx)


def test_lifecycle(e2b: sdk.E2B, sbx: Sandbox) -> None:
    sdk.lifecycle(e2b, sbx)
    assert sbx.kill() is True
    assert not sbx.is_running()
    assert Sandbox.kill(sbx.sandbox_id, **e2b.options()) is False


def test_list_by_metadata_with_paging(e2b: sdk.E2B) -> None:
    sdk.listing(e2b)


def test_idempotent_create(e2b: sdk.E2B) -> None:
    sdk.idempotent_create(e2b)


def test_async_sandbox(e2b: sdk.E2B) -> None:
    asyncio.run(sdk.async_scenario(e2b))
