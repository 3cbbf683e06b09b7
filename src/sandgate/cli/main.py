"""The `sandgate` command. Every flag also reads SANDGATE_<FLAG> from the environment."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Annotated

import typer

from sandgate.cli import logs
from sandgate.cli.common import DbOpt, LogOpt, _prepare_db

app = typer.Typer(
    help="sandgate: a control plane for code-execution sandboxes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
keys_app = typer.Typer(help="Create API keys and worker tokens.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
tenants_app = typer.Typer(help="Per-tenant limits: rate and quotas.", no_args_is_help=True)
app.add_typer(tenants_app, name="tenants")


@app.command()
def migrate(db: DbOpt, log_level: LogOpt = "INFO") -> None:
    """Apply the schema migrations (they only add) to a database."""
    from sandgate.store import migrate as m

    logs.setup(log_level)
    asyncio.run(m.upgrade(db))
    typer.echo(f"database at schema {m.head_revision()}")


@keys_app.command("create")
def keys_create(
    db: DbOpt,
    tenant: Annotated[
        str | None, typer.Option(envvar="SANDGATE_TENANT", help="tenant name")
    ] = None,
    worker: Annotated[
        bool, typer.Option("--worker", envvar="SANDGATE_WORKER", help="a worker token")
    ] = False,
    admin: Annotated[
        bool,
        typer.Option(
            "--admin",
            envvar="SANDGATE_ADMIN",
            help="an admin key: reads the fleet-wide views, no tenant's routes",
        ),
    ] = False,
    name: Annotated[
        str,
        typer.Option(
            "--name", envvar="SANDGATE_NAME", help="worker name the token is for (else its first)"
        ),
    ] = "",
    log_level: LogOpt = "WARNING",
) -> None:
    """Print a new tenant API key (--tenant NAME), worker token (--worker [--name N]) or admin
    key (--admin [--name LABEL])."""
    logs.setup(log_level)
    if (tenant is not None) + worker + admin != 1:
        raise typer.BadParameter("give exactly one of --tenant NAME, --worker or --admin")
    key = asyncio.run(_create_key(db, tenant, name, admin=admin))
    typer.echo(key)


async def _create_key(
    db: str, tenant: str | None, worker_name: str = "", *, admin: bool = False
) -> str:
    from sandgate.core.clock import utcnow
    from sandgate.core.credentials import key_hash, new_key
    from sandgate.store.base import ApiKey
    from sandgate.store.sql import open_store

    await _prepare_db(db)
    store = await open_store(db)
    try:
        if tenant is not None:
            record = await store.ensure_tenant(tenant)
            key = new_key("tenant")
            await store.add_api_key(
                ApiKey(key_hash(key), "tenant", record.id, utcnow(), label=tenant)
            )
        elif admin:
            key = new_key("admin")
            await store.add_api_key(
                ApiKey(key_hash(key), "admin", None, utcnow(), label=worker_name)
            )
        else:
            key = new_key("worker")
            await store.add_api_key(
                ApiKey(key_hash(key), "worker", None, utcnow(), label=worker_name)
            )
        return key
    finally:
        await store.aclose()


@tenants_app.command("limit")
def tenants_limit(
    db: DbOpt,
    tenant: Annotated[str, typer.Argument(help="tenant name (as given to keys create)")],
    rps: Annotated[
        float | None, typer.Option(help="requests per second, all instances together")
    ] = None,
    burst: Annotated[
        int | None, typer.Option(min=1, help="requests allowed at once (default: rps)")
    ] = None,
    max_sandboxes: Annotated[int | None, typer.Option(min=0, help="live sandboxes")] = None,
    max_exec_jobs: Annotated[
        int | None, typer.Option(min=0, help="queued + running exec jobs")
    ] = None,
    log_level: LogOpt = "WARNING",
) -> None:
    """Set a tenant's limits (each one left out is removed); running instances apply them
    within 5 s."""
    logs.setup(log_level)
    if rps is not None and rps <= 0:
        raise typer.BadParameter("give a positive rate, or leave --rps out", param_hint="--rps")
    if burst is not None and rps is None:
        raise typer.BadParameter("--burst needs --rps", param_hint="--burst")
    shown = asyncio.run(_set_limits(db, tenant, rps, burst, max_sandboxes, max_exec_jobs))
    typer.echo(shown)


async def _set_limits(
    db: str,
    tenant: str,
    rps: float | None,
    burst: int | None,
    max_sandboxes: int | None,
    max_exec_jobs: int | None,
) -> str:
    from sandgate.core.clock import utcnow
    from sandgate.store.base import TenantLimits
    from sandgate.store.sql import open_store

    await _prepare_db(db)
    store = await open_store(db)
    try:
        record = await store.ensure_tenant(tenant)
        limits = TenantLimits(record.id, rps, burst, max_sandboxes, max_exec_jobs)
        await store.set_tenant_limits(limits, utcnow())
    finally:
        await store.aclose()
    parts = [
        f"rps={rps:g} burst={limits.bucket}" if rps is not None else "rps=unlimited",
        f"max_sandboxes={max_sandboxes if max_sandboxes is not None else 'unlimited'}",
        f"max_exec_jobs={max_exec_jobs if max_exec_jobs is not None else 'unlimited'}",
    ]
    return f"tenant {tenant}: " + " ".join(parts)


@app.command("state-table")
def state_table() -> None:
    """Print the table of every piece of in-process state (Markdown)."""
    from sandgate.cli.state_table import state_doc

    sys.stdout.write(state_doc())


def _add_run_commands() -> None:
    """The long-running commands (`cli/run.py`)."""
    from sandgate.cli import run

    app.command()(run.server)
    app.command()(run.worker)
    app.command()(run.up)


_add_run_commands()


def _add_client_commands() -> None:
    """The commands that talk to a running API through the SDK (`sandgate.client`)."""
    from sandgate.cli import cp, exec_jobs, run_code, sandbox, shell, templates, workspaces

    app.add_typer(sandbox.app, name="sandbox")
    app.add_typer(exec_jobs.app, name="exec-job")
    app.add_typer(templates.app, name="templates")
    app.add_typer(workspaces.app, name="workspace")
    app.command("cp")(cp.cp)
    app.command("shell")(shell.shell)
    app.command("run-code")(run_code.run_code)


_add_client_commands()


def main() -> None:
    os.umask(0o022)
    app()
