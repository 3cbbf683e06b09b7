"""The launcher that `sandgate up`, the benchmarks and the fixtures start sandgate with."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sandgate.cli import launch


def test_worker_argv_is_the_cli_an_operator_types() -> None:
    argv = launch.worker_argv(
        "http://h:1", "w1", runtime="process", capacity=4, state_dir=Path("/s"), extra=("--x",)
    )
    assert argv == [
        sys.executable, "-m", "sandgate", "worker", "--server", "http://h:1", "--name", "w1",
        "--runtime", "process", "--capacity", "4", "--state-dir", "/s", "--x",
    ]  # fmt: skip
    assert "--capacity" not in launch.worker_argv("u", "n", runtime="bwrap", state_dir="/s")
    assert launch.server_argv("--db", "d") == [
        sys.executable,
        "-m",
        "sandgate",
        "server",
        "--db",
        "d",
    ]


def test_child_env_faults_none_inherits_empty_clears(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDGATE_FAULTS", "inherited")
    assert launch.child_env()["SANDGATE_FAULTS"] == "inherited"
    assert "SANDGATE_FAULTS" not in launch.child_env(faults="")
    env = launch.child_env(token="t", faults="hang-start")
    assert env["SANDGATE_FAULTS"] == "hang-start" and env["SANDGATE_TOKEN"] == "t"


def test_a_child_that_exits_fails_the_wait_naming_its_log(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    proc = launch.start([sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"], log=log)
    with pytest.raises(launch.LaunchError) as failed:
        launch.wait_for(lambda: False, what="the child", proc=proc, log=log, timeout=20)
    message = str(failed.value)
    assert "exited with 3" in message and str(log) in message and "bad flag" in message
