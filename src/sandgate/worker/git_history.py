"""A workspace's history: a real git repository whose git directory the tenant never sees.

A workspace's image holds ``files/`` (the sandboxes' /workspace) and ``git/``. Git runs as the
storage uid, with a cleared environment and ``-c`` options that turn off everything able to
run a program or read the host's configuration: hooks, fsmonitor, external diffs, textconv,
pagers, transports. The tenant controls every byte under ``files/``, so more is needed:

- ``info/attributes`` (above any ``.gitattributes``) unsets filter, text, eol, ident and
  working-tree-encoding: files are stored and restored byte for byte, never converted.
- A nested repository (``files/proj/.git``) is what ``git add`` records as a gitlink, and
  once one is tracked every ``git add`` runs ``git status`` inside it, with the tenant's
  config (a clean filter there runs on the host). So the index never keeps a gitlink: it
  becomes the directory's files (minus what its ``.gitignore`` ignores), as a snapshot wants.
- Commits are made with plumbing (``write-tree``, ``commit-tree``, ``update-ref``), so no
  porcelain looks at the work tree beyond ``git add``.

Files above `LARGE_FILE_BYTES` are left out (``info/exclude``) and listed. Blocking: run it
in a thread; the caller holds the workspace's lock, and `check` says whether it still does.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from sandgate.errors import (
    ConflictError,
    DiskQuotaExceededError,
    InvalidRequestError,
    NotFoundError,
    SandgateError,
    WorkerError,
)

log = logging.getLogger(__name__)

LARGE_FILE_BYTES: Final = 32 << 20  # the size rule: files above this are not committed
MAX_MESSAGE = 4096  # chars of a commit message kept
MAX_SKIPPED_TRAILERS = 50
MAX_DEPTH = 400  # directories below the top a commit walks (os.fwalk recurses)
GIT_TIMEOUT = 60.0
SHOW_BUDGET = 10.0  # seconds a diff's line counts, then its patch, may take (then: cut)
BRANCH = "refs/heads/main"
JAIL_GIT = "/ws/git"  # where git sees the git dir and the tree, in its jail (`_jail`)
JAIL_FILES = "/ws/files"
# the repository's own config, written by the worker before each commit and restore
REPO_CONFIG = b"[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = false\n"
_GIT_FILE = re.compile(r"(info/)?[a-z]+")
EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"
STALE_LOCKS = ("index.lock", "HEAD.lock", "refs/heads/main.lock", "restore-index.lock")
ATTRIBUTES = b"* -text -eol -ident -filter -working-tree-encoding !diff\n"
# what git is run with: nothing of the host's environment or configuration, nothing it runs
_ENV = tuple(
    (
        "GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null GIT_ATTR_NOSYSTEM=1 HOME=/nonexistent "
        "GIT_TERMINAL_PROMPT=0 LC_ALL=C TZ=UTC PATH=/usr/bin:/bin GIT_LITERAL_PATHSPECS=1 "
        "GIT_COMMITTER_NAME=sandgate GIT_COMMITTER_EMAIL=sandgate@localhost"
    ).split()
)
_CONFIG = tuple(
    (
        "core.hooksPath=/dev/null core.fsmonitor=false core.untrackedCache=false safe.directory=* "
        "core.symlinks=true core.quotePath=false gc.autoDetach=false commit.gpgSign=false "
        "protocol.allow=never submodule.recurse=false diff.external= core.pager=cat "
        "diff.ignoreSubmodules=all status.submoduleSummary=false core.bigFileThreshold=1m"
    ).split()
)
# what the tenant's files may say (a .gitmodules, a .gitattributes), not damage: fsck ignores it
_FSCK_CONTENT = tuple(
    arg
    for kind, whats in (
        ("gitmodules", "Blob Large Missing Name Parse Path Symlink Update Url"),
        ("gitattributes", "Blob Large LineLength Missing Symlink"),
    )
    for what in whats.split()
    for arg in ("-c", f"fsck.{kind}{what}=ignore")
)
_REMOVE = ("update-index", "-z", "--force-remove", "--stdin")  # paths on stdin
_NO_DIFF_DRIVERS = ("--no-ext-diff", "--no-textconv", "--no-renames", "--no-color")
_HEX = re.compile(r"[0-9a-fA-F]{4,40}")
_TRAILER_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_REFUSED = re.compile(rb"error: invalid path '(.+?)'\n")
_UNREADABLE = re.compile(rb"(?:open\(\"(.+?)\"\)|could not open directory '(.+?)'): Permission")
_QUOTA_FULL = (b"No space left on device", b"Disk quota exceeded", b"Out of diskspace")


@dataclass(frozen=True)
class Author:
    name: str  # the tenant id
    email: str


@dataclass(frozen=True)
class CommitInfo:
    sha: str
    parents: tuple[str, ...]
    author_name: str
    author_email: str
    date: str  # ISO 8601, the author date
    message: str  # subject, body and trailers

    def to_json(self) -> dict[str, Any]:
        author = {"name": self.author_name, "email": self.author_email}
        return {
            "sha": self.sha,
            "parents": list(self.parents),
            "author": author,
            "date": self.date,
            "message": self.message,
        }


@dataclass(frozen=True)
class SkippedFile:
    path: str
    size: int


@dataclass(frozen=True)
class CommitResult:
    commit: CommitInfo  # the new commit, or HEAD when nothing changed
    created: bool
    skipped: tuple[SkippedFile, ...]  # files left out by the size rule

    def to_json(self) -> dict[str, Any]:
        skipped = [{"path": s.path, "size": s.size} for s in self.skipped]
        return {"commit": self.commit.to_json(), "created": self.created, "skipped": skipped}


@dataclass(frozen=True)
class FileStat:
    path: str
    added: int | None  # None for a binary file
    deleted: int | None

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "added": self.added, "deleted": self.deleted}


@dataclass(frozen=True)
class CommitDiff:
    commit: CommitInfo
    files: tuple[FileStat, ...]  # against the first parent (the root: the empty tree)
    patch: str
    truncated: bool  # patch cut at max_patch_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "commit": self.commit.to_json(),
            "files": [f.to_json() for f in self.files],
            "patch": self.patch,
            "truncated": self.truncated,
        }


@dataclass(frozen=True)
class _Scan:
    skipped: tuple[tuple[str, int], ...]  # (path as the file system spells it, size)
    special: tuple[str, ...]  # fifos, sockets, devices: git cannot add them
    nested: bool  # a `.git` below the top: there may be gitlinks to flatten


def _display(path: str) -> str:
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _one_line(text: str) -> str:
    return _CONTROL.sub("?", text)


def _pattern(path: str) -> bytes:
    """An anchored info/exclude pattern for exactly `path`; a newline or CR (not expressible
    in a line) becomes ``?``, which may also leave out a same-named sibling."""
    escaped = re.sub(r"([\\*?\[\]!# ])", r"\\\1", path)
    return os.fsencode("/" + re.sub(r"[\n\r]", "?", escaped))


def _verb(args: tuple[str, ...]) -> str:
    return next((a for a in args if not a.startswith("-")), "")


def _count(numstat: str) -> int | None:
    return None if numstat == "-" else int(numstat)


def _lstat_mode(name: str, dirfd: int) -> int:
    try:
        return os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode
    except FileNotFoundError:  # the sandbox removed it meanwhile
        return 0


def _nul_list(paths: Iterable[str]) -> bytes:
    return b"".join(os.fsencode(p) + b"\0" for p in paths)


def _message(message: str, trailers: Iterable[tuple[str, str]]) -> bytes:
    """The commit message: at most MAX_MESSAGE chars of the user's, then the trailers."""
    text = message.replace("\0", "")[:MAX_MESSAGE].strip() or "Snapshot"
    lines = []
    for key, value in trailers:
        if not _TRAILER_KEY.fullmatch(key):
            raise InvalidRequestError(f"trailer {key!r} is not a token: use letters, digits and -")
        lines.append(f"{key}: {_one_line(value)}")
    if lines:
        text += "\n\n" + "\n".join(lines)
    return (text + "\n").encode("utf-8", "replace")


