"""`sandgate workspace ...`: persistent workspaces, trees of files that outlive sandboxes, with
a git history (mounted by `sandgate sandbox create --workspace NAME[:PATH]`).

`commit` snapshots what the sandboxes mounting it see now, `log` lists the commits newest
first, `diff` shows what one changed (the stat, then the patch), `restore` brings the files
back to one (the current state is committed first, so nothing is lost). The same `--url` /
`--api-key`, `error:` lines and exit codes as `sandgate sandbox` (src/sandgate/cli/sandbox.py).
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Annotated

import typer

from sandgate.cli.sandbox import KeyOpt, UrlOpt, connect, reported_errors

if TYPE_CHECKING:
    from sandgate.client import Commit, CommitDiff, CommitResult, WorkspaceInfo

app = typer.Typer(
    help="Persistent workspaces: create, list, commit, log, diff, restore, delete.",
    no_args_is_help=True,
)

NameArg = Annotated[str, typer.Argument(help="workspace name", show_default=False)]
ShaArg = Annotated[str, typer.Argument(help="a commit's sha (at least 4 hex digits)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON")]
SHORT_SHA = 12


def _when(value: datetime | None) -> str:
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def _row(ws: WorkspaceInfo) -> dict[str, object]:
    return {
        "name": ws.name,
        "id": ws.id,
        "quota_mb": ws.quota_mb,
        "head": ws.head,
        "mounted_by": ws.mounted_by,
        "created_at": _iso(ws.created_at),
        "updated_at": _iso(ws.updated_at),
    }


def _commit_row(commit: Commit) -> dict[str, object]:
    return {
        "sha": commit.sha,
        "parents": list(commit.parents),
        "author": {"name": commit.author.name, "email": commit.author.email},
        "date": _iso(commit.date),
        "message": commit.message,
    }


def _commit_line(commit: Commit) -> str:
    return f"{commit.sha[:SHORT_SHA]}  {_when(commit.date)}  {commit.subject}"


def _report(result: CommitResult, done: str) -> None:
    """A commit's or restore's answer: its commit, then what it left out (on stderr)."""
    if result.created:
        typer.echo(_commit_line(result.commit))
    else:
        typer.echo(f"{result.commit.sha[:SHORT_SHA]}  nothing changed ({done})")
    for skipped in result.skipped:
        typer.echo(f"sandgate: left out {skipped.path} ({skipped.size} bytes)", err=True)


@app.command("create")
def create(
    name: NameArg,
    quota_mb: Annotated[
        int | None,
        typer.Option(min=1, help="MB for its files and history together (server default)"),
    ] = None,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Create an empty workspace and print its name."""
    with reported_errors(), connect(url, api_key) as client:
        made = client.workspaces.create(name, quota_mb=quota_mb)
    typer.echo(made.name)


@app.command("list")
def list_workspaces(
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="names only")] = False,
    as_json: JsonOpt = False,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """List your workspaces as a table."""
    from rich.console import Console
    from rich.table import Table

    with reported_errors(), connect(url, api_key) as client:
        found = client.workspaces.list()
    if as_json:
        typer.echo(json.dumps([_row(ws) for ws in found]))
        return
    if quiet:
        for ws in found:
            typer.echo(ws.name)
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("NAME", "QUOTA", "HEAD", "UPDATED", "MOUNTED BY"):
        table.add_column(column, no_wrap=column != "MOUNTED BY")
    for ws in found:
        table.add_row(
            ws.name,
            f"{ws.quota_mb} MB",
            (ws.head or "-")[:SHORT_SHA],
            _when(ws.updated_at),
            ", ".join(ws.mounted_by) or "-",
        )
    Console(width=None if sys.stdout.isatty() else 200).print(table)


@app.command("info")
def info(
    name: NameArg, as_json: JsonOpt = False, url: UrlOpt = None, api_key: KeyOpt = None
) -> None:
    """One workspace: its quota, head commit and the sandboxes mounting it."""
    with reported_errors(), connect(url, api_key) as client:
        ws = client.workspaces.get(name)
    if as_json:
        typer.echo(json.dumps(_row(ws), indent=2))
        return
    for label, value in (
        ("name", ws.name),
        ("id", ws.id),
        ("quota", f"{ws.quota_mb} MB"),
        ("head", ws.head or "-"),
        ("mounted by", ", ".join(ws.mounted_by) or "-"),
        ("created", _when(ws.created_at)),
        ("updated", _when(ws.updated_at)),
    ):
        typer.echo(f"{label + ':':<12}{value}")


@app.command("delete")
def delete(name: NameArg, url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """Delete a workspace, its files and its history (not while a sandbox mounts it)."""
    with reported_errors(), connect(url, api_key) as client:
        client.workspaces.delete(name)
    typer.echo(name)


@app.command("commit")
def commit(
    name: NameArg,
    message: Annotated[str, typer.Option("--message", "-m", help="the commit message")] = "",
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Commit the workspace's files and print the commit.

    The files as the sandboxes mounting it see them now; those left out for their size are
    named on stderr."""
    with reported_errors(), connect(url, api_key) as client:
        result = client.workspaces.get(name).commit(message)
    _report(result, "the head")


@app.command("log")
def log(
    name: NameArg,
    limit: Annotated[int, typer.Option(min=1, help="at most this many commits")] = 50,
    as_json: JsonOpt = False,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """The workspace's commits, newest first: sha, date and subject."""
    with reported_errors(), connect(url, api_key) as client:
        commits = client.workspaces.get(name).log(limit=limit)
    if as_json:
        typer.echo(json.dumps([_commit_row(c) for c in commits]))
        return
    for c in commits:
        typer.echo(_commit_line(c))


def _stat(diff: CommitDiff) -> list[str]:
    """The files a commit changed, as `git diff --stat` sums them up."""
    width = max((len(f.path) for f in diff.files), default=0)
    lines = []
    added = deleted = 0
    for f in diff.files:
        if f.added is None or f.deleted is None:
            lines.append(f" {f.path:<{width}} | binary")
            continue
        added += f.added
        deleted += f.deleted
        lines.append(f" {f.path:<{width}} | +{f.added} -{f.deleted}")
    lines.append(
        f" {len(diff.files)} file(s) changed, {added} insertion(s)(+), {deleted} deletion(s)(-)"
    )
    return lines


@app.command("diff")
def diff(name: NameArg, sha: ShaArg, url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """What commit SHA changed against its parent: the commit, the stat, then the patch."""
    with reported_errors(), connect(url, api_key) as client:
        shown = client.workspaces.get(name).diff(sha)
    c = shown.commit
    typer.echo(f"commit {c.sha}")
    typer.echo(f"Author: {c.author.name} <{c.author.email}>")
    typer.echo(f"Date:   {_when(c.date)}")
    typer.echo("")
    for line in c.message.rstrip("\n").splitlines():
        typer.echo(f"    {line}")
    typer.echo("")
    for line in _stat(shown):
        typer.echo(line)
    if shown.patch:
        typer.echo("")
        sys.stdout.write(shown.patch if shown.patch.endswith("\n") else shown.patch + "\n")
        sys.stdout.flush()
    if shown.truncated:
        typer.echo("sandgate: the patch was cut at 1 MiB", err=True)


@app.command("restore")
def restore(name: NameArg, sha: ShaArg, url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """Bring the workspace's files back to commit SHA and print the restore's commit.

    The current state is committed first, so nothing is lost; sandboxes mounting it see the
    change at once."""
    with reported_errors(), connect(url, api_key) as client:
        result = client.workspaces.get(name).restore(sha)
    _report(result, f"already at {sha}")
