"""UidPool: exclusive, round-robin leases of host uids, whatever the churn."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandgate.errors import WorkerError
from sandgate.worker.uids import UidPool


def test_leases_are_exclusive_round_robin_and_given_back(tmp_path: Path) -> None:
    pool, other = UidPool(tmp_path, 5000, 4), UidPool(tmp_path, 5000, 4)
    first = [pool.lease() for _ in range(3)]
    assert [lease.uid for lease in first] == [5000, 5001, 5002]
    assert other.try_lease(5001) is None  # another holder (its own flock) is refused
    first[1].release()
    assert pool.lease().uid == 5003  # a freed uid is not reused at once
    assert pool.lease().uid == 5001
    assert pool.held() == {5000, 5001, 5002, 5003}
    with pytest.raises(WorkerError, match="all 4 sandbox uids"):
        pool.lease()
    assert other.try_lease(5000) is None


def test_churn_keeps_one_entry_per_uid_and_the_held_set_exact(tmp_path: Path) -> None:
    """Thousands of starts and stops on a small range: the pool's record stays bounded by
    its range and says exactly which uids it holds."""
    pool = UidPool(tmp_path, 6000, 8)
    live = [pool.lease() for _ in range(5)]
    for step in range(2000):
        live.pop(step % len(live)).release()
        live.append(pool.lease())
    assert len(pool._held) <= 8
    assert pool.held() == {lease.uid for lease in live}
    for lease in live:
        lease.release()
    assert pool.held() == set()
    assert len({pool.lease().uid for _ in range(8)}) == 8
