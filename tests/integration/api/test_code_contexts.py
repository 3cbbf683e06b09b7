"""Code contexts over the native API: real IPython kernels in real sandboxes.

The kernel is the sandbox's own Python with Debian's python3-ipykernel (scripts/install puts
it on the host root every sandbox starts from).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx

from tests.integration.api.conftest import Deployment


def run(client: httpx.Client, path: str, code: str, **body: Any) -> list[tuple[str, Any]]:
    events: list[tuple[str, Any]] = []
    with client.stream("POST", path, json={"code": code, **body}) as answer:
        assert answer.status_code == 200, answer.read()
        kind = None
        for line in answer.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append((str(kind), json.loads(line[len("data: ") :])))
    assert events and events[-1][0] == "end", events
    return events


def of(events: list[tuple[str, Any]], kind: str) -> list[Any]:
    return [body for name, body in events if name == kind]


@contextlib.contextmanager
def running(
    client: httpx.Client, path: str, code: str, *, timeout: float, until: str
) -> Iterator[Iterator[str]]:
    """A run in progress: its stream's lines, read up to the first with `until` in it."""
    with client.stream("POST", path, json={"code": code, "timeout": timeout}) as answer:
        lines = answer.iter_lines()
        assert any(until in line for line in lines)
        yield lines


def test_state_results_errors_and_isolation(alpha: httpx.Client, sandbox: str) -> None:
    base = f"/api/v1/sandboxes/{sandbox}"
    created = alpha.post(f"{base}/contexts", json={"language": "python"})
    assert created.status_code == 201, created.text
    ctx = created.json()["id"]
    assert run(alpha, f"{base}/contexts/{ctx}/run", "x = 41")[-1][1]["execution_count"] == 1
    events = run(alpha, f"{base}/contexts/{ctx}/run", "print('out'); x + 1")
    assert of(events, "stdout") == [
        {"text": "out\n", "timestamp": of(events, "stdout")[0]["timestamp"]}
    ]
    (main,) = of(events, "result")
    assert main["is_main_result"] is True and main["text"] == "42"
    error = of(run(alpha, f"{base}/contexts/{ctx}/run", "1/0"), "error")[0]
    assert error["name"] == "ZeroDivisionError" and "division by zero" in error["value"]
    plot = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()"
    (figure,) = of(run(alpha, f"{base}/contexts/{ctx}/run", plot), "result")
    assert figure["is_main_result"] is False and figure["png"].startswith("iVBOR")
    html = "from IPython.display import HTML, display\ndisplay(HTML('<b>hi</b>'))"
    assert of(run(alpha, f"{base}/contexts/{ctx}/run", html), "result")[0]["html"] == "<b>hi</b>"
    env = run(
        alpha, f"{base}/contexts/{ctx}/run", "import os; os.environ['ONLY']", env={"ONLY": "here"}
    )
    assert of(env, "result")[0]["text"] == "'here'"
    gone = run(alpha, f"{base}/contexts/{ctx}/run", "import os; os.environ.get('ONLY')")
    assert of(gone, "result") == [], "env applies to its own run only"
    # the default context is another interpreter
    default = run(alpha, f"{base}/run-code", "x")
    assert of(default, "error")[0]["name"] == "NameError"
    assert default[-1][1]["context"] == "default"
    listed = {c["id"] for c in alpha.get(f"{base}/contexts").json()}
    assert listed == {ctx, "default"}