class _TookTooLong(WorkerError):
    """A git call ran past its time."""


def _quota_full() -> DiskQuotaExceededError:
    return DiskQuotaExceededError(
        "the workspace's disk quota is full: delete files in /workspace or raise its quota_mb, "
        "then try again"
    )


def _failure(what: str, stderr: bytes) -> SandgateError:
    if any(marker in stderr for marker in _QUOTA_FULL):
        return _quota_full()
    if found := _UNREADABLE.search(stderr):
        path = (found.group(1) or found.group(2) or b"").decode("utf-8", "replace").rstrip("/")
        return InvalidRequestError(
            f"{path!r} in /workspace cannot be read: make it readable (chmod u+rwX) and try again"
        )
    if found := _REFUSED.search(stderr):
        return InvalidRequestError(
            f"git cannot keep {found.group(1).decode(errors='replace')!r} in the workspace's "
            "history (it refuses .git in any case, git~1, a .gitmodules symlink): rename it "
            "and try again"
        )
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    return WorkerError(
        f"git {what} failed in the workspace ({lines[-1] if lines else 'no message'}): try "
        "again; if it keeps failing, tell the operator the workspace's history needs a look"
    )


class GitHistory:
    def __init__(
        self,
        git_dir: Path,
        work_tree: Path,
        *,
        uid: int,
        gid: int,
        large_file_bytes: int = LARGE_FILE_BYTES,
        check: Callable[[], None] = lambda: None,
    ) -> None:
        self.git_dir = git_dir.absolute()
        self.work_tree = work_tree.absolute()
        self.uid, self.gid = uid, gid
        self.large_file_bytes = large_file_bytes
        self.check = check

    # -- running git

    def _jail(self) -> list[str]:
        """What every program on the repository runs in: a mount namespace holding this
        workspace alone (its git dir at /ws/git, its tree at /ws/files) and the host's /usr
        read-only, no network, as the storage uid with no capabilities. A link the tenant
        swaps in while git walks the tree can reach nothing but the workspace itself."""
        lib64 = ["--symlink", "usr/lib64", "/lib64"] if os.path.isdir("/usr/lib64") else []
        return [
            "/usr/bin/nice",
            "-n",
            "10",
            "/usr/bin/bwrap",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--new-session",
            "--ro-bind",
            "/usr",
            "/usr",
            "--symlink",
            "usr/bin",
            "/bin",
            "--symlink",
            "usr/lib",
            "/lib",
            *lib64,
            "--dev",
            "/dev",
            "--perms",
            "1777",
            "--tmpfs",
            "/tmp",
            "--perms",
            "0755",
            "--dir",
            "/ws",
            "--bind",
            str(self.git_dir),
            JAIL_GIT,
            "--bind",
            str(self.work_tree),
            JAIL_FILES,
            "--remount-ro",
            "/",
            "--chdir",
            JAIL_FILES,
            "--",
            "/usr/bin/setpriv",
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            "--clear-groups",
            "--no-new-privs",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--",
        ]

    def _spawn(
        self, argv: list[str], stdin: int, stderr: Any, env: Mapping[str, str]
    ) -> subprocess.Popen[bytes]:
        base = dict(kv.split("=", 1) for kv in _ENV)
        base |= {"GIT_DIR": JAIL_GIT, "GIT_WORK_TREE": JAIL_FILES}
        try:
            return subprocess.Popen(
                [*self._jail(), *argv],
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env={**base, **env},
                cwd="/",
                umask=0o022,
            )
        except OSError as exc:
            raise WorkerError(f"cannot run git ({exc}): tell the operator git is missing") from exc

    def _popen(
        self, args: tuple[str, ...], stdin: int, stderr: Any, env: Mapping[str, str]
    ) -> subprocess.Popen[bytes]:
        return self._spawn(
            ["git", *(a for option in _CONFIG for a in ("-c", option)), *args], stdin, stderr, env
        )

    def _sh(self, script: str, input: bytes = b"", args: tuple[str, ...] = ()) -> bytes:
        """A shell script in the jail (files of the git dir the worker keeps in order);
        `args` are its $1...: never spliced into the script."""
        argv = ["/bin/sh", "-c", script, "sh", *args]
        with self._spawn(argv, subprocess.PIPE, subprocess.PIPE, {}) as proc:
            try:
                out, err = proc.communicate(input, timeout=GIT_TIMEOUT)
            except subprocess.TimeoutExpired as exc:
                proc.kill()
                proc.communicate()
                raise WorkerError("keeping the workspace's history in order timed out") from exc
        if proc.returncode != 0:
            raise _failure("maintenance", err)
        return out

    def _run(
        self,
        *args: str,
        input: bytes | None = None,
        env: Mapping[str, str] = {},
        ok: tuple[int, ...] = (0,),
        timeout: float = GIT_TIMEOUT,
    ) -> tuple[bytes, bytes]:
        stdin = subprocess.PIPE if input is not None else subprocess.DEVNULL
        with self._popen(args, stdin, subprocess.PIPE, env) as proc:
            try:
                out, err = proc.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired as exc:
                proc.kill()
                proc.communicate()
                raise _TookTooLong(
                    f"git {_verb(args)} took over {timeout:.0f} s: try again"
                ) from exc
        if proc.returncode not in ok:
            raise _failure(_verb(args), self._redact(err))
        return out, err

    def _redact(self, text: bytes) -> bytes:
        """Git's (or bwrap's) words without the host's paths of this workspace."""
        for path, seen in ((self.git_dir, JAIL_GIT), (self.work_tree, JAIL_FILES)):
            text = text.replace(os.fsencode(path), seen.encode())
        return text

    def _git(self, *args: str, input: bytes | None = None, env: Mapping[str, str] = {}) -> bytes:
        return self._run(*args, input=input, env=env)[0]

    def _step(self, *args: str, input: bytes | None = None, env: Mapping[str, str] = {}) -> bytes:
        """A step of commit/restore: taken only while the caller still holds its lock."""
        self.check()
        return self._git(*args, input=input, env=env)

    def _git_head(self, *args: str, limit: int, budget: float = GIT_TIMEOUT) -> tuple[bytes, bool]:
        """Git's output up to `limit` bytes (and whether there was more), never all in memory."""
        expired = threading.Event()
        with (
            tempfile.TemporaryFile() as err,
            self._popen(args, subprocess.DEVNULL, err, {}) as proc,
        ):

            def expire() -> None:
                expired.set()
                proc.kill()

            timer = threading.Timer(budget, expire)
            timer.start()
            try:
                assert proc.stdout is not None
                out = proc.stdout.read(limit + 1)
                if truncated := len(out) > limit:
                    proc.kill()
                proc.wait()
            finally:
                timer.cancel()
            if expired.is_set():  # what came within the budget, cut there
                return out[:limit], True
            if not truncated and proc.returncode != 0:
                err.seek(0)
                raise _failure(_verb(args), self._redact(err.read()))
        return out[:limit], truncated

    # -- files the worker writes into the git directory

    def _write_git_file(self, name: str, data: bytes) -> None:
        """Replace `name` in the git dir (in the jail: a link planted there reaches only the
        workspace itself)."""
        assert _GIT_FILE.fullmatch(name), name
        where = f"{JAIL_GIT}/{name}"
        self._sh(
            f'mkdir -p "$(dirname {where})" && rm -rf {where}.tmp && cat > {where}.tmp '
            f"&& mv -f -T {where}.tmp {where}",
            input=data,
        )

    def _write_info(self, name: str, data: bytes) -> None:
        self._write_git_file(f"info/{name}", data)

    def _clear_stale_locks(self) -> None:
        """The caller holds the only lock on the workspace: a lock file is a killed git's.
        The repository's config is written again too: nothing but the worker sets it."""
        names = " ".join([*STALE_LOCKS, "restore-index"])
        found = self._sh(
            f'cd {JAIL_GIT} && for n in {names}; do if [ -e "$n" ] || [ -L "$n" ]; then '
            'echo "$n"; rm -f "$n"; fi; done'
        )
        for name in found.decode(errors="replace").split():
            if name != "restore-index":
                event = "stale_index_lock" if name == "index.lock" else "stale_lock"
                log.warning("workspace.%s path=%s", event, f"git/{name}")
        self._write_git_file("config", REPO_CONFIG)

    # -- reading history

    def _resolve(self, rev: str) -> str:
        if not _HEX.fullmatch(rev):
            raise InvalidRequestError(f"{rev!r} is not a commit sha: give 4 to 40 hex digits")
        spec = f"{rev.lower()}^{{commit}}"
        out, _ = self._run("rev-parse", "-q", "--verify", "--end-of-options", spec, ok=(0, 1))
        if not out.strip():
            raise NotFoundError(
                f"no commit {rev} in this workspace's history: pick a sha from its log "
                "(a short sha may also be ambiguous: give more of it)",
                code="commit_not_found",
            )
        return out.decode().strip()

    def _commits(self, rev: str, count: int) -> list[CommitInfo]:
        fmt = "--format=%H%x1f%P%x1f%an%x1f%ae%x1f%aI%x1f%B"
        out = self._git("log", "-z", fmt, f"-n{count}", "--end-of-options", rev, "--")
        commits = []
        for record in out.split(b"\0"):
            if not record:
                continue
            sha, parents, name, email, date, text = record.decode(errors="replace").split("\x1f", 5)
            commits.append(CommitInfo(sha, tuple(parents.split()), name, email, date, text[:-1]))
        return commits

    def head(self) -> CommitInfo:
        return self._commits("HEAD", 1)[0]

    def log(
        self, *, limit: int = 50, start: str | None = None
    ) -> tuple[list[CommitInfo], str | None]:
        """Newest first from `start` (default HEAD), and the `start` of the next page."""
        if not 1 <= limit <= 500:
            raise InvalidRequestError(f"limit {limit} is out of range: ask for 1 to 500 commits")
        commits = self._commits(self._resolve(start) if start else "HEAD", limit + 1)
        more = commits[limit].sha if len(commits) > limit else None
        return commits[:limit], more

    def show(self, rev: str, *, max_patch_bytes: int = 1 << 20) -> CommitDiff:
        """A commit, what it changed (files, patch) against its first parent."""
        commit = self._commits(self._resolve(rev), 1)[0]
        trees = (commit.parents[0] if commit.parents else EMPTY_TREE, commit.sha)
        args = ("-r", *_NO_DIFF_DRIVERS, "--end-of-options", *trees, "--")
        files = []
        try:  # counting lines diffs every file: a tree made to be slow gets names only
            numstat = self._run("diff-tree", "-z", "--numstat", *args, timeout=SHOW_BUDGET)[0]
            records = [r.decode(errors="replace").split("\t", 2) for r in numstat.split(b"\0")]
            files = [FileStat(r[2], _count(r[0]), _count(r[1])) for r in records if len(r) == 3]
            counted = True
        except _TookTooLong:
            names = self._git("diff-tree", "-z", "--name-only", *args)
            files = [FileStat(os.fsdecode(n), None, None) for n in names.split(b"\0") if n]
            counted = False
        patch, truncated = (
            self._git_head(
                "diff-tree", "-p", *args, limit=max(0, max_patch_bytes), budget=SHOW_BUDGET
            )
            if counted
            else (b"", True)
        )
        return CommitDiff(commit, tuple(files), patch.decode("utf-8", "replace"), truncated)

    def fsck(self) -> str:
        """`git fsck --full --strict`'s output; WorkerError when it finds damage."""
        out, err = self._run(*_FSCK_CONTENT, "fsck", "--full", "--strict", "--no-progress")
        return (out + err).decode("utf-8", "replace")

    # -- writing history

    def init(self, author: Author) -> CommitInfo:
        """A new history (the git dir exists, empty), its first commit an empty tree."""
        if any(self.git_dir.iterdir()):
            raise ConflictError("the workspace already has a history: read it with its log")
        self._git("init", "-q", "--template=", "--initial-branch=main")
        self._write_git_file("config", REPO_CONFIG)  # no core.worktree: the jail's path
        self._write_info("attributes", ATTRIBUTES)
        self._write_info("exclude", b"")
        tree = self._git("write-tree").decode().strip()
        sha = self._new_commit(tree, (), _message("Workspace created", []), author)
        self._git("update-ref", "-m", "init", BRANCH, sha, "")
        return self.head()

    def commit(
        self, message: str, author: Author, *, trailers: Mapping[str, str] = {}
    ) -> CommitResult:
        """Snapshot the whole work tree but the size rule's files; created False (and HEAD)
        when nothing changed. `check` runs before each step, its exception unchanged."""
        return self._snapshot(message, author, trailers)[0]

    def restore(
        self, rev: str, author: Author, *, trailers: Mapping[str, str] = {}
    ) -> CommitResult:
        """Commit what is there, make the index and work tree exactly `rev`'s (the size rule's
        files stay where they are), commit that: history only grows."""
        self.check()
        sha = self._resolve(rev)
        _, scan = self._snapshot(f"Before restore to {sha[:12]}", author, trailers)
        tree = f"{sha}^{{tree}}"
        if scan.skipped:  # rev's tree minus the files the size rule keeps out: they stay
            env = {"GIT_INDEX_FILE": f"{JAIL_GIT}/restore-index"}
            self._step("read-tree", tree, env=env)
            self._step(*_REMOVE, input=_nul_list(p for p, _ in scan.skipped), env=env)
            tree = self._step("write-tree", env=env).decode().strip()
            self._sh(f"rm -f {JAIL_GIT}/restore-index")
        self._step("read-tree", "-u", "--reset", tree)
        return self._snapshot(f"Restore {sha[:12]}", author, trailers)[0]

    def _snapshot(
        self, message: str, author: Author, trailers: Mapping[str, str]
    ) -> tuple[CommitResult, _Scan]:
        self.check()
        self._clear_stale_locks()
        scan = self._scan()
        self.check()
        self._write_info("attributes", ATTRIBUTES)
        self._write_info("exclude", b"".join(_pattern(p) + b"\n" for p, _ in scan.skipped))
        if out_of_git := [p for p, _ in scan.skipped] + list(scan.special):
            self._step(*_REMOVE, input=_nul_list(out_of_git))
        if scan.nested:
            self._flatten_gitlinks(scan)  # one a crash left would make `add` look inside it
        self.check()
        _, err = self._run("add", "-A")
        if _UNREADABLE.search(err):  # an unreadable directory is only a warning for git
            raise _failure("add", err)
        if scan.nested:
            self._flatten_gitlinks(scan)
        skipped = tuple(SkippedFile(_display(p), size) for p, size in scan.skipped)
        tree = self._step("write-tree").decode().strip()
        self.check()
        head = self.head()
        if tree == self._step("rev-parse", "--verify", f"{head.sha}^{{tree}}").decode().strip():
            return CommitResult(head, False, skipped), scan
        notes = [("Sandgate-Skipped", f"{s.path} ({s.size} bytes)") for s in skipped]
        text = _message(message, [*trailers.items(), *notes[:MAX_SKIPPED_TRAILERS]])
        self.check()
        sha = self._new_commit(tree, (head.sha,), text, author)
        self._step("update-ref", "-m", "commit", BRANCH, sha, head.sha)
        return CommitResult(self._commits(sha, 1)[0], True, skipped), scan

    def _new_commit(self, tree: str, parents: tuple[str, ...], text: bytes, author: Author) -> str:
        env = {
            "GIT_AUTHOR_NAME": _one_line(author.name),
            "GIT_AUTHOR_EMAIL": _one_line(author.email),
        }
        args = [a for p in parents for a in ("-p", p)]
        return self._git("commit-tree", tree, *args, "-F", "-", input=text, env=env).decode()[:-1]

    # -- the work tree, as the worker sees it

    def _scan(self) -> _Scan:
        try:
            return self._walk()
        except FileNotFoundError:  # the sandbox removed a directory while it was read
            raise ConflictError(
                "the workspace's files changed while they were read: try again"
            ) from None
        except OSError as exc:  # never the host's path in the answer
            raise WorkerError(f"cannot read the workspace's files ({exc.strerror})") from None

    def _walk(self) -> _Scan:
        skipped: list[tuple[str, int]] = []
        special: list[str] = []
        nested = False
        top = str(self.work_tree)
        for dirpath, dirnames, filenames, dirfd in os.fwalk(top, follow_symlinks=False):
            rel = dirpath[len(top) + 1 :]
            if rel.count("/") >= MAX_DEPTH - 1:
                raise InvalidRequestError(
                    f"a directory of the workspace nests deeper than {MAX_DEPTH} levels "
                    f"({_display(rel[:200])}...): flatten it, then commit"
                )
            if ".git" in dirnames or ".git" in filenames:  # git never adds a .git
                nested = nested or bool(rel)
                dirnames[:] = [d for d in dirnames if d != ".git"]
                filenames = [f for f in filenames if f != ".git"]
            for name in filenames:
                try:
                    st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                except FileNotFoundError:  # the sandbox removed it meanwhile
                    continue
                path = f"{rel}/{name}" if rel else name
                if stat.S_ISREG(st.st_mode) and st.st_size > self.large_file_bytes:
                    skipped.append((path, st.st_size))
                elif not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                    special.append(path)
        return _Scan(tuple(sorted(skipped)), tuple(special), nested)

    def _flatten_gitlinks(self, scan: _Scan) -> None:
        """Put each gitlink's directory in the index as files, ignoring what it ignores."""
        entries = self._step("ls-files", "-s", "-z").split(b"\0")
        links = [os.fsdecode(e.split(b"\t", 1)[1]) for e in entries if e.startswith(b"160000 ")]
        if not links:
            return
        self._step(*_REMOVE, input=_nul_list(links))
        left_out = {p for p, _ in scan.skipped} | set(scan.special)
        files = [p for link in links for p in self._files_below(link) if p not in left_out]
        if not files:
            return
        self.check()  # check-ignore takes no literal pathspecs: "./" keeps a leading ":" plain
        plain, paths = {"GIT_LITERAL_PATHSPECS": "0"}, _nul_list(f"./{p}" for p in files)
        out, _ = self._run("check-ignore", "-z", "--stdin", input=paths, env=plain, ok=(0, 1))
        ignored = {os.fsdecode(p).removeprefix("./") for p in out.split(b"\0") if p}
        kept = [p for p in files if p not in ignored]
        self._step("update-index", "-z", "--add", "--stdin", input=_nul_list(kept))

    def _files_below(self, rel: str) -> Iterator[str]:
        """The files and links below a nested repository's directory, listed in the jail (a
        link the tenant swapped in there cannot lead the listing onto the host)."""
        found = self._sh(
            f'cd {JAIL_FILES} && find "./$1" -name .git -prune '
            "-o \\( -type f -o -type l \\) -print0",
            args=(rel,),
        )
        for path in found.split(b"\0"):
            if path.startswith(b"./"):
                yield os.fsdecode(path[2:])
