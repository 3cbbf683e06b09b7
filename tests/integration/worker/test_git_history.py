"""A workspace's history on a real git, run as a storage uid, against a hostile work tree.

Runs as root (git is started as the storage uid). The workspace lives in a directory of its
own under /tmp, traversable by that uid, as the worker's mount point is.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandgate.errors import DiskQuotaExceededError, InvalidRequestError, NotFoundError
from sandgate.worker import disk
from sandgate.worker.git_history import Author, GitHistory

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="git runs as a storage uid: needs root")

UID = 199999
AUTHOR = Author("tenant-1", "tenant-1@sandgate.invalid")
BIG = 40_000_000  # above the 32 MiB rule; sparse


@dataclass
class Workspace:
    root: Path
    files: Path
    git: Path

    def history(self, check: Callable[[], None] = lambda: None) -> GitHistory:
        return GitHistory(self.git, self.files, uid=UID, gid=UID, check=check)

    def put(self, rel: str, data: bytes | str = b"") -> Path:
        """Write a file as the sandbox would: it and its directories the storage uid's."""
        path = self.files / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        self.own()
        return path

    def own(self) -> None:
        for dirpath, dirnames, filenames in os.walk(self.files):
            for name in [*dirnames, *filenames]:
                os.lchown(os.path.join(dirpath, name), UID, UID)

    def tree(self, rev: str = "HEAD") -> dict[str, str]:
        """{path: mode} of a commit, read with the host's own git (not the code under test)."""
        out = subprocess.run(
            ["git", "--git-dir", str(self.git), "ls-tree", "-r", "-z", rev],
            check=True,
            capture_output=True,
            env={"PATH": "/usr/bin:/bin", "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent"},
        ).stdout
        entries = [e.split("\t", 1) for e in out.decode().split("\0") if e]
        return {path: meta.split()[0] for meta, path in entries}


@pytest.fixture
def ws() -> Iterator[Workspace]:
    root = Path(tempfile.mkdtemp(prefix="sandgate-git-"))
    os.chmod(root, 0o711)
    w = Workspace(root, root / "files", root / "git")
    try:
        for d in (w.files, w.git):
            d.mkdir(mode=0o700)
            os.chown(d, UID, UID)
        w.history().init(AUTHOR)
        yield w
    finally:
        shutil.rmtree(root, ignore_errors=True)


def plain_git(*args: str, cwd: Path) -> None:
    """The tenant's own git, as the sandbox would run it."""
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1"}
    ident = ["-c", "user.name=t", "-c", "user.email=t@t"]
    argv = ["git", *ident, *args]
    subprocess.run(argv, cwd=cwd, env=env, check=True, capture_output=True, user=UID)


def test_init_commit_log_and_paging(ws: Workspace) -> None:
    h = ws.history()
    root = h.head()
    assert (root.message, root.parents, root.author_name) == ("Workspace created", (), "tenant-1")
    assert h.fsck() is not None
    shas = [root.sha]
    for i in range(5):
        ws.put(f"f{i}.txt", f"line {i}\n")
        result = h.commit(f"step {i}", AUTHOR, trailers={"Sandgate-Sandbox": "sbx-1"})
        assert result.created and result.commit.parents == (shas[-1],)
        shas.append(result.commit.sha)
    assert h.head().message == "step 4\n\nSandgate-Sandbox: sbx-1"
    assert h.head().to_json()["author"] == {"name": "tenant-1", "email": AUTHOR.email}
    assert h.head().date.endswith("+00:00")

    seen, start, pages = [], None, 0
    while True:
        page, start = h.log(limit=2, start=start)
        seen += [c.sha for c in page]
        pages += 1
        if start is None:
            break
    assert (seen, pages) == (shas[::-1], 3)
    assert [c.sha for c in h.log()[0]] == shas[::-1] and h.log()[1] is None

    ws.put("long.txt", "x")
    long = h.commit("y" * 5000 + "\0", AUTHOR).commit.message
    assert long == "y" * 4096
    ws.put("empty.txt", "x")
    assert h.commit("  ", AUTHOR).commit.message == "Snapshot"


