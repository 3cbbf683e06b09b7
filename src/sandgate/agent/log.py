"""The agent's log: one line per event on its stderr, which the worker keeps as the sandbox's
agent log. Below every other module of the agent, so any of them may log.
"""

from __future__ import annotations

import os
import sys


def log(message: str) -> None:
    """One line on the agent's stderr (the worker keeps it as the sandbox's agent log)."""
    try:
        sys.stderr.write(f"sandgate-agent[{os.getpid()}]: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
