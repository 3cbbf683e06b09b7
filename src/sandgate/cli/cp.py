"""`sandgate cp`: copy a file into or out of a sandbox, streamed, with a progress bar; with
`-r`, a directory and everything under it, as `cp -r` does."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Annotated

import typer

from sandgate.cli.sandbox import KeyOpt, UrlOpt, connect, misuse, reported_errors
from sandgate.core.names import NAME_PATTERN

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from sandgate.client import FileEntry, Sandbox

PROGRESS_MIN_BYTES = 4 << 20  # transfers smaller than this get no bar


def remote(spec: str) -> tuple[str, str] | None:
    """`NAME:PATH` as (name, path); None for a local path (write `./a:b` for a local `a:b`)."""
    name, sep, path = spec.partition(":")
    if not sep or not NAME_PATTERN.match(name):
        return None
    return name, path or "/workspace"


class Bar:
    """A progress callback that draws a rich bar on stderr once a transfer is big enough."""

    def __init__(self, description: str) -> None:
        self.description = description
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __call__(self, done: int, total: int | None) -> None:
        if self._progress is None:
            if total is None or total < PROGRESS_MIN_BYTES or not sys.stderr.isatty():
                return
            self._start(total)
        assert self._progress is not None and self._task is not None
        self._progress.update(self._task, completed=done)

    def _start(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task(self.description, total=total)

    def __enter__(self) -> Bar:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()


def _is_remote_dir(box: Sandbox, path: str) -> bool:
    entry = _remote_entry(box, path)
    return entry is not None and entry.is_dir


def _remote_entry(box: Sandbox, path: str) -> FileEntry | None:
    from sandgate.client import NotFoundError

    try:
        return box.files.stat(path)
    except NotFoundError:
        return None


def _own_name(name: str) -> str | None:
    """The name a copied directory keeps inside an existing one; None for `.`, `..` or `/`
    (their contents go straight in, as `cp -r . dir` does)."""
    return None if name in ("", ".", "..") else name


def _remote_name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _join(directory: str, name: str) -> str:
    return directory.rstrip("/") + "/" + name


def _needs_r(source: str, destination: str) -> typer.Exit:
    return misuse(
        f"{source} is a directory: add -r to copy it (sandgate cp -r {source} {destination})"
    )


def _skipped(where: str, what: str) -> None:
    typer.echo(f"sandgate: skipped {where} ({what})", err=True)


def _upload_tree(box: Sandbox, local: Path, path: str) -> None:
    """`local`'s files and directories into `path` (made if missing). Symlinks and special
    files are skipped: a link may point anywhere on this machine."""
    box.files.mkdir(path, parents=True)
    for child in sorted(local.iterdir()):
        target = _join(path, child.name)
        if child.is_symlink():
            _skipped(str(child), "a symlink")
        elif child.is_dir():
            _upload_tree(box, child, target)
        elif child.is_file():
            with Bar(f"{child.name} → {box.name}") as bar:
                box.files.write(target, child, progress=bar)
        else:
            _skipped(str(child), "not a regular file")


def _download_tree(box: Sandbox, path: str, local: Path) -> None:
    """The sandbox's directory `path` into `local` (made if missing; its parent must exist).
    Symlinks and special files are skipped."""
    local.mkdir(exist_ok=True)
    for entry in box.files.list(path):
        target = local / entry.name
        if entry.type == "dir":
            _download_tree(box, entry.path, target)
        elif entry.type == "file":
            with Bar(f"{box.name} → {entry.name}") as bar:
                box.files.download(entry.path, target, progress=bar)
        else:
            _skipped(
                f"{box.name}:{entry.path}", "a symlink" if entry.type == "symlink" else entry.type
            )


def cp(
    source: Annotated[str, typer.Argument(help="LOCAL or NAME:PATH ('-': stdin)")],
    destination: Annotated[str, typer.Argument(help="NAME:PATH or LOCAL ('-': stdout)")],
    recursive: Annotated[
        bool, typer.Option("--recursive", "-r", "-R", help="copy directories and what they hold")
    ] = False,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Copy a file into a sandbox (LOCAL NAME:PATH) or out of one (NAME:PATH LOCAL); with -r,
    a directory and everything under it.

    A relative PATH is under /workspace; a PATH ending in / or naming a directory gets the
    file's own name, as does a LOCAL that is a directory. With -r a directory copied to one
    that exists goes inside it under its own name, and to one that does not becomes it."""
    from sandgate.client import ConflictError

    src, dst = remote(source), remote(destination)
    if (src is None) == (dst is None):
        raise typer.BadParameter("copy between a local path and NAME:PATH (one of each)")
    with reported_errors(), connect(url, api_key) as client:
        if dst is not None:
            name, path = dst
            box = client.sandboxes.get(name)
            if source == "-":
                box.files.write(path, sys.stdin.buffer)
                return
            local = Path(source)
            if local.is_dir():
                if not recursive:
                    raise _needs_r(source, destination)
                _upload_tree(box, local, _tree_path(box, destination, path, local))
                return
            if path.endswith("/") or _is_remote_dir(box, path):
                path = _join(path, local.name)
            with Bar(f"{local.name} → {name}") as bar:
                box.files.write(path, local, progress=bar)
        else:
            assert src is not None
            name, path = src
            box = client.sandboxes.get(name)
            if destination == "-":
                try:
                    box.files.download(path, sys.stdout.buffer)
                except ConflictError as exc:
                    if exc.code != "is_a_directory":
                        raise
                    raise misuse(
                        f"{source} is a directory: copy it to a local directory with -r"
                    ) from None
                sys.stdout.flush()
                return
            if recursive and _is_remote_dir(box, path):
                _download_tree(box, path, _tree_target(destination, path))
                return
            target = Path(destination)
            if target.is_dir() or destination.endswith(os.sep):
                target = target / _remote_name(path)
            try:
                with Bar(f"{name} → {target.name}") as bar:
                    box.files.download(path, target, progress=bar)
            except ConflictError as exc:
                if exc.code != "is_a_directory":
                    raise
                raise _needs_r(source, destination) from None


def _tree_path(box: Sandbox, destination: str, path: str, local: Path) -> str:
    """Where `cp -r LOCAL NAME:PATH` puts the directory: inside PATH if that is a directory,
    PATH itself if it does not exist."""
    entry = _remote_entry(box, path)
    if entry is None:
        return path
    if not entry.is_dir:
        raise misuse(f"{destination} exists and is not a directory")
    own = _own_name(local.name)
    return _join(path, own) if own else path


def _tree_target(destination: str, path: str) -> Path:
    """Where `cp -r NAME:PATH LOCAL` puts the directory: inside LOCAL if that is a directory,
    LOCAL itself if it does not exist."""
    target = Path(destination)
    if not target.exists():
        return target
    if not target.is_dir():
        raise misuse(f"{destination} exists and is not a directory")
    own = _own_name(_remote_name(path))
    return target / own if own else target