def test_timeouts_interrupt_and_restart_forgets(alpha: httpx.Client, sandbox: str) -> None:
    base = f"/api/v1/sandboxes/{sandbox}"
    ctx = alpha.post(f"{base}/contexts", json={}).json()["id"]
    run(alpha, f"{base}/contexts/{ctx}/run", "kept = 1")
    started = time.monotonic()
    late = run(alpha, f"{base}/contexts/{ctx}/run", "while True: pass", timeout=1)
    assert time.monotonic() - started < 20
    assert of(late, "error")[0]["name"] == "TimeoutError"
    # interrupted, not killed: the context still has its state
    assert of(run(alpha, f"{base}/contexts/{ctx}/run", "kept"), "result")[0]["text"] == "1"
    # a kernel that dies says so, and a restart brings a fresh one
    died = run(alpha, f"{base}/contexts/{ctx}/run", "import os; os._exit(1)", timeout=10)
    assert of(died, "error") and of(died, "error")[0]["name"] in ("KernelDied", "TimeoutError")
    assert alpha.post(f"{base}/contexts/{ctx}/restart").status_code == 200
    fresh = run(alpha, f"{base}/contexts/{ctx}/run", "kept")
    assert of(fresh, "error")[0]["name"] == "NameError"
    assert alpha.delete(f"{base}/contexts/{ctx}").status_code == 204
    # its process has exited when the delete answers
    assert ctx not in {c["id"] for c in alpha.get(f"{base}/contexts").json()}
    missing = alpha.post(f"{base}/contexts/{ctx}/run", json={"code": "1"})
    assert missing.status_code == 404


def test_bad_input(
    alpha: httpx.Client, beta: httpx.Client, sandbox: str, deployment: Deployment
) -> None:
    base = f"/api/v1/sandboxes/{sandbox}"
    assert alpha.post(f"{base}/contexts", json={"language": "cobol"}).status_code == 422
    ctx = alpha.post(f"{base}/contexts", json={}).json()["id"]
    # another tenant cannot see the sandbox, let alone its context
    theirs = beta.post(f"{base}/contexts/{ctx}/run", json={"code": "1"})
    assert theirs.status_code == 404
    other = alpha.post("/api/v1/sandboxes", json={}).json()["name"]
    try:
        elsewhere = alpha.post(f"/api/v1/sandboxes/{other}/contexts/{ctx}/run", json={"code": "1"})
        assert elsewhere.status_code == 404, "a context is its own sandbox's"
    finally:
        alpha.delete(f"/api/v1/sandboxes/{other}")
    too_long = alpha.post(f"{base}/contexts/{ctx}/run", json={"code": "1", "timeout": 10**9})
    assert too_long.status_code == 400
    assert alpha.post(f"{base}/contexts/{ctx}/run", json={}).status_code == 422


def test_a_client_that_goes_away_interrupts_its_run(alpha: httpx.Client, sandbox: str) -> None:
    base = f"/api/v1/sandboxes/{sandbox}"
    ctx = alpha.post(f"{base}/contexts", json={}).json()["id"]
    run(alpha, f"{base}/contexts/{ctx}/run", "state = 'kept'")
    code = "import time\nprint('looping', flush=True)\nwhile True: time.sleep(0.05)"
    with alpha.stream(
        "POST", f"{base}/contexts/{ctx}/run", json={"code": code, "timeout": 600}
    ) as answer:
        for line in answer.iter_lines():
            if "looping" in line:
                break  # and hang up: the run's only client is gone
    started = time.monotonic()
    after = run(alpha, f"{base}/contexts/{ctx}/run", "state", timeout=60)
    # without the interrupt this run would wait behind the loop for its 600 s
    assert time.monotonic() - started < 30
    assert of(after, "result")[0]["text"] == "'kept'"


