"""`sandgate run-code NAME [CODE]`: Python in a sandbox's stateful code context (a real IPython
kernel), on the SDK's `Sandbox.run_code`.

The code comes from the argument, or from stdin when it is `-` or left out with a stdin that is
not a terminal; it runs in the sandbox's default context (or `--context ID`), so what one call
defines the next one sees. Its stdout and stderr go to their local twins as they stream, each
result's text to stdout (an image as `[image/png result: N bytes]`), an exception's traceback
to stderr, and the command exits 1 when the code raised (255 when the client failed, as
`sandbox exec`). `--json` prints every event as one JSON line instead.

With no code and a terminal on stdin it is a REPL: one context made for the session (or
`--context`), a line at a time, or a block when a line ends with `:` (ended by an empty line);
`exit` or Ctrl-D ends it, Ctrl-C drops the input being typed or interrupts the running code.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any

import typer

from sandgate.cli.sandbox import (
    CLIENT_FAILED,
    KeyOpt,
    NameArg,
    UrlOpt,
    connect,
    pairs,
    reported_errors,
)

if TYPE_CHECKING:
    from sandgate.client import (
        Execution,
        ExecutionError,
        OutputMessage,
        Result,
        Sandbox,
    )

RAISED = 1  # the exit code when the code raised
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
BINARY_RESULTS = (("png", "image/png"), ("jpeg", "image/jpeg"), ("pdf", "application/pdf"))
EXIT_WORDS = frozenset({"exit", "exit()", "quit", "quit()"})
PROMPT, MORE = ">>> ", "... "


def run_code(
    name: NameArg,
    code: Annotated[
        str | None,
        typer.Argument(
            help="Python code; '-' (or none, with stdin not a terminal) reads stdin; none on a "
            "terminal starts a REPL",
            show_default=False,
        ),
    ] = None,
    context: Annotated[
        str | None,
        typer.Option(
            "--context",
            help="the code context's id (default: the sandbox's default context; a REPL makes "
            "one for its session)",
            show_default=False,
        ),
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(help="seconds before the code is interrupted (server default 30)"),
    ] = None,
    env: Annotated[
        list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE for this run, repeatable")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="print the events as JSON lines, as they come")
    ] = False,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Run Python in a sandbox's stateful code context (an IPython kernel); exit 1 if it raised.
    With no code and a terminal: an interactive REPL."""
    variables = pairs(env, "--env")
    interactive = code is None and sys.stdin.isatty()
    if code == "-" or (code is None and not interactive):
        code = sys.stdin.read()
    printer = Printer(as_json=as_json)
    with reported_errors(CLIENT_FAILED), connect(url, api_key) as client:
        box = client.sandboxes.get(name)
        if code is None:
            raise typer.Exit(repl(box, context, printer, timeout, variables))
        execution = printer.run(box, code, context=context, timeout=timeout, env=variables)
    raise typer.Exit(RAISED if execution.error is not None else 0)


