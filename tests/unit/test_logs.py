"""The CLI's log formats: a JSON line carries the event and its structured fields."""

from __future__ import annotations

import json
import logging

import pytest

from sandgate.cli import logs


def test_json_format_writes_one_object_per_record(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    monkeypatch.setenv("SANDGATE_LOG_FORMAT", "json")
    try:
        logs.setup("INFO")
        logging.getLogger("sandgate.test").info("sandbox.started", extra={"sandbox": "s-1"})
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    record = json.loads(capsys.readouterr().err)
    assert record["message"] == "sandbox.started" and record["sandbox"] == "s-1"
    assert record["level"] == "INFO" and record["logger"] == "sandgate.test"


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log format 'xml'"):
        logs.setup("INFO", "xml")
