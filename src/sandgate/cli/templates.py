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
