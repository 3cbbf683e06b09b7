"""The long-running commands: `sandgate server` (one API instance), `sandgate worker`
(sandboxes on this host, dialing the control plane) and `sandgate up` (both, all in one).
Registered on the app by `cli/main.py`."""

from __future__ import annotations

import secrets
import socket
from pathlib import Path
from typing import Annotated

import typer

from sandgate import heap
from sandgate.cli import logs
from sandgate.cli.common import DbOpt, LogOpt, _prepare_db, _runner, _worker_runner
from sandgate.core.egress_policy import DEFAULT_DENY, DEFAULT_SANDBOX_SUBNET


def _refuse_second_sqlite_instance(db: str) -> None:
    """Fail fast, before touching the file; the server itself holds the lock while it runs."""
    from sandgate.errors import ConflictError
    from sandgate.store.instance_lock import hold_instance_lock, release_instance_lock

    try:
        release_instance_lock(hold_instance_lock(db))
    except ConflictError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(1) from None


def _read_secret(secret_file: Path | None) -> str:
    if secret_file is None:
        return secrets.token_urlsafe(32)
    return secret_file.read_text().strip()


def _check_tenant_share(share: float | None) -> float | None:
    if share is not None and not 0.0 < share <= 1.0:
        raise typer.BadParameter(f"a fraction 0 < F <= 1 of the capacity, not {share:g}")
    return share


