"""Isolation probes run inside a real bwrap sandbox through the API."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from tests.integration.api.conftest import RUNTIME, Deployment
from tests.integration.api.test_code_contexts import of
from tests.integration.api.test_code_contexts import run as run_code
from tests.integration.api.test_exec_jobs import wait_done

pytestmark = pytest.mark.skipif(RUNTIME != "bwrap", reason="isolation needs the bwrap runtime")


def run(
    client: httpx.Client, name: str, code: str, language: str = "bash", timeout: float = 30
) -> dict:  # type: ignore[type-arg]
    response = client.post(
        f"/api/v1/sandboxes/{name}/execute",
        json={"code": code, "language": language, "timeout": timeout},
    )
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def test_no_network(alpha: httpx.Client, sandbox: str) -> None:
    probe = run(
        alpha,
        sandbox,
        "import socket\n"
        "for host, port in (('127.0.0.1', 5432), ('1.1.1.1', 53), ('10.0.0.1', 80)):\n"
        "    s = socket.socket(); s.settimeout(2)\n"
        "    try:\n        s.connect((host, port)); print('CONNECTED', host)\n"
        "    except OSError as e:\n        print('blocked', host, e.errno)\n"
        "import os\n"
        "print(sorted(os.listdir('/sys/class/net')) if os.path.exists('/sys/class/net') else '')",
        language="python",
    )
    assert "CONNECTED" not in probe["stdout"]
    assert probe["stdout"].count("blocked") == 3


def test_host_processes_invisible_and_hostname(alpha: httpx.Client, sandbox: str) -> None:
    out = run(
        alpha,
        sandbox,
        "ls /proc | grep -E '^[0-9]+$' | wc -l; hostname; cat /proc/1/cmdline | tr '\\0' ' '",
    )
    lines = out["stdout"].splitlines()
    assert int(lines[0]) < 10  # only the sandbox's own few processes
    assert lines[1] == sandbox
    assert "postgres" not in run(alpha, sandbox, "ps -eo args")["stdout"]


def test_root_is_read_only_and_workspace_writable(alpha: httpx.Client, sandbox: str) -> None:
    out = run(
        alpha,
        sandbox,
        "for f in /usr/x /etc/x /x /opt/sandgate/x /bin/x; do"
        " touch $f 2>/dev/null && echo WROTE $f; done;"
        " touch /workspace/ok /tmp/ok && echo fine",
    )
    assert "WROTE" not in out["stdout"]
    assert out["stdout"].strip().endswith("fine")


def test_no_privileges(alpha: httpx.Client, sandbox: str) -> None:
    status = run(
        alpha, sandbox, "grep -E '^(Uid|CapEff|CapPrm|NoNewPrivs|Seccomp):' /proc/self/status"
    )
    fields = dict(line.split(":", 1) for line in status["stdout"].splitlines())
    assert fields["CapEff"].strip() == "0000000000000000"
    assert fields["CapPrm"].strip() == "0000000000000000"
    assert fields["NoNewPrivs"].strip() == "1"
    assert fields["Seccomp"].strip() == "2"
    assert fields["Uid"].split()[0] != "0"
    denied = run(
        alpha,
        sandbox,
        "unshare -U true 2>&1 && echo USERNS; unshare -m true 2>&1 && echo MOUNTNS;"
        " mount -t tmpfs x /tmp 2>&1 && echo MOUNTED; echo done",
    )
    for bad in ("USERNS", "MOUNTNS", "MOUNTED"):
        assert bad not in denied["stdout"]


def test_host_secrets_unreadable(alpha: httpx.Client, sandbox: str, deployment: Deployment) -> None:
    paths = [
        "/etc/shadow",
        "/root",
        "/home",
        "/work",
        str(deployment.data_dir),
        str(deployment.state_dir),
        "/var/lib/postgresql",
        os.path.expanduser("~"),
    ]
    out = run(
        alpha,
        sandbox,
        " ".join(f"ls -d {p} >/dev/null 2>&1 && echo VISIBLE {p};" for p in paths) + " echo end",
    )
    assert "VISIBLE" not in out["stdout"], out["stdout"]


def test_other_sandbox_files_unreachable(
    alpha: httpx.Client, beta: httpx.Client, sandbox: str, deployment: Deployment
) -> None:
    other = beta.post("/api/v1/sandboxes", json={}).json()["name"]
    try:
        run(beta, other, "echo secret-of-beta > /workspace/s.txt")
        out = run(
            alpha,
            sandbox,
            f"cat /workspace/../{other}/workspace/s.txt 2>&1; "
            f"find / -name s.txt -not -path '/proc/*' 2>/dev/null; echo end",
        )
        assert "secret-of-beta" not in out["stdout"]
    finally:
        beta.delete(f"/api/v1/sandboxes/{other}")


def test_proc_sys_unwritable(alpha: httpx.Client, sandbox: str) -> None:
    out = run(
        alpha,
        sandbox,
        "echo 50 > /proc/sys/vm/overcommit_ratio 2>/dev/null && echo WROTE;"
        " echo x > /proc/sys/kernel/hostname 2>/dev/null && echo WROTE2; echo end",
    )
    assert "WROTE" not in out["stdout"]


@contextmanager
def limited_sandbox(client: httpx.Client, **resources: int) -> Iterator[str]:
    """A sandbox with `resources` (`memory_mb`, `pids`), deleted after; the test is skipped
    where the worker does not enforce one of them."""
    workers = client.get("/api/v1/workers").json()["workers"]
    limits = next(w for w in workers if w["name"] == "w1")["features"].get("limits", {})
    for resource in resources:
        kind = resource.removesuffix("_mb")
        if not limits.get(kind):
            pytest.skip(f"the worker does not enforce {kind} limits on this host")
    made = client.post("/api/v1/sandboxes", json={"resources": resources})
    assert made.status_code == 201, made.text
    name = made.json()["name"]
    try:
        yield name
    finally:
        client.delete(f"/api/v1/sandboxes/{name}")


def test_memory_limit(alpha: httpx.Client, deployment: Deployment) -> None:
    with limited_sandbox(alpha, memory_mb=128) as name:
        out = run(
            alpha,
            name,
            "blocks = []\nfor i in range(64):\n"
            "    blocks.append(bytearray(16 << 20))\n    print(i, flush=True)",
            language="python",
        )
        assert out["exit_code"] != 0
        assert len(out["stdout"].split()) < 12  # killed well before 1 GiB
        assert run(alpha, name, "echo alive")["stdout"] == "alive\n"


def test_the_memory_limit_kills_the_users_processes_never_the_agent(alpha: httpx.Client) -> None:
    """Processes each smaller than the agent that fill the memory limit together: the kernel
    killed the largest process, the agent, and the sandbox was lost (error, code 137). What
    the agent starts now begins with a higher OOM score than the agent's own."""
    with limited_sandbox(alpha, memory_mb=128) as name:
        # the agent's score is lifted while it starts a process, this command's own start
        # too, which it may still be finishing when the command runs: read a moment later
        scores = run(alpha, name, "sleep 1; cat /proc/1/oom_score_adj /proc/self/oom_score_adj")
        assert scores["stdout"].split() == ["0", "500"]
        # 40 subshells of ~4 MiB each (the agent holds ~12): 160 MiB in a 128 MiB limit
        fill = (
            "for i in $(seq 40); do (x=$(head -c 4000000 /dev/zero | tr '\\0' a); sleep 30) & done"
        )
        filled = alpha.post(
            f"/api/v1/sandboxes/{name}/execute",
            json={"code": f"{fill}; sleep 8; echo done", "timeout": 60},
        )
        assert filled.status_code == 200, filled.text
        assert alpha.get(f"/api/v1/sandboxes/{name}").json()["state"] == "running"
        assert run(alpha, name, "echo alive")["stdout"] == "alive\n"


