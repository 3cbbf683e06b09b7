"""The root step of a sandbox's launch chain: one `sh` that does, as root and in order, what
must be done before the uid drop, then execs the rest of its argv (setpriv, then bwrap).

1. it moves itself into each of the sandbox's cgroups (a write of its pid to each
   `cgroup.procs`), so that everything it becomes or starts is counted and limited there;
2. it sets the descriptor limit, soft and hard (`ulimit -n` sets both where neither -H nor
   -S is given), so that no process of the sandbox can raise it (`fds.py` has the rule);
3. with a detached disk, it moves the worker's mount into place in the chain's own mount
   namespace (`mount -c --move`: the fd's magic link must not be resolved, `loopmount.py`),
   so that the worker's mount table does not grow with the sandboxes.

One shell for the three instead of a shell, `prlimit` and another shell: every exec costs
about a millisecond on a VM, where the C library's start-up traps to the hypervisor
(docs/benchmarks.md, "Session 16").

A step that fails exits with its own code and says so on stderr (the sandbox's log): 97 a
cgroup, 98 the limit, 125 the move.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# argv: sh -c SCRIPT sandgate-start N procs_1 .. procs_N NOFILE MOVE [MOUNT SOURCE TARGET]
#       cmd args...   (MOVE is "move" or "-")
# sh exports PWD (its cwd) to what it execs even when started without one; unset it, so the
# command gets exactly the environment the caller gave sh.
SCRIPT = (
    "unset PWD OLDPWD; "
    'n=$1; shift; while [ "$n" -gt 0 ]; do '
    'echo $$ > "$1" || { echo "sandgate: cannot join cgroup $1" >&2; exit 97; }; '
    "shift; n=$((n - 1)); done; "
    'ulimit -n "$1" || { echo "sandgate: cannot set the descriptor limit $1" >&2; exit 98; }; '
    "shift; "
    'if [ "$1" = move ]; then "$2" -c --move "$3" "$4" || exit 125; shift 4; else shift; fi; '
    'exec "$@"'
)


def root_step_argv(
    procs_files: list[Path],
    nofile: int,
    move: tuple[Path, Path] | None,
    argv: list[str],
) -> list[str]:
    """The step's argv, then `argv`. `move`: (the detached mount's fd path, where it goes)."""
    if move is None:
        moving = ["-"]
    else:
        mount = shutil.which("mount") or "/usr/bin/mount"  # the chain runs with no PATH
        moving = ["move", mount, str(move[0]), str(move[1])]
    return [
        "/bin/sh",
        "-c",
        SCRIPT,
        "sandgate-start",
        str(len(procs_files)),
        *(str(p) for p in procs_files),
        str(nofile),
        *moving,
        *argv,
    ]