def server(
    db: DbOpt,
    port: Annotated[int, typer.Option(envvar="SANDGATE_PORT")] = 8080,
    host: Annotated[str, typer.Option(envvar="SANDGATE_HOST")] = "127.0.0.1",
    node_url: Annotated[
        str | None,
        typer.Option(envvar="SANDGATE_NODE_URL", help="URL peers reach this instance at"),
    ] = None,
    secret_file: Annotated[
        Path | None,
        typer.Option(envvar="SANDGATE_SECRET_FILE", help="shared secret of all instances"),
    ] = None,
    start_timeout: Annotated[
        float,
        typer.Option(envvar="SANDGATE_START_TIMEOUT", help="seconds a sandbox may take to start"),
    ] = 30.0,
    max_exec_timeout: Annotated[
        float,
        typer.Option(
            envvar="SANDGATE_MAX_EXEC_TIMEOUT",
            min=1.0,
            help="the longest `timeout` an execute, exec job or code run may ask for (seconds); "
            "the default timeout (30 s) is lowered to it",
        ),
    ] = 3600.0,
    owner_ttl: Annotated[
        float,
        typer.Option(envvar="SANDGATE_OWNER_TTL", help="seconds a tunnel owner record is trusted"),
    ] = 90.0,
    recovery_after: Annotated[
        float,
        typer.Option(
            envvar="SANDGATE_RECOVERY_AFTER", help="seconds before a pending create is redelivered"
        ),
    ] = 45.0,
    recovery_interval: Annotated[
        float, typer.Option(envvar="SANDGATE_RECOVERY_INTERVAL", help="seconds between sweeps")
    ] = 5.0,
    orphan_grace: Annotated[
        float,
        typer.Option(
            envvar="SANDGATE_ORPHAN_GRACE",
            help="an instance silent for 3 recovery intervals plus this many seconds is dead: "
            "its unfinished exec jobs are failed (never re-run)",
        ),
    ] = 30.0,
    queue_limit: Annotated[
        int,
        typer.Option(
            envvar="SANDGATE_QUEUE_LIMIT",
            min=0,
            help="creates that may wait for worker capacity, all instances together "
            "(then 429); 0: no queue, 503 at once",
        ),
    ] = 500,
    queue_timeout: Annotated[
        float,
        typer.Option(
            envvar="SANDGATE_QUEUE_TIMEOUT", min=0.1, help="seconds a queued create waits"
        ),
    ] = 120.0,
    e2b_domain: Annotated[
        str | None,
        typer.Option(
            envvar="SANDGATE_E2B_DOMAIN",
            help="E2B's SDKs reach sandboxes at {port}-{sandboxID}.<domain> (behind a TLS "
            "proxy with a wildcard certificate): requests with such a Host go to the "
            "sandbox's envd, or for another port to the server listening on it in the "
            "sandbox (previews, get_host); users then set only E2B_DOMAIN (docs/e2b.md)",
        ),
    ] = None,
    tenant_share: Annotated[
        float | None,
        typer.Option(
            envvar="SANDGATE_TENANT_SHARE",
            callback=_check_tenant_share,
            help="fraction 0 < F <= 1 of the connected workers' capacity: while other "
            "tenants wait in the create queue, a tenant holding at least this many live "
            "sandboxes waits behind them (default: no share, tenants simply take turns)",
        ),
    ] = None,
    breaker_threshold: Annotated[
        int,
        typer.Option(
            envvar="SANDGATE_BREAKER_THRESHOLD",
            min=1,
            help="scheduling timeouts within --breaker-window that open the breaker",
        ),
    ] = 3,
    breaker_window: Annotated[
        float, typer.Option(envvar="SANDGATE_BREAKER_WINDOW", min=1.0, help="seconds")
    ] = 600.0,
    breaker_open: Annotated[
        float,
        typer.Option(
            envvar="SANDGATE_BREAKER_OPEN",
            min=0.0,
            help="seconds the breaker stays open before a trial",
        ),
    ] = 60.0,
    body_idle_timeout: Annotated[
        float,
        typer.Option(
            envvar="SANDGATE_BODY_IDLE_TIMEOUT",
            min=0.1,
            help="seconds a request body may send nothing before it is cut",
        ),
    ] = 60.0,
    exec_job_retention: Annotated[
        float,
        typer.Option(
            envvar="SANDGATE_EXEC_JOB_RETENTION",
            min=1.0,
            help="seconds a finished exec job (and its output) is kept; deleted at once when "
            "its sandbox is gone",
        ),
    ] = 24 * 3600.0,
    sandbox_retention: Annotated[
        float,
        typer.Option(
            envvar="SANDGATE_SANDBOX_RETENTION",
            min=1.0,
            help="seconds an ended (stopped, error, deleted) sandbox is kept and listed; then "
            "its record, create job and Idempotency-Key are deleted",
        ),
    ] = 24 * 3600.0,
    max_memory_mb: Annotated[
        int,
        typer.Option(envvar="SANDGATE_MAX_MEMORY_MB", min=16, help="cap per sandbox (MiB)"),
    ] = 4096,
    max_cpus: Annotated[
        float, typer.Option(envvar="SANDGATE_MAX_CPUS", min=0.01, help="cap per sandbox")
    ] = 4.0,
    max_pids: Annotated[
        int, typer.Option(envvar="SANDGATE_MAX_PIDS", min=16, help="cap per sandbox")
    ] = 1024,
    max_disk_mb: Annotated[
        int,
        typer.Option(
            envvar="SANDGATE_MAX_DISK_MB", min=64, help="disk quota cap per sandbox (MiB)"
        ),
    ] = 10240,
    metrics_token_file: Annotated[
        Path | None,
        typer.Option(
            envvar="SANDGATE_METRICS_TOKEN_FILE",
            help="file holding a token GET /metrics then asks for (Authorization: Bearer ...); "
            "default: /metrics is open",
        ),
    ] = None,
    max_workspace_mb: Annotated[
        int,
        typer.Option(
            envvar="SANDGATE_MAX_WORKSPACE_MB",
            min=16,
            help="quota cap per workspace (MiB; its files and history together)",
        ),
    ] = 10240,
    max_workspaces: Annotated[
        int,
        typer.Option(envvar="SANDGATE_MAX_WORKSPACES", min=0, help="workspaces per tenant"),
    ] = 100,
    default_memory_mb: Annotated[
        int,
        typer.Option(
            envvar="SANDGATE_DEFAULT_MEMORY_MB", min=16, help="a sandbox that asks for none"
        ),
    ] = 512,
    default_cpus: Annotated[
        float,
        typer.Option(envvar="SANDGATE_DEFAULT_CPUS", min=0.01, help="a sandbox that asks none"),
    ] = 1.0,
    default_pids: Annotated[
        int, typer.Option(envvar="SANDGATE_DEFAULT_PIDS", min=16, help="a sandbox that asks none")
    ] = 256,
    default_disk_mb: Annotated[
        int,
        typer.Option(
            envvar="SANDGATE_DEFAULT_DISK_MB", min=64, help="a sandbox that asks for none"
        ),
    ] = 1024,
    admission: Annotated[
        bool,
        typer.Option(
            "--admission/--no-admission",
            envvar="SANDGATE_ADMISSION",
            help="queue, breaker, rate limits and quotas (off only to measure their cost)",
        ),
    ] = True,
    log_level: LogOpt = "INFO",
) -> None:
    """Run one API instance."""
    from sandgate import faults
    from sandgate.cli.serve import make_server
    from sandgate.config import ServerSettings
    from sandgate.core.caps import ResourceCaps
    from sandgate.store.migrate import async_url

    logs.setup(log_level)
    try:
        active_faults = faults.from_environment()
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="SANDGATE_FAULTS") from None
    if not async_url(db).drivername.startswith("sqlite"):
        if not node_url:
            raise typer.BadParameter(
                "on PostgreSQL every instance needs --node-url, the URL its peers reach it at "
                "(the same string it records in tunnel_owners)",
                param_hint="--node-url",
            )
        if secret_file is None:
            raise typer.BadParameter(
                "on PostgreSQL all instances share one secret: give each the same --secret-file",
                param_hint="--secret-file",
            )
    resource_caps = ResourceCaps(
        max_memory_mb=max_memory_mb,
        max_cpus=max_cpus,
        max_pids=max_pids,
        max_disk_mb=max_disk_mb,
        default_memory_mb=default_memory_mb,
        default_cpus=default_cpus,
        default_pids=default_pids,
        default_disk_mb=default_disk_mb,
    )
    if problem := resource_caps.problem():
        raise typer.BadParameter(f"{problem}: lower the default or raise the cap")
    _refuse_second_sqlite_instance(db)
    with _runner() as runner:
        runner.run(_prepare_db(db))
    settings = ServerSettings(
        caps=resource_caps,
        max_workspace_mb=max_workspace_mb,
        max_workspaces=max_workspaces,
        metrics_token=metrics_token_file.read_text().strip() if metrics_token_file else "",
        default_workspace_mb=min(1024, max_workspace_mb),
        exec_job_retention=exec_job_retention,
        sandbox_retention=sandbox_retention,
        body_idle_timeout=body_idle_timeout,
        db_url=db,
        host=host,
        port=port,
        node_url=node_url,
        secret=_read_secret(secret_file),
        start_timeout=start_timeout,
        max_exec_timeout=max_exec_timeout,
        default_exec_timeout=min(
            ServerSettings.model_fields["default_exec_timeout"].default, max_exec_timeout
        ),
        owner_ttl=owner_ttl,
        recovery_after=recovery_after,
        recovery_interval=recovery_interval,
        orphan_grace=orphan_grace,
        admission=admission,
        queue_limit=queue_limit,
        queue_timeout=queue_timeout,
        tenant_share=tenant_share,
        e2b_domain=e2b_domain,
        breaker_threshold=breaker_threshold,
        breaker_window=breaker_window,
        breaker_open=breaker_open,
        faults=active_faults,
    )
    heap.keep_large_buffers()
    make_server(settings, own_signals=True).run()