def test_show_stat_patch_and_binary(ws: Workspace) -> None:
    h = ws.history()
    ws.put("a.txt", "one\ntwo\n")
    first = h.commit("a", AUTHOR).commit
    ws.put("a.txt", "one\nTWO\nthree\n")
    ws.put("bin.dat", b"\0\1\2binary\0" * 10)
    diff = h.show(h.commit("b", AUTHOR).commit.sha)
    stats = {f.path: (f.added, f.deleted) for f in diff.files}
    assert stats == {"a.txt": (2, 1), "bin.dat": (None, None)}
    assert " one\n-two\n+TWO\n+three\n" in diff.patch
    assert "Binary files /dev/null and b/bin.dat differ" in diff.patch
    assert not diff.truncated and diff.commit.parents == (first.sha,)
    assert diff.to_json()["files"][0] == {"path": "a.txt", "added": 2, "deleted": 1}

    short = h.show(first.sha[:7].upper(), max_patch_bytes=10)
    assert short.truncated and len(short.patch) <= 10 and short.commit.sha == first.sha
    root = h.show(first.parents[0])
    assert (root.files, root.patch, root.truncated) == ((), "", False)


def test_nothing_changed_makes_no_commit(ws: Workspace) -> None:
    h = ws.history()
    ws.put("a.txt", "a")
    made = h.commit("a", AUTHOR)
    again = h.commit("again", AUTHOR)
    assert made.created and not again.created
    assert again.commit == made.commit == h.head()


def test_large_files_are_left_out(ws: Workspace) -> None:
    h = ws.history()
    ws.put("small.bin", "small")
    ws.put("grows.bin", "small for now")
    h.commit("small", AUTHOR)
    names = ["big [1]*.bin", "sub/#big!"]
    for name in names:
        os.truncate(ws.put(name), BIG)
    ws.put("big [1]x.bin", "a small sibling the pattern must not catch")
    os.truncate(ws.files / "grows.bin", BIG)
    result = h.commit("big", AUTHOR)
    assert result.created
    assert sorted((s.path, s.size) for s in result.skipped) == sorted(
        [(n, BIG) for n in [*names, "grows.bin"]]
    )
    assert set(ws.tree()) == {"small.bin", "big [1]x.bin"}  # grows.bin left the index
    assert "Sandgate-Skipped: big [1]*.bin (40000000 bytes)" in result.commit.message
    assert result.to_json()["skipped"][0] == {"path": "big [1]*.bin", "size": BIG}
    assert (ws.files / "grows.bin").stat().st_size == BIG  # still there, just not in history
    assert not h.commit("again", AUTHOR).created


def test_restore_brings_back_an_old_state(ws: Workspace) -> None:
    h = ws.history()
    ws.put("a.txt", "one")
    ws.put("keep/b.txt", "b")
    old = h.commit("old", AUTHOR).commit
    ws.put("a.txt", "two")
    ws.put("later.txt", "later")
    os.truncate(ws.put("big.bin"), BIG)
    h.commit("new", AUTHOR)
    ws.put("unsaved.txt", "not committed yet")

    result = h.restore(old.sha[:10], AUTHOR, trailers={"Sandgate-Sandbox": "sbx-2"})
    assert result.created and result.commit.message.startswith(f"Restore {old.sha[:12]}")
    assert (ws.files / "a.txt").read_text() == "one"
    assert (ws.files / "keep/b.txt").read_text() == "b"
    assert not (ws.files / "later.txt").exists() and not (ws.files / "unsaved.txt").exists()
    assert (ws.files / "big.bin").stat().st_size == BIG  # the size rule's files stay
    assert set(ws.tree()) == {"a.txt", "keep/b.txt"}

    before = h.show(result.commit.parents[0])
    assert before.commit.message.startswith(f"Before restore to {old.sha[:12]}")
    assert "unsaved.txt" in ws.tree(before.commit.sha)  # nothing was lost
    assert not h.restore(old.sha, AUTHOR).created  # already there: no commit
    assert "error" not in h.fsck()


def test_a_big_file_where_the_old_state_had_a_small_one_stays(ws: Workspace) -> None:
    h = ws.history()
    ws.put("data.bin", "small")
    old = h.commit("small", AUTHOR).commit
    os.truncate(ws.files / "data.bin", BIG)
    h.restore(old.sha, AUTHOR)
    assert (ws.files / "data.bin").stat().st_size == BIG


