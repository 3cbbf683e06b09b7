"""`sandgate cp`: copy one file into or out of a sandbox, streamed, with a progress bar."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Annotated

import typer

from sandgate.cli.sandbox import KeyOpt, UrlOpt, connect, reported_errors
from sandgate.core.names import NAME_PATTERN

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from sandgate.client import Sandbox

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
    from sandgate.client import NotFoundError

    try:
        return box.files.stat(path).is_dir
    except NotFoundError:
        return False


def cp(
    source: Annotated[str, typer.Argument(help="LOCAL or NAME:PATH ('-': stdin)")],
    destination: Annotated[str, typer.Argument(help="NAME:PATH or LOCAL ('-': stdout)")],
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Copy a file into a sandbox (LOCAL NAME:PATH) or out of one (NAME:PATH LOCAL).

    A relative PATH is under /workspace; a PATH ending in / or naming a directory gets the
    file's own name, as does a LOCAL that is a directory."""
    src, dst = remote(source), remote(destination)
    if (src is None) == (dst is None):
        raise typer.BadParameter("copy between a local path and NAME:PATH (one of each)")
    with reported_errors(), connect(url, api_key) as client:
        if dst is not None:
            name, path = dst
            box = client.sandboxes.get(name)
            if source != "-":
                local = Path(source)
                if local.is_dir():
                    raise typer.BadParameter(f"{source} is a directory; cp copies one file")
                if path.endswith("/") or _is_remote_dir(box, path):
                    path = path.rstrip("/") + "/" + local.name
                with Bar(f"{local.name} → {name}") as bar:
                    box.files.write(path, local, progress=bar)
            else:
                box.files.write(path, sys.stdin.buffer)
        else:
            assert src is not None
            name, path = src
            box = client.sandboxes.get(name)
            if destination == "-":
                box.files.download(path, sys.stdout.buffer)
                sys.stdout.flush()
                return
            target = Path(destination)
            if target.is_dir() or destination.endswith(os.sep):
                target = target / path.rstrip("/").rsplit("/", 1)[-1]
            with Bar(f"{name} → {target.name}") as bar:
                box.files.download(path, target, progress=bar)
