"""`sandgate sandbox ...`: create, list, inspect, extend, remove, run in, follow and preview
sandboxes, and talk to their background processes, on the SDK.

Every client command takes `--url` (`$SANDGATE_URL`) and `--api-key` (`$SANDGATE_API_KEY`),
defaulting as the SDK does: the local `sandgate up` whose `./.sandgate/url` and
`./.sandgate/api-key` it finds. Errors print one line, `error: <message>`, and exit non-zero;
never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from sandgate.client import SandboxInfo, Sandgate

app = typer.Typer(
    help="Create, inspect, list, remove and run commands in sandboxes.", no_args_is_help=True
)
AllowOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--allow-out", help="domain (pypi.org, *.github.com), address or CIDR it may reach; repeat"
    ),
]
DenyOpt = Annotated[
    list[str] | None,
    typer.Option("--deny-out", help="domain, address or CIDR it may not reach; repeatable"),
]

UrlOpt = Annotated[
    str | None,
    typer.Option(
        "--url",
        envvar="SANDGATE_URL",
        help="API URL (default: the contents of ./.sandgate/url, else http://127.0.0.1:8080)",
        show_default=False,
    ),
]
KeyOpt = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="SANDGATE_API_KEY",
        help="API key (default: the contents of ./.sandgate/api-key)",
        show_default=False,
    ),
]
NameArg = Annotated[str, typer.Argument(help="sandbox name", show_default=False)]

HIDDEN_METADATA = ("idem", "idem_owner")
CLIENT_FAILED = 255  # as ssh: the exit code when the client itself failed in exec and shell
STDIN_PIECE_BYTES = 1 << 20  # `stdin -` sends what it read, up to this much at a time


def connect(url: str | None, api_key: str | None) -> Sandgate:
    from sandgate.client import Sandgate

    return Sandgate(url, api_key)


@contextlib.contextmanager
def reported_errors(exit_code: int = 1) -> Iterator[None]:
    """Turn the errors a user can act on into one `error:` line and an exit code."""
    from sandgate.client import SandgateError

    try:
        yield
    except SandgateError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(exit_code) from None
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        typer.echo(f"error: {exc.strerror or exc}{where}", err=True)
        raise typer.Exit(exit_code) from None
    except KeyboardInterrupt:
        typer.echo("", err=True)
        raise typer.Exit(130) from None


def misuse(message: str) -> typer.Exit:
    """A command called wrongly: print one `error:` line saying what to do; raise what this
    returns (exit 2, as usage errors do)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def pairs(values: list[str] | None, what: str) -> dict[str, str]:
    """`["k=v", ...]` from repeated options, as a dict."""
    out: dict[str, str] = {}
    for item in values or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{item!r} is not KEY=VALUE", param_hint=what)
        out[key] = value
    return out


def exit_status(code: int) -> int:
    """A remote exit code as a local one (a negative code is a signal, as the shell shows it)."""
    return code if 0 <= code <= 255 else (128 + -code if code < 0 else code & 0xFF)


@app.command("create")
def create(
    url: UrlOpt = None,
    api_key: KeyOpt = None,
    template: Annotated[str | None, typer.Option(help="template name")] = None,
    timeout: Annotated[
        float | None, typer.Option(help="seconds it lives (server default 300)")
    ] = None,
    metadata: Annotated[
        list[str] | None, typer.Option("--metadata", "-m", help="KEY=VALUE, repeatable")
    ] = None,
    env: Annotated[
        list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE, repeatable")
    ] = None,
    network: Annotated[bool, typer.Option("--network", help="give it the public internet")] = False,
    allow_out: AllowOpt = None,
    deny_out: DenyOpt = None,
    idempotency_key: Annotated[
        str | None, typer.Option(help="the same key never makes a second sandbox")
    ] = None,
    workspace: Annotated[
        list[str] | None,
        typer.Option(
            "--workspace",
            "-w",
            help="NAME[:PATH]: mount a persistent workspace (at /workspace unless PATH); repeat",
        ),
    ] = None,
) -> None:
    """Create a sandbox and print its name."""
    policy = network_policy(network, allow_out, deny_out)
    mounts = workspace_mounts(workspace)
    with reported_errors(), connect(url, api_key) as client:
        box = client.sandboxes.create(
            template=template,
            timeout=timeout,
            metadata=pairs(metadata, "--metadata"),
            env=pairs(env, "--env"),
            network=policy or None,
            idempotency_key=idempotency_key,
            workspaces=mounts or None,
        )
        typer.echo(box.name)


