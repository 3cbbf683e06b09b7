"""`sandgate templates ...`: the images sandboxes start from (`--template NAME` on create).

`import NAME SOURCE` takes an OCI image layout or `docker save` tarball, a root file system
tarball (tar or tar.gz), or a local directory (packed here as a root file system, owners
squashed to root); the upload shows a progress bar on a terminal. With an admin key the
template is public. The same `--url` / `--api-key`, `error:` lines and exit codes as
`sandgate sandbox` (src/sandgate/cli/sandbox.py).
"""

from __future__ import annotations

import json
import os
import tarfile
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from sandgate.cli.cp import Bar
from sandgate.cli.sandbox import KeyOpt, UrlOpt, connect, reported_errors

if TYPE_CHECKING:
    from sandgate.client import TemplateInfo

app = typer.Typer(
    help="Images sandboxes start from: import, list, show, delete.", no_args_is_help=True
)

NameArg = Annotated[str, typer.Argument(help="template name", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON")]


def _row(t: TemplateInfo) -> dict[str, object]:
    return {
        "name": t.name,
        "public": t.public,
        "digest": t.digest,
        "source": t.source,
        "size": t.size,
        "layers": t.layers,
        "env": t.env,
        "workdir": t.workdir,
        "user": t.user,
        "cmd": t.cmd,
        "created_at": t.created_at.isoformat() if t.created_at else None,
    }


def _squashed(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def pack_directory(directory: Path, into: Path) -> None:
    """A directory as a root file system tarball (symlinks kept as links, owners root)."""
    with tarfile.open(into, "w") as tar:
        for entry in sorted(os.listdir(directory)):
            tar.add(directory / entry, arcname=entry, recursive=True, filter=_squashed)


@app.command("import")
def import_template(
    name: NameArg,
    source: Annotated[
        Path,
        typer.Argument(
            help="an OCI or docker save tarball, a rootfs .tar/.tar.gz, or a directory",
            exists=True,
            show_default=False,
        ),
    ],
    as_json: JsonOpt = False,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Import SOURCE as template NAME (replacing one of that name)."""
    with reported_errors(), connect(url, api_key) as client:
        if source.is_dir():
            with tempfile.TemporaryDirectory(prefix="sandgate-template-") as scratch:
                packed = Path(scratch) / "rootfs.tar"
                typer.echo(f"packing {source} ...", err=True)
                pack_directory(source, packed)
                with Bar(f"uploading {name}") as bar:
                    made = client.templates.import_archive(name, packed, progress=bar)
        else:
            with Bar(f"uploading {name}") as bar:
                made = client.templates.import_archive(name, source, progress=bar)
        if as_json:
            typer.echo(json.dumps(_row(made)))
            return
        where = "public" if made.public else "yours"
        typer.echo(
            f"{made.name}: {made.source}, {made.layers} layer(s), {made.size} bytes, "
            f"{made.digest} ({where})"
        )


def pack_context(context: Path, sources: list[str], into: Path) -> None:
    """The files the copy steps name, from `context`, as the build's context tarball; a
    source whose real path is outside the context (a link out of it) is refused."""
    with tarfile.open(into, "w") as tar:
        for source in sorted(set(sources)):
            path = context / source
            if not path.exists() and not path.is_symlink():
                raise typer.BadParameter(f"copy {source!r}: no such file in {context}")
            if not path.resolve().is_relative_to(context):
                raise typer.BadParameter(f"copy {source!r}: it leads out of {context}")
            tar.add(path, arcname=source, recursive=True, filter=_squashed)


class BuildView:
    """The build's events on the terminal: a step bar, and every log line above it."""

    def __init__(self, steps: int, quiet: bool) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self.quiet = quiet
        self.console = Console(stderr=True)
        self.progress = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
            disable=not self.console.is_terminal,
        )
        self.task = self.progress.add_task("building", total=steps)

    def __call__(self, event: dict[str, object]) -> None:
        kind = event.get("event")
        if kind == "step":
            self.progress.update(self.task, description=f"#{event['index']} {event['step']}")
            self.console.print(f"[bold]#{event['index']}[/] {event['step']}", highlight=False)
        elif kind == "log" and not self.quiet:
            self.console.out(str(event.get("text", "")), end="", highlight=False)
        elif kind == "step_done":
            self.progress.advance(self.task)
            how = "cached" if event.get("cached") else f"done in {event.get('seconds')} s"
            self.console.print(f"[dim]#{event['index']} {how}[/]", highlight=False)


@app.command("build")
def build(
    name: NameArg,
    file: Annotated[
        Path,
        typer.Option(
            "--file", "-f", help="the build file (TOML, or JSON)", exists=True, dir_okay=False
        ),
    ] = Path("template.toml"),
    context: Annotated[
        Path | None,
        typer.Option(help="directory the copy steps read from (default: the file's own)"),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no step output")] = False,
    as_json: JsonOpt = False,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Build template NAME from a base template and steps (run, copy, env, workdir, user);
    each step's layer is cached. Shows the steps' output as they run."""
    import tomllib

    raw = file.read_bytes()
    try:
        document = json.loads(raw) if file.suffix == ".json" else tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise typer.BadParameter(f"{file}: {exc}", param_hint="--file") from None
    from sandgate.client import BuildFailedError
    from sandgate.core import build_spec

    try:  # checked here first: nothing is packed for a document the server would refuse
        spec = build_spec.parse(document)
    except build_spec.BuildSpecError as exc:
        raise typer.BadParameter(f"{file}: {exc.message}", param_hint="--file") from None
    steps = spec.steps
    sources = [step.source for step in spec.steps if step.kind == "copy"]

    with reported_errors(), connect(url, api_key) as client:
        view = BuildView(len(steps), quiet or as_json)
        with tempfile.TemporaryDirectory(prefix="sandgate-build-") as scratch:
            packed: Path | None = None
            if sources:
                packed = Path(scratch) / "context.tar"
                pack_context((context or file.parent).resolve(), sources, packed)
            try:
                with view.progress:
                    made = client.templates.build(name, document, context=packed, on_event=view)
            except BuildFailedError as exc:
                typer.echo(
                    f"error: step {exc.step} failed: {exc.message} (the whole log: "
                    f"sandgate templates build-log {exc.build_id})",
                    err=True,
                )
                raise typer.Exit(1) from None
        if as_json:
            typer.echo(json.dumps(_row(made)))
            return
        typer.echo(f"{made.name}: {made.layers} layer(s), {made.size} bytes, {made.digest}")


@app.command("build-log")
def build_log(
    build_id: Annotated[str, typer.Argument(help="the build's id", show_default=False)],
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """A build's whole log (its last 1 MiB), then its state."""
    with reported_errors(), connect(url, api_key) as client:
        record = client.templates.build_log(build_id)
        typer.echo(record.get("log", ""), nl=False)
        typer.echo(f"-- {record.get('state')}: {record.get('error') or record.get('digest')}")


@app.command("list")
def list_templates(as_json: JsonOpt = False, url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """Your templates and the public ones (the built-ins default and code-interpreter too)."""
    with reported_errors(), connect(url, api_key) as client:
        found = client.templates.list()
        if as_json:
            typer.echo(json.dumps([_row(t) for t in found]))
            return
        typer.echo("default\tbuilt-in\nbase\tbuilt-in (E2B's name for default)")
        typer.echo("code-interpreter\tbuilt-in")
        for t in found:
            typer.echo(f"{t.name}\t{'public' if t.public else 'yours'}\t{t.source}\t{t.size}")


@app.command("show")
def show(name: NameArg, url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """One template, as JSON."""
    with reported_errors(), connect(url, api_key) as client:
        typer.echo(json.dumps(_row(client.templates.get(name)), indent=2))


@app.command("delete")
def delete(name: NameArg, url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """Delete a template (running sandboxes started from it keep running)."""
    with reported_errors(), connect(url, api_key) as client:
        client.templates.delete(name)