def worker(
    server: Annotated[str, typer.Option(envvar="SANDGATE_SERVER", help="control plane URL")],
    token: Annotated[str, typer.Option(envvar="SANDGATE_TOKEN", help="worker token")],
    name: Annotated[str, typer.Option(envvar="SANDGATE_NAME")] = socket.gethostname(),
    capacity: Annotated[int, typer.Option(envvar="SANDGATE_CAPACITY", min=1)] = 16,
    runtime: Annotated[
        str, typer.Option(envvar="SANDGATE_RUNTIME", help="bwrap or process")
    ] = "bwrap",
    state_dir: Annotated[Path, typer.Option(envvar="SANDGATE_STATE_DIR")] = Path(
        "/var/lib/sandgate"
    ),
    network: Annotated[
        bool,
        typer.Option(
            "--network/--no-network",
            envvar="SANDGATE_NETWORK",
            help="give sandboxes that ask a network whose only way out is this worker's "
            "egress gate (needs root, iproute2, nftables); --no-network: none ever",
        ),
    ] = True,
    egress_permit: Annotated[
        list[str] | None,
        typer.Option(
            envvar="SANDGATE_EGRESS_PERMIT",
            help="CIDR sandboxes may reach although it is in the denied ranges (e.g. an "
            "internal package mirror); repeat for several",
        ),
    ] = None,
    egress_deny: Annotated[
        list[str] | None,
        typer.Option(
            envvar="SANDGATE_EGRESS_DENY",
            help="CIDR no sandbox may reach, whatever its policy; repeat for several "
            "(default: loopback, private, shared, link-local and reserved ranges; giving "
            "any replaces the default list)",
        ),
    ] = None,
    egress_resolver: Annotated[
        str,
        typer.Option(
            envvar="SANDGATE_EGRESS_RESOLVER",
            help="HOST[:PORT] of the DNS server the gate resolves names with (default: the "
            "host's /etc/resolv.conf)",
        ),
    ] = "",
    sandbox_subnet: Annotated[
        str,
        typer.Option(
            envvar="SANDGATE_SANDBOX_SUBNET",
            help="IPv4 range the sandboxes' links are numbered from (a /30 each)",
        ),
    ] = DEFAULT_SANDBOX_SUBNET,
    workspace_root: Annotated[
        Path | None,
        typer.Option(
            envvar="SANDGATE_WORKSPACE_ROOT",
            help="directory holding the deployment's persistent workspaces, shared by all "
            "its workers (a shared file system in a fleet; see docs/decisions/"
            "0010-workspaces.md); default: STATE_DIR/workspaces",
        ),
    ] = None,
    fd_share: Annotated[
        float,
        typer.Option(
            envvar="SANDGATE_FD_SHARE",
            min=0.001,
            max=1.0,
            help="share of the host's fs.file-max one sandbox may hold (sets RLIMIT_NOFILE)",
        ),
    ] = 0.1,
    memory_overcommit: Annotated[
        float,
        typer.Option(
            envvar="SANDGATE_MEMORY_OVERCOMMIT",
            min=0.01,
            max=100.0,
            help="the sandboxes' memory limits together may be this many times the host's "
            "memory (less a 10% reserve)",
        ),
    ] = 1.0,
    cgroup_favordynmods: Annotated[
        bool,
        typer.Option(
            "--cgroup-favordynmods/--no-cgroup-favordynmods",
            envvar="SANDGATE_CGROUP_FAVORDYNMODS",
            help="turn on the host's cgroup2 option favordynmods, so that moving a new "
            "sandbox into its cgroups does not wait ~10 ms for the kernel (host-wide; see "
            "docs/architecture.md)",
        ),
    ] = True,
    disk_overcommit: Annotated[
        float,
        typer.Option(
            envvar="SANDGATE_DISK_OVERCOMMIT",
            min=0.01,
            max=100.0,
            help="the sandboxes' disk quotas together may be this many times the space free "
            "for the state dir (less 5%)",
        ),
    ] = 1.0,
    pool: Annotated[
        list[str] | None,
        typer.Option(
            envvar="SANDGATE_POOL",
            help="TEMPLATE=N: keep N sandboxes of TEMPLATE (default, code-interpreter) "
            "started, handed out on create in milliseconds; repeat for several. They count "
            "in --capacity",
        ),
    ] = None,
    log_level: LogOpt = "INFO",
) -> None:
    """Run a worker: dial the control plane and host sandboxes."""
    from sandgate import faults
    from sandgate.config import WorkerSettings
    from sandgate.core.egress_policy import OperatorBounds, PolicyError
    from sandgate.worker.main import run_worker

    try:
        OperatorBounds.of(egress_deny or DEFAULT_DENY, egress_permit or ())
    except PolicyError as exc:
        raise typer.BadParameter(exc.message, param_hint="--egress-permit/--egress-deny") from None

    logs.setup(log_level)
    try:
        active_faults = faults.from_environment()
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="SANDGATE_FAULTS") from None
    if runtime not in ("bwrap", "process"):
        raise typer.BadParameter("use bwrap or process", param_hint="--runtime")
    from sandgate.worker import pool as pools

    try:
        warm = pools.parse_pools(pool or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--pool") from None
    if pools.reserved(warm) >= capacity:
        raise typer.BadParameter(
            f"the pools ({pools.reserved(warm)}) must leave room in --capacity ({capacity})",
            param_hint="--pool",
        )
    settings = WorkerSettings(
        server_url=server,
        token=token,
        name=name,
        capacity=capacity,
        runtime=runtime,
        state_dir=state_dir,
        network=network,
        egress_permit=tuple(egress_permit or ()),
        egress_deny=tuple(egress_deny) if egress_deny else DEFAULT_DENY,
        egress_resolver=egress_resolver,
        sandbox_subnet=sandbox_subnet,
        workspace_root=workspace_root,
        fd_share=fd_share,
        memory_overcommit=memory_overcommit,
        disk_overcommit=disk_overcommit,
        cgroup_favordynmods=cgroup_favordynmods,
        pools=warm,
        faults=active_faults,
    )
    heap.keep_large_buffers()
    with _worker_runner() as runner:
        runner.run(run_worker(settings))


def up(
    port: Annotated[int, typer.Option(envvar="SANDGATE_PORT")] = 8080,
    host: Annotated[str, typer.Option(envvar="SANDGATE_HOST")] = "127.0.0.1",
    data_dir: Annotated[
        Path,
        typer.Option(
            envvar="SANDGATE_DATA_DIR",
            help="database, API key, worker token and URL (the CLI and SDK read the last two "
            "from ./.sandgate)",
        ),
    ] = Path(".sandgate"),
    runtime: Annotated[
        str, typer.Option(envvar="SANDGATE_RUNTIME", help="bwrap or process")
    ] = "bwrap",
    capacity: Annotated[int, typer.Option(envvar="SANDGATE_CAPACITY", min=1)] = 16,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            envvar="SANDGATE_STATE_DIR",
            help="the worker's sandboxes [default: DATA_DIR/state, or /var/lib/sandgate-up/<id> "
            "when sandbox uids cannot traverse to the data dir]",
            show_default=False,
        ),
    ] = None,
    log_level: LogOpt = "INFO",
) -> None:
    """All in one: an API instance on SQLite in the data dir plus one local worker, restarted
    if it dies and stopped with `up` (even on SIGKILL)."""
    from sandgate.cli.up import run_up

    logs.setup(log_level)
    if runtime not in ("bwrap", "process"):
        raise typer.BadParameter("use bwrap or process", param_hint="--runtime")
    data_dir.mkdir(parents=True, exist_ok=True)
    _refuse_second_sqlite_instance(f"sqlite:///{(data_dir / 'sandgate.db').resolve()}")
    code = run_up(
        port=port,
        host=host,
        data_dir=data_dir,
        runtime=runtime,
        capacity=capacity,
        state_dir=state_dir,
    )
    raise typer.Exit(code)