def test_a_bash_context_keeps_its_shell(alpha: httpx.Client, sandbox: str) -> None:
    base = f"/api/v1/sandboxes/{sandbox}"
    made = alpha.post(f"{base}/contexts", json={"language": "bash"})
    assert made.status_code == 201, made.text
    ctx = made.json()["id"]
    assert made.json()["language"] == "bash"
    run(alpha, f"{base}/contexts/{ctx}/run", "kept=5; cd /tmp; export MINE=yes")
    seen = run(alpha, f"{base}/contexts/{ctx}/run", "echo $kept $(pwd) $MINE; echo oops >&2")
    assert "".join(e["text"] for e in of(seen, "stdout")) == "5 /tmp yes\n"
    assert "".join(e["text"] for e in of(seen, "stderr")) == "oops\n"
    assert seen[-1][1]["execution_count"] == 2
    failed = run(alpha, f"{base}/contexts/{ctx}/run", "ls /no/such/dir")
    assert of(failed, "error")[0]["name"] == "CommandExitError"
    assert of(failed, "error")[0]["value"] == "exit status 2"
    only = run(alpha, f"{base}/contexts/{ctx}/run", "echo $ONLY", env={"ONLY": "this run"})
    assert of(only, "stdout")[0]["text"] == "this run\n"
    later = run(alpha, f"{base}/contexts/{ctx}/run", "echo [$ONLY]; cat; echo read-done")
    assert "".join(e["text"] for e in of(later, "stdout")) == "[]\nread-done\n", "no stdin"
    slow = run(alpha, f"{base}/contexts/{ctx}/run", "sleep 60", timeout=1)
    assert of(slow, "error")[0]["name"] == "TimeoutError"
    alive = run(alpha, f"{base}/contexts/{ctx}/run", "echo $kept")
    assert of(alive, "stdout")[0]["text"] == "5\n", "an interrupt stops the command, not the shell"
    gone = run(alpha, f"{base}/contexts/{ctx}/run", "echo bye; exit 4")
    assert of(gone, "error")[0]["name"] == "KernelDied"
    assert alpha.post(f"{base}/contexts/{ctx}/restart").status_code == 200
    fresh = run(alpha, f"{base}/contexts/{ctx}/run", "echo [$kept] $(pwd)")
    assert of(fresh, "stdout")[0]["text"] == "[] /workspace\n"
    # a run without a context id goes to the default context of its language
    default = run(alpha, f"{base}/run-code", "echo default; d=1", language="bash")
    assert default[-1][1]["context"] == "default-bash"
    assert (
        of(run(alpha, f"{base}/run-code", "echo $d", language="bash"), "stdout")[0]["text"] == "1\n"
    )
    languages = {c["id"]: c["language"] for c in alpha.get(f"{base}/contexts").json()}
    assert languages[ctx] == "bash" and languages["default-bash"] == "bash"
    alpha.delete(f"{base}/contexts/{ctx}")


def test_code_that_ignores_its_interrupt_has_its_kernel_restarted(
    alpha: httpx.Client, sandbox: str
) -> None:
    """A time limit holds for code that ignores KeyboardInterrupt: its kernel is restarted
    KILL_GRACE seconds after the interrupt, and a run waiting behind it gets its turn then
    (a client's 30 s read timeout once ran out waiting)."""
    base = f"/api/v1/sandboxes/{sandbox}"
    ctx = alpha.post(f"{base}/contexts", json={}).json()["id"]
    path = f"{base}/contexts/{ctx}/run"
    run(alpha, path, "kept = 1")
    stubborn = (
        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "print('stuck', flush=True)\ntime.sleep(300)"
    )
    started = time.monotonic()
    with running(alpha, path, stubborn, timeout=1, until="stuck") as lines:
        # the next run, behind it in the context, from another client
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            with httpx.Client(
                base_url=str(alpha.base_url), headers=alpha.headers, timeout=60
            ) as other:
                behind = pool.submit(run, other, path, "after = 2; after")
                rest = list(lines)  # the first run to its end
                after = behind.result(timeout=60)
    # without the restart the first run would hold the context for its 300 s
    assert time.monotonic() - started < 60
    assert "".join(rest).count("KernelRestarted") == 1, rest
    assert any("TimeoutError" in line for line in rest)
    assert of(after, "result")[0]["text"] == "2", after
    # a fresh kernel: what the context held before is gone, and it runs on
    fresh = run(alpha, path, "kept")
    assert of(fresh, "error")[0]["name"] == "NameError"
    assert of(run(alpha, path, "after + 1"), "result")[0]["text"] == "3"