class Printer:
    """Where a run's events go as they stream: the local stdout and stderr, or JSON lines."""

    def __init__(self, *, as_json: bool) -> None:
        self.as_json = as_json
        self.color = sys.stderr.isatty() and "NO_COLOR" not in os.environ

    def run(
        self,
        box: Sandbox,
        code: str,
        *,
        context: str | None,
        timeout: float | None,
        env: dict[str, str],
    ) -> Execution:
        execution = box.run_code(
            code,
            context=context,
            env=env,
            timeout=timeout,
            on_stdout=self.output,
            on_stderr=self.output,
            on_result=self.result,
            on_error=self.error,
        )
        if self.as_json:
            self._line(
                {
                    "type": "end",
                    "execution_count": execution.execution_count,
                    "context": execution.context,
                }
            )
        return execution

    def output(self, message: OutputMessage) -> None:
        if self.as_json:
            when = message.timestamp.isoformat() if message.timestamp is not None else None
            self._line({"type": message.stream, "text": message.text, "timestamp": when})
            return
        out = sys.stdout if message.stream == "stdout" else sys.stderr
        out.write(message.text)
        out.flush()

    def result(self, result: Result) -> None:
        if self.as_json:
            fields = {k: v for k, v in asdict(result).items() if v is not None and v != {}}
            self._line({"type": "result", **fields})
            return
        sys.stdout.write("".join(line + "\n" for line in describe(result)))
        sys.stdout.flush()

    def error(self, error: ExecutionError) -> None:
        if self.as_json:
            self._line({"type": "error", **asdict(error)})
            return
        sys.stdout.flush()
        shown = error.traceback or f"{error.name}: {error.value}"
        if not self.color:
            shown = ANSI.sub("", shown)
        sys.stderr.write(shown.rstrip("\n") + "\n")
        sys.stderr.flush()

    def _line(self, event: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()


def describe(result: Result) -> list[str]:
    """A result as lines of text: its text, and a note for each image or PDF it holds."""
    lines = [result.text.rstrip("\n")] if result.text is not None else []
    for field, mime in BINARY_RESULTS:
        value = getattr(result, field)
        if value is not None:
            lines.append(f"[{mime} result: {_decoded_size(value)} bytes]")
    if result.svg is not None:
        lines.append(f"[image/svg+xml result: {len(result.svg.encode())} bytes]")
    if not lines and result.formats():
        lines.append(f"[{', '.join(result.formats())} result]")
    return lines


def _decoded_size(value: str) -> int:
    try:
        return len(base64.b64decode(value))
    except (binascii.Error, ValueError):
        return len(value) * 3 // 4


# ------------------------------------------------------------------------------ the REPL


def repl(
    box: Sandbox,
    context: str | None,
    printer: Printer,
    timeout: float | None,
    env: dict[str, str],
) -> int:
    """Read, run, print until `exit` or Ctrl-D, in one context; 0, or 255 if the context went."""
    from rich.console import Console

    from sandgate.client import NotFoundError, SandgateError

    with contextlib.suppress(ImportError):
        import readline  # noqa: F401 (line editing and history for input())
    console = Console(stderr=True, highlight=False)
    made = None
    if context is None:
        made = box.contexts.create()
        context = made.id
    console.print(
        f"[dim]Python in sandbox {box.name}, context {context}. "
        "A line ending in ':' opens a block (an empty line ends it); exit or Ctrl-D ends.[/]"
    )
    status = 0
    try:
        while True:
            try:
                source = read_block(input)
            except KeyboardInterrupt:
                console.print("\nKeyboardInterrupt")
                continue
            if source is None:
                break
            if not source.strip():
                continue
            try:
                printer.run(box, source, context=context, timeout=timeout, env=env)
            except KeyboardInterrupt:  # the stream closes: the server interrupts the code
                console.print("\nKeyboardInterrupt")
            except NotFoundError as exc:
                console.print(f"error: {exc.message}", markup=False)
                status = CLIENT_FAILED
                break
            except SandgateError as exc:
                console.print(f"error: {exc.message}", markup=False)
    finally:
        if made is not None:
            with contextlib.suppress(SandgateError):
                box.contexts.delete(made)
    return status


def read_block(read: Callable[[str], str]) -> str | None:
    """One input: a line, or a block when it ends with ':' (until an empty line or the end of
    input); None for `exit`/`quit` or the end of input (Ctrl-D) at the prompt."""
    try:
        line = read(PROMPT)
    except EOFError:
        sys.stdout.write("\n")
        return None
    if line.strip() in EXIT_WORDS:
        return None
    lines = [line]
    if line.rstrip().endswith(":"):
        while True:
            try:
                more = read(MORE)
            except EOFError:
                sys.stdout.write("\n")
                break
            if not more.strip():
                break
            lines.append(more)
    return "\n".join(lines)
