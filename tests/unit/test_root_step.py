"""The root step of a sandbox's launch chain (worker/root_step.py), run for real by /bin/sh:
what it leaves behind for the command it execs, and how each of its steps fails. Regular
files stand in for `cgroup.procs` and a small script for `mount`."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from sandgate.worker import root_step

REPORT = (
    "import json, os, resource; "
    "print(json.dumps({'pid': os.getpid(), 'nofile': resource.getrlimit(resource.RLIMIT_NOFILE),"
    " 'env': dict(os.environ)}))"
)


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, env={}, cwd="/", timeout=30)


def fake_mount(tmp_path: Path, code: int) -> Path:
    script = tmp_path / "mount"
    script.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/mount.args\nexit {code}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_it_joins_limits_and_execs_the_command_as_itself(tmp_path: Path) -> None:
    procs = [tmp_path / "cpu.procs", tmp_path / "memory.procs"]
    argv = root_step.root_step_argv(procs, 321, None, [sys.executable, "-c", REPORT])
    done = run(argv)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    # the exec'd command is the process that joined: the same pid in every group
    assert [int(p.read_text()) for p in procs] == [seen["pid"], seen["pid"]]
    assert seen["nofile"] == [321, 321]  # soft and hard: it cannot raise its own
    assert "PWD" not in seen["env"] and "OLDPWD" not in seen["env"]


def test_it_moves_the_disk_then_goes_on(tmp_path: Path) -> None:
    mount = fake_mount(tmp_path, 0)
    argv = root_step.root_step_argv(
        [], 64, (Path("/proc/1/fd/7"), Path("/sb/disk")), [sys.executable, "-c", REPORT]
    )
    at = argv.index("move")
    argv[at + 1] = str(mount)  # the real one would move a real mount
    done = run(argv)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "mount.args").read_text() == "-c --move /proc/1/fd/7 /sb/disk\n"
    assert json.loads(done.stdout)["nofile"] == [64, 64]


def test_each_step_that_fails_stops_the_chain_with_its_code(tmp_path: Path) -> None:
    never = [sys.executable, "-c", f"open({str(tmp_path / 'ran')!r}, 'w')"]

    joined = run(root_step.root_step_argv([tmp_path / "no" / "procs"], 64, None, never))
    assert joined.returncode == 97
    assert f"sandgate: cannot join cgroup {tmp_path}/no/procs" in joined.stderr

    too_many = int(Path("/proc/sys/fs/nr_open").read_text()) + 1
    limited = run(root_step.root_step_argv([], too_many, None, never))
    assert limited.returncode == 98
    assert f"sandgate: cannot set the descriptor limit {too_many}" in limited.stderr

    argv = root_step.root_step_argv([], 64, (Path("/x"), Path("/y")), never)
    argv[argv.index("move") + 1] = str(fake_mount(tmp_path, 32))
    assert run(argv).returncode == 125
    assert not (tmp_path / "ran").exists()
    assert os.path.exists(tmp_path / "mount.args")  # it was tried