def test_bash_commands_that_ignore_their_interrupt_get_a_fresh_shell(
    alpha: httpx.Client, sandbox: str
) -> None:
    base = f"/api/v1/sandboxes/{sandbox}"
    ctx = alpha.post(f"{base}/contexts", json={"language": "bash"}).json()["id"]
    run(alpha, f"{base}/contexts/{ctx}/run", "kept=5")
    started = time.monotonic()
    stuck = run(alpha, f"{base}/contexts/{ctx}/run", "trap '' INT; sleep 300", timeout=1)
    assert time.monotonic() - started < 60
    assert [e["name"] for e in of(stuck, "error")] == ["TimeoutError", "KernelRestarted"]
    # the new shell's output is its own (the killed one's readers end in their own queue)
    for _ in range(3):
        fresh = run(alpha, f"{base}/contexts/{ctx}/run", "echo [$kept]")
        assert of(fresh, "error") == [] and of(fresh, "stdout")[0]["text"] == "[]\n", fresh


def test_a_run_right_after_an_interrupt_is_run_not_aborted(
    alpha: httpx.Client, sandbox: str
) -> None:
    """ipykernel aborts what reaches it just after an interrupted or failed cell
    (stop_on_error): a run sent as soon as its client's previous run was interrupted came back
    with no output and no count (1 in 15 here, on a loaded machine). The bridge sends each run
    alone, so it asks for no abort."""
    base = f"/api/v1/sandboxes/{sandbox}"
    path = f"{base}/contexts/{alpha.post(f'{base}/contexts', json={}).json()['id']}/run"
    run(alpha, path, "n = 0")
    looping = "import time\nprint('looping', flush=True)\nwhile True: time.sleep(0.05)"
    for expected in range(1, 26):
        with running(alpha, path, looping, timeout=600, until="looping"):
            pass  # and hang up: the server interrupts the loop
        after = run(alpha, path, "n += 1; n", timeout=60)
        assert after[-1][1]["execution_count"] is not None, after
        assert of(after, "result")[0]["text"] == str(expected), after


def test_a_restart_is_failed_only_by_its_own_error(alpha: httpx.Client, sandbox: str) -> None:
    """A line the context's bridge rejects while its kernel restarts (someone wrote to its
    stdin) is an error of no run too: it was taken for the restart failing (502)."""
    base = f"/api/v1/sandboxes/{sandbox}"
    ctx = alpha.post(f"{base}/contexts", json={}).json()["id"]
    listed = alpha.get(f"{base}/toolbox/processes").json()["processes"]
    bridge = next(p["pid"] for p in listed if f"--context {ctx}" in p["command"])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        restarting = pool.submit(alpha.post, f"{base}/contexts/{ctx}/restart")
        time.sleep(0.2)  # the restart is under way: a kernel takes about a second to start
        junk = alpha.post(f"{base}/toolbox/processes/{bridge}/stdin", content=b"not json\n")
        assert junk.status_code == 200, junk.text
        restarted = restarting.result(timeout=90)
    assert restarted.status_code == 200, restarted.text
    assert alpha.delete(f"{base}/contexts/{ctx}").status_code == 204


def test_a_context_killed_while_its_kernel_restarts_is_the_workers_error(
    alpha: httpx.Client, sandbox: str
) -> None:
    """A bridge killed during a restart (the memory limit, most often: a kernel starting
    takes ~100 MiB) answered 409 "ended while restarting", as for a context deleted then:
    it is a 502 that says it was killed and what a kernel needs room for."""
    base = f"/api/v1/sandboxes/{sandbox}"
    ctx = alpha.post(f"{base}/contexts", json={}).json()["id"]
    listed = alpha.get(f"{base}/toolbox/processes").json()["processes"]
    bridge = next(p["pid"] for p in listed if f"--context {ctx}" in p["command"])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        restarting = pool.submit(alpha.post, f"{base}/contexts/{ctx}/restart", timeout=90)
        time.sleep(0.2)  # the restart is under way: a kernel takes about a second to start
        killed = alpha.post(f"{base}/toolbox/processes/{bridge}/signal", json={"signal": "SIGKILL"})
        assert killed.status_code in (200, 204), killed.text
        restarted = restarting.result(timeout=90)
    assert restarted.status_code == 502, restarted.text
    error = restarted.json()["error"]
    assert error["code"] == "worker_error"
    assert "killed (signal 9)" in error["message"] and "resources.memory_mb" in error["message"]