def test_a_command_killed_by_the_memory_limit_says_so(alpha: httpx.Client) -> None:
    """It answered exit code 137 and nothing else, as for any SIGKILL, which left the user
    to guess why. A SIGKILL that is not the limit's still says nothing of memory."""
    with limited_sandbox(alpha, memory_mb=128) as name:
        over = run(alpha, name, "b = bytearray(400 << 20)", language="python")
        assert (over["exit_code"], over["oom_killed"]) == (137, True), over
        shell = run(alpha, name, "python3 -c 'b = bytearray(400 << 20)'; echo after $?")
        assert shell["stdout"] == "after 137\n" and not shell["oom_killed"], shell  # it exited 0
        piped = run(alpha, name, "python3 -c 'b = bytearray(400 << 20)'")
        assert (piped["exit_code"], piped["oom_killed"]) == (137, True), piped
        killed = run(alpha, name, "kill -9 $$")
        assert (killed["exit_code"], killed["oom_killed"]) == (137, False), killed
        job = alpha.post(
            f"/api/v1/sandboxes/{name}/exec-jobs",
            json={"command": "python3 -c 'bytearray(400 << 20)'"},
        )
        assert job.status_code == 202, job.text
        done = wait_done(alpha, job.json()["id"])
        assert (done["state"], done["exit_code"]) == ("failed", 137), done
        assert "memory limit" in done["error"] and "resources.memory_mb" in done["error"], done
        assert alpha.get(f"/api/v1/sandboxes/{name}").json()["state"] == "running"


def test_a_kernel_with_no_memory_to_start_in_says_so(alpha: httpx.Client) -> None:
    """A code context's bridge killed by the memory limit while its kernel started answered
    409 "exited while starting", as if the context were being deleted meanwhile."""
    with limited_sandbox(alpha, memory_mb=32) as name:
        made = alpha.post(f"/api/v1/sandboxes/{name}/contexts", json={"language": "python"})
        assert made.status_code == 502, made.text
        assert "resources.memory_mb" in made.json()["error"]["message"]
        assert alpha.get(f"/api/v1/sandboxes/{name}").json()["state"] == "running"


