"""`sandgate exec-job ...`: submit a command that runs once in the background, look at it.

The same `--url` / `--api-key`, `error:` lines and exit codes as `sandgate sandbox`; see
src/sandgate/cli/sandbox.py.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from sandgate.cli.sandbox import (
    CLIENT_FAILED,
    KeyOpt,
    NameArg,
    UrlOpt,
    _program,
    _when,
    connect,
    exit_status,
    pairs,
    reported_errors,
)

if TYPE_CHECKING:
    from sandgate.client import ExecJob, Sandgate

app = typer.Typer(
    help="Run commands once, in the background, in a sandbox; look at their results.",
    no_args_is_help=True,
)

JobIdArg = Annotated[str, typer.Argument(help="exec job id", show_default=False)]


@app.command("submit")
def submit(
    name: NameArg,
    command: Annotated[
        list[str],
        typer.Argument(help="command after --; one argument runs as bash code", show_default=False),
    ],
    timeout: Annotated[
        float | None, typer.Option(help="seconds before it is killed (server default 30)")
    ] = None,
    env: Annotated[
        list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE, repeatable")
    ] = None,
    cwd: Annotated[str | None, typer.Option(help="working directory")] = None,
    key: Annotated[
        str | None,
        typer.Option(
            "--key",
            "--idempotency-key",
            "-k",
            help="Idempotency-Key: the same key never runs the command twice",
        ),
    ] = None,
    wait: Annotated[
        bool,
        typer.Option("--wait", "-w", help="wait for it; print its output, exit with its exit code"),
    ] = False,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Submit an exec job and print its id (or, with --wait, its output)."""
    with reported_errors(CLIENT_FAILED if wait else 1), connect(url, api_key) as client:
        box = client.sandboxes.get(name)
        job = box.submit_exec_job(
            _program(command),
            timeout=timeout,
            env=pairs(env, "--env"),
            cwd=cwd,
            idempotency_key=key,
        )
        if not wait:
            typer.echo(job.id)
            return
        job = _wait(client, job)
    _print_output(job)
    if job.exit_code is None:
        raise typer.Exit(CLIENT_FAILED)  # it failed before the command could tell (see error)
    raise typer.Exit(exit_status(job.exit_code))


def _wait(client: Sandgate, job: ExecJob) -> ExecJob:
    try:
        return client.wait_exec_job(job.id)
    except KeyboardInterrupt:
        typer.echo(f"\nsandgate: exec job {job.id} goes on; see `sandgate exec-job get`", err=True)
        raise


def _print_output(job: ExecJob) -> None:
    """Its output to the local twins, then what sandgate has to say about it on stderr."""
    sys.stdout.write(job.stdout)
    sys.stdout.flush()
    sys.stderr.write(job.stderr)
    for stream, cut in (("stdout", job.stdout_truncated), ("stderr", job.stderr_truncated)):
        if cut:
            sys.stderr.write(f"sandgate: {stream} was cut at 1 MiB\n")
    if job.error and job.error != f"exited with code {job.exit_code}":
        sys.stderr.write(f"sandgate: exec job {job.id} failed: {job.error}\n")
    sys.stderr.flush()


@app.command("get")
def get(
    job_id: JobIdArg,
    output: Annotated[
        bool,
        typer.Option(
            "--output", "-o", help="print its stdout and stderr (to their local twins) instead"
        ),
    ] = False,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Show an exec job: its state, exit code and times (or, with --output, its output)."""
    with reported_errors(), connect(url, api_key) as client:
        job = client.get_exec_job(job_id)
    if output:
        _print_output(job)
        return
    code = "-" if job.exit_code is None else str(job.exit_code)
    lines = {
        "id": job.id,
        "sandbox": job.sandbox,
        "state": job.state,
        "exit code": code,
        "command": job.command,
        "timeout": f"{job.timeout:g} s",
        "created": _when(job.created_at),
        "started": _when(job.started_at),
        "finished": _when(job.finished_at),
        "error": job.error or "-",
        "stdout": _size(job.stdout, job.stdout_truncated),
        "stderr": _size(job.stderr, job.stderr_truncated),
    }
    for label, value in lines.items():
        typer.echo(f"{label + ':':<11}{value}")


def _size(text: str, truncated: bool) -> str:
    size = len(text.encode("utf-8"))
    return f"{size} bytes" + (" (cut at 1 MiB)" if truncated else "")


@app.command("ls")
def ls(
    name: NameArg,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="at most this many")] = 100,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="ids only")] = False,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """List a sandbox's exec jobs, newest first, as a table."""
    from rich.console import Console
    from rich.table import Table

    with reported_errors(), connect(url, api_key) as client:
        jobs = client.sandboxes.get(name).list_exec_jobs(limit=limit)
    if quiet:
        for job in jobs:
            typer.echo(job.id)
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("ID", "STATE", "EXIT", "CREATED", "FINISHED", "COMMAND"):
        table.add_column(column, no_wrap=column != "COMMAND")
    for job in jobs:
        code = "-" if job.exit_code is None else str(job.exit_code)
        table.add_row(
            job.id, job.state, code, _when(job.created_at), _when(job.finished_at), job.command
        )
    Console(width=None if sys.stdout.isatty() else 200).print(table)
