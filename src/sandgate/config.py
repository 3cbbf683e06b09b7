"""Settings, loaded once by the CLI and passed down; tests construct them directly."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from sandgate.core.caps import ResourceCaps
from sandgate.core.egress_policy import DEFAULT_DENY, DEFAULT_SANDBOX_SUBNET


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ServerSettings(_Frozen):
    db_url: str
    host: str = "127.0.0.1"
    port: int = 8080
    node_url: str | None = None  # reachable by peers; what this instance writes in tunnel_owners
    secret: str = ""  # shared by every instance (tokens, internal signatures)
    # E2B-compatible surface (api/e2b): sandboxes answer at {port}-{id}.<e2b_domain> too
    e2b_domain: str | None = None
    # sandboxes
    # what `template` may name; the worker starts each (worker/pool.py TEMPLATES)
    templates: tuple[str, ...] = ("default", "base", "code-interpreter")
    default_timeout: float = 300.0  # seconds of life when a create names none
    max_timeout: float = 24 * 3600.0
    start_timeout: float = 30.0  # provision must answer within this
    # what one sandbox may hold: the operator's caps and the defaults (sandgate.core.caps)
    caps: ResourceCaps = ResourceCaps()
    reaper_interval: float = 1.0
    # execute
    default_exec_timeout: float = 30.0
    # finished exec jobs (with their output) are deleted this long after they end, and at
    # once (the next recovery tick) when their sandbox is gone
    exec_job_retention: float = 24 * 3600.0
    # ended sandboxes (stopped, error, deleted) are listed until this long after they ended;
    # then their rows, create jobs and idempotency records are deleted (sandgate.control.recovery)
    sandbox_retention: float = 24 * 3600.0
    max_exec_timeout: float = 3600.0
    # bodies
    max_json_bytes: int = 2 << 20  # JSON request bodies (code included)
    body_idle_timeout: float = 60.0  # a request body silent this long is cut
    max_upload_bytes: int = 10 << 30  # one file upload
    max_template_bytes: int = 8 << 30  # one template archive (POST /api/v1/templates)
    max_templates: int = 100  # templates one tenant (or the public set) may hold
    max_template_storage_bytes: int = 100 << 30  # their layers' bytes, per tenant
    # persistent workspaces (control/workspaces.py): per tenant, and each one's quota (MiB)
    max_workspaces: int = 100
    default_workspace_mb: int = 1024
    max_workspace_mb: int = 10240
    file_chunk_bytes: int = 1 << 20  # one tunnel frame of file data
    # several instances
    owner_ttl: float = 90.0  # a tunnel_owners row older than this is not trusted
    recovery_after: float = 45.0  # a pending create job untouched this long is redelivered
    recovery_interval: float = 5.0
    # an instance whose heartbeat (renewed every recovery tick) is older than
    # orphan_intervals * recovery_interval + orphan_grace is dead: its unfinished exec jobs
    # are failed by any other instance's recovery, never re-run
    orphan_intervals: float = 3.0
    orphan_grace: float = 30.0
    max_delivery_attempts: int = 5  # then the job fails and its sandbox is marked error
    faults: frozenset[str] = frozenset()  # test fault points (sandgate.faults)
    # admission, counted in the store for the whole deployment (sandgate.control.admission)
    admission: bool = True  # off only to measure what it costs (bench/)
    # execute and file transfers answered by api/hot.py, outside FastAPI's routing; off:
    # through FastAPI like every other route (the two answer alike: tests compare them)
    hot_paths: bool = True
    queue_limit: int = Field(default=500, ge=0)  # creates waiting for worker capacity
    queue_timeout: float = 120.0  # a queued create gives up after this (503 queue_timeout)
    breaker_threshold: int = Field(default=3, ge=1)  # scheduling timeouts within the window...
    breaker_window: float = 600.0
    breaker_open: float = 60.0  # ...open the breaker this long, then one trial create
    # while others wait, a tenant holding at least this fraction of the connected workers'
    # capacity waits behind them (sandgate.core.fair_queue); None: no share, tenants in turn
    tenant_share: float | None = Field(default=None, gt=0.0, le=1.0)
    # GET /metrics asks for `Authorization: Bearer <metrics_token>` when set ("": open)
    metrics_token: str = ""
    # auth cache: a revoked key stops working on every instance within this
    auth_cache_ttl: float = 5.0


class WorkerSettings(_Frozen):
    server_url: str  # http(s)://host:port of any instance; the tunnel is <url>/tunnel
    token: str
    name: str
    capacity: int = Field(default=16, ge=1)
    runtime: str = "bwrap"  # "bwrap" | "process"
    state_dir: Path = Path("/var/lib/sandgate")
    # sandboxes' network through the egress gate (worker/egress.py): off with --no-network;
    # CIDRs no sandbox reaches (default: private, loopback, link-local, reserved ranges) and
    # the ones carved out of them; the gate's upstream DNS ("" = the host's resolv.conf)
    network: bool = True
    egress_deny: tuple[str, ...] = DEFAULT_DENY
    egress_permit: tuple[str, ...] = ()
    egress_resolver: str = ""
    sandbox_subnet: str = DEFAULT_SANDBOX_SUBNET
    # the deployment's persistent workspaces, shared by its workers (worker/workspaces.py);
    # None: <state_dir>/workspaces (shared by the workers given the same --state-dir)
    workspace_root: Path | None = None
    # the share of the host's fs.file-max one sandbox at its limits may hold (worker.fds)
    fd_share: float = Field(default=0.1, gt=0, le=1)
    # the sandboxes' memory limits (disk quotas) together may be this many times what the
    # host has (worker.budget)
    memory_overcommit: float = Field(default=1.0, gt=0, le=100)
    disk_overcommit: float = Field(default=1.0, gt=0, le=100)
    # whole files on a sandbox's own disk written and read by the worker itself, not through
    # the agent's pipes (worker/disk_files.py); off: every file call goes to the agent
    direct_files: bool = True
    # the host's cgroup2 option favordynmods turned on at start (worker/dynmods.py): moves
    # into a sandbox's cgroups do not wait for an RCU grace period (host-wide)
    cgroup_favordynmods: bool = True
    heartbeat_interval: float = 10.0
    reconnect_min: float = 0.2
    reconnect_max: float = 5.0
    # template -> warm sandboxes kept started (worker/pool.py); they count in `capacity`
    pools: dict[str, int] = Field(default_factory=dict)
    faults: frozenset[str] = frozenset()  # test fault points (sandgate.faults)