def test_code_killed_by_the_memory_limit_says_so(alpha: httpx.Client) -> None:
    """A run whose kernel the memory limit killed ended with "the kernel died", which left
    the user to guess why."""
    with limited_sandbox(alpha, memory_mb=128) as name:
        ran = run_code(alpha, f"/api/v1/sandboxes/{name}/run-code", "b = bytearray(400 << 20)")
        died = of(ran, "error")
        assert died and died[0]["name"] == "KernelDied", ran
        assert "resources.memory_mb" in died[0]["value"], died
        assert alpha.get(f"/api/v1/sandboxes/{name}").json()["state"] == "running"


def test_pids_limit(alpha: httpx.Client) -> None:
    with limited_sandbox(alpha, pids=32) as name:
        out = run(
            alpha,
            name,
            "import os, time\n"
            "pids, refused = [], 0\n"
            "for i in range(100):\n"
            "    try:\n"
            "        pid = os.fork()\n"
            "    except BlockingIOError:\n"
            "        refused += 1\n"
            "        continue\n"
            "    if pid == 0:\n"
            "        time.sleep(30)\n"
            "        os._exit(0)\n"
            "    pids.append(pid)\n"
            "print(len(pids), refused)\n"
            "for pid in pids:\n"
            "    os.kill(pid, 9)\n",
            language="python",
            timeout=20,
        )
        started, refused = map(int, out["stdout"].split())
        assert started < 32, out
        assert refused > 0, out


def test_a_sandbox_at_its_process_limit_keeps_its_agent(alpha: httpx.Client) -> None:
    """Requests that found no idle agent thread while the sandbox's processes filled its
    pids limit once ended the agent (a thread is a task too: it could not start one) and
    the sandbox with it. Now they are refused (429, the limit named) until some processes
    end, and the sandbox serves again after."""
    with limited_sandbox(alpha, pids=32) as name:
        # children that outlive their parent: the agent's orphans, holding every pid for 4 s
        filled = run(
            alpha,
            name,
            "import os, time\n"
            "made = 0\n"
            "for i in range(100):\n"
            "    try:\n"
            "        pid = os.fork()\n"
            "    except BlockingIOError:\n"
            "        break\n"
            "    if pid == 0:\n"
            "        time.sleep(4)\n"
            "        os._exit(0)\n"
            "    made += 1\n"
            "print(made)\n",
            language="python",
        )
        assert 0 < int(filled["stdout"]) < 32, filled
        with ThreadPoolExecutor(6) as pool:
            answers = list(
                pool.map(
                    lambda _: alpha.post(
                        f"/api/v1/sandboxes/{name}/execute", json={"code": "echo ok"}
                    ),
                    range(6),
                )
            )
        refused = [a for a in answers if a.status_code == 429]
        assert refused and all(a.status_code in (200, 429) for a in answers), [
            (a.status_code, a.text) for a in answers
        ]
        assert refused[0].json()["error"]["limit"] == "pids" and refused[0].headers["Retry-After"]
        deadline = time.monotonic() + 20
        while True:  # the orphans end and are reaped: the sandbox serves again
            again = alpha.post(f"/api/v1/sandboxes/{name}/execute", json={"code": "echo ok"})
            if again.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert again.status_code == 200 and again.json()["stdout"] == "ok\n", again.text
        assert alpha.get(f"/api/v1/sandboxes/{name}").json()["state"] == "running"


def test_workers_report_enforced_features(alpha: httpx.Client) -> None:
    worker = next(w for w in alpha.get("/api/v1/workers").json()["workers"] if w["name"] == "w1")
    features = worker["features"]
    assert features["runtime"] == "bwrap"
    assert features["seccomp"] is True
    assert features["user_namespace"] is True
    assert features["network"] == "gate"  # the egress gate: root with nftables here


def test_tenant_code_cannot_reach_the_agent(alpha: httpx.Client, sandbox: str) -> None:
    """The agent runs as the tenant's uid; it must still be out of reach of tenant code. It is
    the sandbox's pid 1 (bwrap --as-pid-1): SIGKILL and SIGSTOP from inside do not reach it."""
    probe = run(
        alpha,
        sandbox,
        "import os, signal\n"
        "agent = '1'\n"
        "print('AGENT', b'/opt/sandgate/agent.py' in open('/proc/1/cmdline', 'rb').read())\n"
        "for sig in (signal.SIGKILL, signal.SIGSTOP):\n"
        "    os.kill(1, sig)\n"
        "for what in ('mem', 'fd/1', 'environ'):\n"
        "    try:\n"
        "        open(f'/proc/{agent}/{what}', 'rb').close(); print('OPENED', what)\n"
        "    except OSError as e:\n"
        "        print('denied', what, e.errno)\n"
        "try:\n"
        "    print('FDS', os.listdir(f'/proc/{agent}/fd'))\n"
        "except OSError as e:\n"
        "    print('denied fd-list', e.errno)\n",
        language="python",
    )
    assert probe["stdout"].startswith("AGENT True\n"), probe
    assert probe["stdout"].count("denied") == 4, probe
    assert "FDS" not in probe["stdout"], probe
    assert run(alpha, sandbox, "echo still-fine")["stdout"] == "still-fine\n"