def workspace_mounts(values: list[str] | None) -> list[str | tuple[str, str]]:
    """`--workspace NAME[:PATH]` options as the SDK's mounts: a name alone goes at /workspace."""
    mounts: list[str | tuple[str, str]] = []
    for item in values or ():
        name, sep, path = item.partition(":")
        if not name or (sep and not path):
            raise typer.BadParameter(f"{item!r} is not NAME or NAME:PATH", param_hint="--workspace")
        mounts.append((name, path) if sep else name)
    return mounts


def network_policy(
    on: bool, allow_out: list[str] | None, deny_out: list[str] | None
) -> bool | dict[str, list[str]]:
    """--network / --allow-out / --deny-out as a policy: rules if any are given."""
    if allow_out or deny_out:
        return {"allow_out": list(allow_out or []), "deny_out": list(deny_out or [])}
    return on


@app.command("network")
def network(
    name: NameArg,
    on: Annotated[
        bool | None,
        typer.Option("--on/--off", help="give it the public internet / take its network away"),
    ] = None,
    allow_out: AllowOpt = None,
    deny_out: DenyOpt = None,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Show a sandbox's network policy and what its egress gate refused; with --on, --off,
    --allow-out or --deny-out, change it first (new connections follow at once)."""
    change = on is not None or allow_out or deny_out
    with reported_errors(), connect(url, api_key) as client:
        if change:
            policy = network_policy(bool(on), allow_out, deny_out)
            state = client.sandboxes.set_network(name, policy)
        else:
            state = client.sandboxes.network_state(name)
    typer.echo(f"network: {_network_text(state.network)}")
    typer.echo(
        f"connections: {state.allowed} let through ({state.open} open), {state.refused} "
        f"refused; names refused: {state.dns_refused}"
    )
    for refusal in state.recent_refusals:
        when = datetime.fromtimestamp(float(refusal["at"])).strftime("%H:%M:%S")
        typer.echo(f"  {when}  {refusal['target']}: {refusal['reason']}")


def _network_text(rules: bool | dict[str, list[str]] | None) -> str:
    if isinstance(rules, dict):
        return "; ".join(f"{k}: {', '.join(v) or '-'}" for k, v in rules.items())
    return "the public internet" if rules else "off (loopback only)"


def _when(value: datetime | None) -> str:
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def _row(box: SandboxInfo) -> dict[str, Any]:
    """A sandbox as the API describes it (the same fields and JSON types)."""
    return {
        "name": box.name,
        "state": box.state,
        "template": box.template,
        "metadata": box.metadata,
        "worker": box.worker,
        "network": box.network,
        "network_policy": box.network_policy,
        "resources": box.resources,
        "workspaces": [{"name": m.name, "path": m.path} for m in box.workspaces],
        "timeout": box.timeout,
        "created_at": _iso(box.created_at),
        "started_at": _iso(box.started_at),
        "expires_at": _iso(box.expires_at),
        "error": box.error,
    }


def _expiry(box: SandboxInfo) -> str:
    """When it expires, and how far off that is while it runs."""
    if box.expires_at is None:
        return "-"
    left = (box.expires_at - datetime.now(UTC)).total_seconds()
    if box.state != "running" or left <= 0:
        return _when(box.expires_at)
    return f"{_when(box.expires_at)} (in {_span(left)})"


def _span(seconds: float) -> str:
    """`1h 02m`, `4m 05s`, `12s`."""
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def _number(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@app.command("info")
def info(
    name: NameArg,
    as_json: Annotated[bool, typer.Option("--json", help="print the API's fields as JSON")] = False,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Show a sandbox: state, template, worker, resources, network, workspaces, expiry, metadata."""
    with reported_errors(), connect(url, api_key) as client:
        box = client.sandboxes.get(name)
    if as_json:
        typer.echo(json.dumps(_row(box), indent=2))
        return
    resources = " ".join(f"{k}={_number(v)}" for k, v in box.resources.items())
    mounts = ", ".join(f"{m.name} at {m.path}" for m in box.workspaces)
    meta = ", ".join(f"{k}={v}" for k, v in box.metadata.items() if k not in HIDDEN_METADATA)
    lines = {
        "name": box.name,
        "state": box.state,
        "template": box.template,
        "worker": box.worker or "-",
        "resources": resources or "-",
        "network": _network_text(box.network_policy or box.network),
        "workspaces": mounts or "-",
        "timeout": f"{box.timeout:g} s from start",
        "created": _when(box.created_at),
        "started": _when(box.started_at),
        "expires": _expiry(box),
        "metadata": meta or "-",
    }
    if box.error:
        lines["error"] = box.error
    for label, value in lines.items():
        typer.echo(f"{label + ':':<12}{value}")


@app.command("extend")
def extend(
    name: NameArg,
    timeout: Annotated[
        float,
        typer.Option("--timeout", "-t", help="seconds it lives from now", show_default=False),
    ],
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Let a running sandbox live TIMEOUT seconds from now; print when it expires."""
    with reported_errors(), connect(url, api_key) as client:
        box = client.sandboxes.get(name).set_timeout(timeout)
    typer.echo(f"{box.name} expires {_expiry(box)}")


@app.command("ls")
def ls(
    url: UrlOpt = None,
    api_key: KeyOpt = None,
    state: Annotated[
        str | None, typer.Option(help="only these states (comma-separated), e.g. running")
    ] = None,
    metadata: Annotated[
        list[str] | None, typer.Option("--metadata", "-m", help="KEY=VALUE filter, repeatable")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="names only")] = False,
) -> None:
    """List sandboxes (all pages) as a table."""
    from rich.console import Console
    from rich.table import Table

    with reported_errors(), connect(url, api_key) as client:
        boxes = client.sandboxes.list(state=state, metadata=pairs(metadata, "--metadata"))
    if quiet:
        for box in boxes:
            typer.echo(box.name)
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("NAME", "STATE", "TEMPLATE", "WORKER", "CREATED", "EXPIRES", "METADATA"):
        table.add_column(column, no_wrap=column != "METADATA")
    for box in boxes:
        meta = ",".join(f"{k}={v}" for k, v in box.metadata.items() if k not in HIDDEN_METADATA)
        table.add_row(
            box.name,
            box.state,
            box.template,
            box.worker or "-",
            _when(box.created_at),
            _when(box.expires_at),
            meta,
        )
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)


@app.command("rm")
def rm(
    names: Annotated[list[str], typer.Argument(help="sandbox names", show_default=False)],
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Delete sandboxes; their processes and files are gone."""
    from sandgate.client import SandgateError

    failed = 0
    with reported_errors(), connect(url, api_key) as client:
        for name in names:
            try:
                client.sandboxes.delete(name)
            except SandgateError as exc:
                typer.echo(f"error: {exc.message}", err=True)
                failed += 1
                continue
            typer.echo(name)
    if failed:
        raise typer.Exit(1)


@app.command("preview")
def preview(
    name: NameArg,
    port: Annotated[int, typer.Argument(help="the port a server listens on inside the sandbox")],
    ttl: Annotated[
        float | None,
        typer.Option(help="seconds the URL works (server default 3600, at most 86400)"),
    ] = None,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Print a URL to PORT of the sandbox that works without an API key (open it in a
    browser); with a preview domain, the host form's URL on a second line."""
    with reported_errors(), connect(url, api_key) as client:
        made = client.sandboxes.preview(name, port, ttl=ttl)
    typer.echo(made.url)
    if made.host_url:
        typer.echo(made.host_url)


@app.command("exec")
def exec_(
    name: NameArg,
    command: Annotated[
        list[str] | None,
        typer.Argument(help="command after --; one argument runs as bash code", show_default=False),
    ] = None,
    code: Annotated[
        str | None, typer.Option("--code", "-c", help="code to run ('-' reads stdin)")
    ] = None,
    language: Annotated[str, typer.Option("--language", "-l", help="bash, sh or python")] = "bash",
    timeout: Annotated[
        float | None, typer.Option(help="seconds before it is killed (server default 30)")
    ] = None,
    env: Annotated[
        list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE, repeatable")
    ] = None,
    cwd: Annotated[str | None, typer.Option(help="working directory")] = None,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Run a command (or --code) in a sandbox; print its output, exit with its exit code."""
    if code is None and not command:
        raise misuse(
            f"no command to run in {name}: give it after the name "
            f"(sandgate sandbox exec {name} -- ls -la) or as --code 'CODE' (--code - reads stdin)"
        )
    if code is not None and command:
        raise misuse("give the command after -- or as --code, not both")
    if code == "-":
        code = sys.stdin.read()
    program = code if code is not None else _program(command or [])
    with reported_errors(CLIENT_FAILED), connect(url, api_key) as client:
        box = client.sandboxes.get(name)
        result = box.run(
            program, language=language, timeout=timeout, env=pairs(env, "--env"), cwd=cwd
        )
    sys.stdout.write(result.stdout)
    sys.stdout.flush()
    sys.stderr.write(result.stderr)
    for stream, cut in (("stdout", result.stdout_truncated), ("stderr", result.stderr_truncated)):
        if cut:
            sys.stderr.write(f"sandgate: {stream} was cut at 1 MiB\n")
    if result.timed_out:
        sys.stderr.write("sandgate: the command timed out and was killed\n")
    if result.oom_killed:
        sys.stderr.write(
            "sandgate: the command was killed at the sandbox's memory limit; create the sandbox"
            " with a larger resources.memory_mb, or use less\n"
        )
    sys.stderr.flush()
    raise typer.Exit(exit_status(result.exit_code))


def _program(command: list[str]) -> str:
    return command[0] if len(command) == 1 else shlex.join(command)


@app.command("start")
def start(
    name: NameArg,
    command: Annotated[
        list[str],
        typer.Argument(help="command after --; one argument runs as bash code", show_default=False),
    ],
    env: Annotated[
        list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE, repeatable")
    ] = None,
    cwd: Annotated[str | None, typer.Option(help="working directory")] = None,
    timeout: Annotated[float | None, typer.Option(help="seconds before it is killed")] = None,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Start a background process in a sandbox and print its pid (follow it with `logs`)."""
    with reported_errors(), connect(url, api_key) as client:
        box = client.sandboxes.get(name)
        process = box.processes.start(
            _program(command), cwd=cwd, env=pairs(env, "--env"), timeout=timeout
        )
        typer.echo(str(process.pid))


@app.command("ps")
def ps(name: NameArg, url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """List a sandbox's background processes."""
    from rich.console import Console
    from rich.table import Table

    with reported_errors(), connect(url, api_key) as client:
        processes = client.sandboxes.get(name).processes.list()
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("PID", "STATE", "EXIT", "STARTED", "COMMAND"):
        table.add_column(column, no_wrap=column != "COMMAND")
    for process in processes:
        code = "-" if process.exit_code is None else str(process.exit_code)
        table.add_row(
            str(process.pid), process.state, code, _when(process.started_at), process.command
        )
    Console(width=None if sys.stdout.isatty() else 200).print(table)


@app.command("logs")
def logs(
    name: NameArg,
    pid: Annotated[int, typer.Argument(help="process id", show_default=False)],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="follow until it exits, then exit with its code")
    ] = False,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Print a background process's output (stdout and stderr to their local twins)."""
    with reported_errors(), connect(url, api_key) as client:
        process = client.sandboxes.get(name).processes.get(pid)
        for event in process.output(follow=follow):
            out = sys.stdout.buffer if event.stream == "stdout" else sys.stderr.buffer
            out.write(event.data)
            out.flush()
        if process.dropped_bytes:
            typer.echo(
                f"sandgate: the first {process.dropped_bytes} bytes are no longer kept", err=True
            )
    if follow and process.exit_code is not None:
        raise typer.Exit(exit_status(process.exit_code))


@app.command("stdin")
def stdin(
    name: NameArg,
    pid: Annotated[int, typer.Argument(help="process id", show_default=False)],
    text: Annotated[
        str | None,
        typer.Argument(help="text to send, as given ('-': this command's stdin, to its end)"),
    ] = None,
    close: Annotated[
        bool, typer.Option("--close", help="then close its stdin (the process sees its end)")
    ] = False,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Write TEXT (or, with -, this command's stdin) to a background process's stdin."""
    if text is None and not close:
        raise misuse(
            f"nothing to send to process {pid}: give TEXT, - (this command's stdin) or --close"
        )
    with reported_errors(), connect(url, api_key) as client:
        process = client.sandboxes.get(name).processes.get(pid)
        if text == "-":
            read = getattr(sys.stdin.buffer, "read1", sys.stdin.buffer.read)  # what is there
            while piece := read(STDIN_PIECE_BYTES):
                process.send_stdin(piece)
        elif text:
            process.send_stdin(text)
        if close:
            process.close_stdin()


@app.command("kill")
def kill(
    name: NameArg,
    pid: Annotated[int, typer.Argument(help="process id", show_default=False)],
    signal: Annotated[
        str, typer.Option("--signal", "-s", help="a name (TERM, SIGKILL) or a number")
    ] = "SIGTERM",
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Send a signal (default SIGTERM) to a background process's process group."""
    sent = _signal(signal)
    with reported_errors(), connect(url, api_key) as client:
        client.sandboxes.get(name).processes.get(pid).kill(sent)


def _signal(value: str) -> str:
    """`--signal` as the SDK takes it: a number, or a name with or without `SIG`."""
    import signal as signals

    if value.isdigit():
        try:
            return signals.Signals(int(value)).name
        except ValueError:
            raise typer.BadParameter(f"{value} is no signal", param_hint="--signal") from None
    named = value.upper() if value.upper().startswith("SIG") else "SIG" + value.upper()
    if named not in signals.Signals.__members__:
        raise typer.BadParameter(f"{value} is no signal", param_hint="--signal")
    return named
