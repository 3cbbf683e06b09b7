"""Reading back a worker's log as records: a worker started with SANDGATE_LOG_FORMAT=json
logs one JSON object a line (src/sandgate/cli/logs.py). The e2e cluster and the API
deployment both start their workers so and count what they started from these records."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON records of the log at `path`; any other line (what a crash prints before
    logging is set up) is skipped."""
    records: list[dict[str, Any]] = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def sandboxes(records: list[dict[str, Any]], event: str) -> Counter[str]:
    """How many times `event` (e.g. sandbox.started) was logged, per sandbox name."""
    return Counter(
        str(r["sandbox"]) for r in records if r.get("message") == event and "sandbox" in r
    )