def test_stale_index_lock_is_removed(ws: Workspace, caplog: pytest.LogCaptureFixture) -> None:
    h = ws.history()
    ws.put("a.txt", "a")
    lock = ws.git / "index.lock"
    lock.write_bytes(b"left by a killed git")
    os.chown(lock, UID, UID)
    with caplog.at_level(logging.WARNING, logger="sandgate.worker.git_history"):
        assert h.commit("after a crash", AUTHOR).created
    assert not lock.exists()
    assert any("workspace.stale_index_lock" in r.getMessage() for r in caplog.records)
    h.fsck()


def test_hostile_work_tree_runs_nothing(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    marks = ws.root / "marks"  # writable by the storage uid: any planted command would succeed
    marks.mkdir(mode=0o777)
    os.chmod(marks, 0o777)
    evil = f"touch {marks}/ran; cat"
    monkeypatch.setenv("GIT_DIR", str(ws.root / "elsewhere"))
    monkeypatch.setenv("GIT_CONFIG_PARAMETERS", f"'filter.evil.clean'='{evil}'")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(ws.root / "evil-global"))
    (ws.root / "evil-global").write_text(f'[filter "evil"]\n\tclean = "{evil}"\n')

    ws.put(".gitattributes", "* filter=evil ident text eol=crlf\n")
    ws.put(".git", "gitdir: /etc\n")
    written = {"plain.txt": b"$Id$ kept as written\n", "crlf.txt": b"one\r\ntwo\r\n"}
    for name, data in written.items():
        ws.put(name, data)
    sub = ws.files / "sub"  # the tenant's own repository, with hooks and config that run things
    ws.put("sub/a", "nested\n")
    ws.put("sub/.gitignore", "ignored/\n")
    ws.put("sub/ignored/x", "ignored by the nested repository")
    plain_git("init", "-q", ".", cwd=sub)
    plain_git("add", "a", ".gitignore", cwd=sub)
    plain_git("commit", "-qm", "tenant's", cwd=sub)
    hook = sub / ".git/hooks/pre-commit"
    hook.write_text(f"#!/bin/sh\ntouch {marks}/hook\n")
    hook.chmod(0o755)
    with open(sub / ".git/config", "a") as f:
        f.write(f'[filter "evil"]\n\tclean = "{evil}"\n[core]\n\tfsmonitor = "{evil}"\n')
    ws.put("sub/.gitattributes", "* filter=evil\n")
    os.mkfifo(ws.files / "pipe")
    ws.own()

    # the plant is live: the tenant's repository runs its filter for a plain git status
    os.utime(sub / "a", (1e9, 1e9))
    plain_git("status", cwd=sub)
    assert (marks / "ran").exists()
    (marks / "ran").unlink()

    h = ws.history()
    os.utime(sub / "a", (1e9, 1e9))
    first = h.commit("hostile", AUTHOR)
    assert first.created
    tree = ws.tree()
    assert {"sub/a", "sub/.gitignore", ".gitattributes", "plain.txt"} <= set(tree)
    assert not {".git", "sub", "pipe", "sub/ignored/x"} & set(tree)  # no gitlink, no fifo
    assert "+$Id$ kept as written\n" in h.show(first.commit.sha).patch  # no filter, no ident

    # a gitlink a crashed commit left in the index must not make `git add` look inside it
    nested_head = next((sub / ".git/refs/heads").iterdir()).read_text().strip()
    monkeypatch.delenv("GIT_DIR")
    env = {"GIT_DIR": str(ws.git), "GIT_WORK_TREE": str(ws.files), "PATH": "/usr/bin:/bin"}
    below = [p for p in tree if p.startswith("sub/")]
    link = f"160000,{nested_head},sub"
    for args in (["--force-remove", *below], ["--add", "--cacheinfo", link]):
        subprocess.run(["git", "update-index", *args], env=env, cwd=ws.files, check=True, user=UID)
    os.utime(sub / "a", (1e9, 1e9))
    ws.put("sub/b", "more")
    second = h.commit("hostile again", AUTHOR)
    assert second.created and {"sub/a", "sub/b"} <= set(ws.tree())
    assert list(marks.iterdir()) == []

    for name in written:  # back byte for byte: no ident, no eol conversion, no smudge
        (ws.files / name).unlink()
    h.restore(first.commit.sha, AUTHOR)
    assert {name: (ws.files / name).read_bytes() for name in written} == written
    assert list(marks.iterdir()) == []
    assert "error" not in h.fsck()


