"""E2B's Python SDK through an instance that does not hold the worker's tunnel.

Worker w1 dials instance A; the SDK talks only to instance B, so every envd request (unary
calls, output streams, uploads and downloads) is forwarded by B to A, the tunnel owner, as
the native toolbox's are. The scenarios are tests/e2b_scenarios.py, unchanged.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid
from collections.abc import Iterator

import pytest
from e2b import Sandbox

from tests import e2b_scenarios as sdk
from tests.e2e.conftest import Cluster

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture
def via_b(clean: Cluster) -> sdk.E2B:
    return sdk.E2B(clean.key, clean.instances["B"].url)


@pytest.fixture
def sbx(via_b: sdk.E2B) -> Iterator[Sandbox]:
    sandbox = via_b.create(envs={"SANDBOX_WIDE": "yes"}, timeout=600)
    try:
        yield sandbox
    finally:
        sandbox.kill()


def test_the_sdk_scenario_through_the_other_instance(via_b: sdk.E2B, sbx: Sandbox) -> None:
    sdk.commands(sbx)
    sdk.background(sbx)
    sdk.pty(sbx)
    sdk.files(sbx)
    sdk.watch(sbx)
    sdk.lifecycle(via_b, sbx)
    sdk.listing(via_b)


def test_async_sdk_through_the_other_instance(via_b: sdk.E2B) -> None:
    asyncio.run(sdk.async_scenario(via_b))


def test_a_retried_create_on_the_other_instance_is_the_same_sandbox(clean: Cluster) -> None:
    key = "e2b-multi-" + uuid.uuid4().hex
    first = sdk.E2B(clean.key, clean.instances["A"].url).create(idempotency_key=key)
    again = sdk.E2B(clean.key, clean.instances["B"].url).create(idempotency_key=key)
    assert again.sandbox_id == first.sandbox_id
    first.kill()


def test_100_mb_up_and_down_through_the_other_instance(sbx: Sandbox) -> None:
    blob = os.urandom(100 << 20)
    sbx.files.write("/home/user/big.bin", blob)
    listed = {e.name: e.size for e in sbx.files.list("/home/user")}
    assert listed["big.bin"] == len(blob)
    digest = sbx.commands.run("sha256sum big.bin").stdout.split()[0]
    assert digest == hashlib.sha256(blob).hexdigest()
    back = sbx.files.read("/home/user/big.bin", format="bytes")
    assert len(back) == len(blob) and back == blob
