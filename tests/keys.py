"""API keys for a test deployment, made in-process by the CLI's own code (`sandgate keys
create` runs the same `_create_key`): a subprocess per key cost a Python start each, about a
second, for every deployment the suite starts. The CLI itself is tested in
tests/integration/client/test_cli.py."""

from __future__ import annotations

import asyncio

from sandgate.cli.main import _create_key


def create_keys(
    db: str, tenants: tuple[str, ...], *, worker_name: str = ""
) -> tuple[dict[str, str], str, str]:
    """(tenant name -> key, a worker token, an admin key) in the database `db`."""

    async def make() -> tuple[dict[str, str], str, str]:
        keys = {tenant: await _create_key(db, tenant) for tenant in tenants}
        token = await _create_key(db, None, worker_name)
        admin = await _create_key(db, None, admin=True)
        return keys, token, admin

    return asyncio.run(make())