def test_a_symlink_is_committed_as_a_link(ws: Workspace) -> None:
    h = ws.history()
    (ws.files / "passwd").symlink_to("/etc/passwd")
    (ws.files / "etc").symlink_to("/etc")
    ws.own()
    diff = h.show(h.commit("links", AUTHOR).commit.sha)
    assert ws.tree() == {"passwd": "120000", "etc": "120000"}
    assert "new file mode 120000" in diff.patch and "+/etc/passwd\n" in diff.patch
    assert "root:" not in diff.patch


def test_a_failing_check_stops_the_commit_before_it_is_written(ws: Workspace) -> None:
    steps = 0

    def count() -> None:
        nonlocal steps
        steps += 1

    ws.put("a.txt", "a")
    assert ws.history(count).commit("count the checks of a commit", AUTHOR).created
    assert steps >= 5
    ws.put("b.txt", "b")  # the same kind of change: the same steps
    before = ws.history().head()

    class LockLost(Exception):
        pass

    for n in range(1, steps + 1):
        seen = 0

        def check(n: int = n) -> None:
            nonlocal seen
            seen += 1
            if seen == n:
                raise LockLost

        with pytest.raises(LockLost):
            ws.history(check).commit("must not land", AUTHOR)
        assert ws.history().head() == before, f"HEAD moved though check {n} failed"
    assert ws.history().commit("now", AUTHOR).created


def test_unknown_and_bad_revisions(ws: Workspace) -> None:
    h = ws.history()
    with pytest.raises(NotFoundError) as missing:
        h.show("deadbeef")
    assert missing.value.code == "commit_not_found"
    for bad in ("HEAD", "abc", "-p", "x" * 8, "a" * 41, "HEAD~1"):
        with pytest.raises(InvalidRequestError):
            h.show(bad)
        with pytest.raises(InvalidRequestError):
            h.restore(bad, AUTHOR)
    with pytest.raises(NotFoundError):
        h.log(start="0" * 40)
    with pytest.raises(InvalidRequestError):
        h.log(limit=0)


def test_unreadable_and_refused_files_name_the_path(ws: Workspace) -> None:
    h = ws.history()
    before = h.head()
    ws.put("secret.txt", "s").chmod(0)
    with pytest.raises(InvalidRequestError, match=r"secret\.txt.*make it readable"):
        h.commit("unreadable", AUTHOR)
    (ws.files / "secret.txt").chmod(0o644)
    ws.put("d/.GIT", "x")
    with pytest.raises(InvalidRequestError, match=r"d/\.GIT.*rename it"):
        h.commit("refused", AUTHOR)
    assert h.head() == before
    (ws.files / "d/.GIT").unlink()
    assert h.commit("fixed", AUTHOR).created


def test_a_full_quota_says_so_and_the_history_recovers() -> None:
    root = Path(tempfile.mkdtemp(prefix="sandgate-git-"))
    os.chmod(root, 0o711)
    if why := disk.probe(root):
        shutil.rmtree(root)
        pytest.skip(f"no per-workspace file systems here: {why}")
    (root / "ws").mkdir(mode=0o711)
    try:
        image = disk.create(root / "ws", disk_mb=16, uid=UID)
        w = Workspace(image.workspace, image.workspace / "files", image.workspace / "git")
        for d in (w.files, w.git):
            d.mkdir(mode=0o700)
            os.chown(d, UID, UID)
        h = w.history()
        h.init(AUTHOR)
        w.put("noise.bin", os.urandom(9 << 20))  # git's copy does not fit beside it
        with pytest.raises(DiskQuotaExceededError, match=r"quota is full.*quota_mb"):
            h.commit("too much", AUTHOR)
        (w.files / "noise.bin").unlink()
        w.put("small.txt", "fits")
        assert h.commit("fits", AUTHOR).created
        assert set(w.tree()) == {"small.txt"}
    finally:
        disk.remove(root / "ws")
        shutil.rmtree(root, ignore_errors=True)
