"""The cgroup2 mount and its options as read from mountinfo (worker/dynmods.py), and the
answers `favor` gives where it changes nothing on the host."""

from __future__ import annotations

from pathlib import Path

from sandgate.worker import dynmods
from sandgate.worker.dynmods import Cgroup2Mount, find_cgroup2

FLAGS = "rw,nosuid,nodev,noexec,relatime"
HYBRID = "\n".join(
    (
        "31 25 0:27 / /sys/fs/cgroup ro,nosuid,nodev,noexec - tmpfs tmpfs ro,mode=755",
        f"35 31 0:31 / /sys/fs/cgroup/memory {FLAGS} shared:9 - cgroup cgroup rw,memory",
        f"41 31 0:38 / /sys/fs/cgroup/unified {FLAGS} shared:10 - cgroup2 cgroup2 rw,nsdelegate",
        "",
    )
)
PURE_V2 = "\n".join(
    (
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw",
        f"30 22 0:26 / /sys/fs/cgroup {FLAGS} shared:4 - cgroup2 cgroup2 "
        "rw,nsdelegate,memory_recursiveprot",
        "",
    )
)


def test_the_cgroup2_mount_and_its_own_options() -> None:
    assert find_cgroup2(HYBRID) == Cgroup2Mount(Path("/sys/fs/cgroup/unified"), ("nsdelegate",))
    assert find_cgroup2(PURE_V2) == Cgroup2Mount(
        Path("/sys/fs/cgroup"), ("nsdelegate", "memory_recursiveprot")
    )
    on = PURE_V2.replace("recursiveprot\n", "recursiveprot,favordynmods\n")
    assert find_cgroup2(on) == Cgroup2Mount(
        Path("/sys/fs/cgroup"), ("nsdelegate", "memory_recursiveprot", "favordynmods")
    )


def test_no_cgroup2_and_an_escaped_mount_point() -> None:
    assert find_cgroup2(HYBRID.splitlines()[1]) is None
    assert find_cgroup2("") is None
    line = r"41 31 0:38 / /run/my\040cgroups rw - cgroup2 none ro" + "\n"
    assert find_cgroup2(line) == Cgroup2Mount(Path("/run/my cgroups"), ())


def test_what_favor_answers_without_touching_the_host(tmp_path: Path) -> None:
    mountinfo, features = tmp_path / "mountinfo", tmp_path / "features"
    features.write_text("nsdelegate\nfavordynmods\n")
    mountinfo.write_text(HYBRID.replace("rw,nsdelegate", "rw,nsdelegate,favordynmods"))
    assert dynmods.favor(mountinfo, features) is None  # already on: nothing to do

    mountinfo.write_text(HYBRID.splitlines()[1])
    assert dynmods.favor(mountinfo, features) == "no cgroup2 hierarchy is mounted"

    assert dynmods.favor(tmp_path / "gone", features) == (
        f"cannot read {tmp_path / 'gone'}: No such file or directory"
    )

    mountinfo.write_text(HYBRID)
    features.write_text("nsdelegate\n")
    assert dynmods.favor(mountinfo, features) == (
        "this kernel has no cgroup2 option favordynmods (Linux 6.1 or later has it)"
    )
