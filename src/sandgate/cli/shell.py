"""`sandgate shell NAME`: an interactive terminal in a sandbox that behaves like ssh.

The local terminal goes to raw mode (so Ctrl-C, Ctrl-Z, Ctrl-D are bytes for the sandbox's
shell), its size is sent at the start and on every SIGWINCH, and it is restored on the way out
whatever the way out is: the remote shell exiting, a lost connection, SIGTERM or SIGHUP.

The main thread waits in `select` on stdin and a wake-up pipe (signals and the receiving
thread write to it); a second thread copies the terminal's output to stdout.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import termios
import threading
import tty
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer

from sandgate.cli.sandbox import (
    CLIENT_FAILED,
    KeyOpt,
    NameArg,
    UrlOpt,
    connect,
    exit_status,
    reported_errors,
)

if TYPE_CHECKING:
    from sandgate.client import Terminal

READ_BYTES = 1 << 16
EOT = b"\x04"  # what a non-terminal stdin's end becomes: Ctrl-D to the remote line


class _Hangup(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def terminal_size(*fds: int) -> tuple[int, int]:
    """(cols, rows) of the first descriptor that is a terminal, else $COLUMNS/$LINES or 80x24."""
    for fd in fds:
        try:
            size = os.get_terminal_size(fd)
        except OSError:
            continue
        if size.columns > 0 and size.lines > 0:  # a fresh pty may say 0x0: not a size
            return size.columns, size.lines
    fallback = shutil.get_terminal_size()
    return fallback.columns, fallback.lines


def shell(
    name: NameArg,
    command: Annotated[
        str | None,
        typer.Option(help="what to run in the terminal (default: a login bash)"),
    ] = None,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Open an interactive terminal in a sandbox; exit with the remote shell's exit code."""
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    with reported_errors(CLIENT_FAILED), connect(url, api_key) as client:
        cols, rows = terminal_size(stdout, stdin)
        box = client.sandboxes.get(name)
        with box.pty(cols=cols, rows=rows, command=command) as term:
            session = Session(term, stdin, stdout)
            code = session.run()
    if session.stopped_by is not None:
        typer.echo(f"error: stopped by {signal.Signals(session.stopped_by).name}", err=True)
        raise typer.Exit(128 + session.stopped_by)
    if code is None:
        typer.echo(f"error: the connection to {name} ended before its shell exited", err=True)
        raise typer.Exit(CLIENT_FAILED)
    raise typer.Exit(exit_status(code))


class Session:
    """One terminal session: raw local terminal, bytes both ways, resizes."""

    def __init__(self, term: Terminal, stdin: int, stdout: int) -> None:
        self.term = term
        self.stdin = stdin
        self.stdout = stdout
        self.interactive = os.isatty(stdin)
        self.resized = False
        self.finished = False  # set by the receiving thread when the terminal ended
        self.failure: BaseException | None = None
        self.stopped_by: int | None = None  # the signal (SIGTERM, SIGHUP, ...) that ended it
        self._wake_read, self._wake_write = os.pipe()
        for fd in (self._wake_read, self._wake_write):
            os.set_blocking(fd, False)

    def run(self) -> int | None:
        """The remote exit code, or None if the connection ended first."""
        saved = termios.tcgetattr(self.stdin) if self.interactive else None
        previous = self._install_signals()
        receiver = threading.Thread(target=self._receive, name="shell-output", daemon=True)
        try:
            if saved is not None:
                tty.setraw(self.stdin, termios.TCSADRAIN)
            receiver.start()
            self._send_loop()
        except _Hangup as stop:
            self.stopped_by = stop.signum
            return None
        finally:
            if saved is not None:
                termios.tcsetattr(self.stdin, termios.TCSADRAIN, saved)
            self._restore_signals(previous)
            if not self.finished:
                self.term.close()  # hang up: the receiver sees the end and stops
            if receiver.ident is not None:
                receiver.join(timeout=5)
            if not receiver.is_alive():  # else it may still write the wake-up pipe: leave it
                os.close(self._wake_read)
                os.close(self._wake_write)
        if self.failure is not None:
            raise self.failure
        return self.term.exit_code

    def _install_signals(self) -> tuple[list[tuple[int, Any]], int]:
        """Our handlers in; what they replaced (handlers, wake-up fd) out."""

        def on_resize(signum: int, frame: FrameType | None) -> None:
            self.resized = True  # the wake-up fd gets the main thread out of select

        def on_hangup(signum: int, frame: FrameType | None) -> None:
            raise _Hangup(signum)

        handlers: list[tuple[int, Any]] = [
            (signal.SIGWINCH, signal.signal(signal.SIGWINCH, on_resize))
        ]
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            handlers.append((signum, signal.signal(signum, on_hangup)))
        wakeup = signal.set_wakeup_fd(self._wake_write, warn_on_full_buffer=False)
        return handlers, wakeup

    def _restore_signals(self, previous: tuple[list[tuple[int, Any]], int]) -> None:
        handlers, wakeup = previous
        signal.set_wakeup_fd(wakeup)
        for signum, handler in handlers:
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)

    def _send_loop(self) -> None:
        stdin_open = True
        while not self.finished:
            watched = [self._wake_read, self.stdin] if stdin_open else [self._wake_read]
            ready, _, _ = select.select(watched, [], [])
            if self._wake_read in ready:
                self._drain_wakeups()
            if self.resized:
                self.resized = False
                self._resize()
            if self.finished:
                return
            if self.stdin in ready:
                data = os.read(self.stdin, READ_BYTES)
                if not data:
                    stdin_open = False
                    if not self.interactive:
                        self._send(EOT)
                    continue
                self._send(data)

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_read, 512):
                pass
        except BlockingIOError:
            pass

    def _send(self, data: bytes) -> None:
        from sandgate.client import APIConnectionError

        try:
            self.term.send(data)
        except APIConnectionError:
            pass  # the shell exited; the receiver reads its last words and wakes us

    def _resize(self) -> None:
        from sandgate.client import APIConnectionError

        cols, rows = terminal_size(self.stdout, self.stdin)
        try:
            self.term.resize(cols, rows)
        except APIConnectionError:
            pass

    def _receive(self) -> None:
        try:
            while (data := self.term.recv()) is not None:
                view = memoryview(data)
                while view:
                    view = view[os.write(self.stdout, view) :]
        except BaseException as exc:
            self.failure = exc
        finally:
            self.finished = True  # before the wake-up, so the woken main thread sees it
            try:
                os.write(self._wake_write, b"\0")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already
