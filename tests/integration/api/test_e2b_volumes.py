"""E2B's volumes with E2B's official Python SDK, unmodified, on a real server and bwrap
worker: a volume is a workspace of the tenant (api/e2b/volumes.py, docs/e2b.md#volumes)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from e2b import (
    Sandbox,
    SandboxException,
    Volume,
    VolumeException,
    VolumeNotFoundException,
)

from tests import e2b_scenarios as sdk
from tests.integration.api.conftest import Deployment, own_deployment

pytestmark = pytest.mark.bwrap


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with own_deployment(tmp_path_factory, "e2b-volumes") as deployment:
        yield deployment


@pytest.fixture(scope="module")
def alpha(dep: Deployment) -> sdk.E2B:
    return sdk.E2B(dep.keys["alpha"], dep.url)


@pytest.fixture(scope="module")
def beta(dep: Deployment) -> sdk.E2B:
    return sdk.E2B(dep.keys["beta"], dep.url)


def api(e2b: sdk.E2B) -> dict[str, Any]:
    """What the control-plane calls of `Volume` take (no envd URL)."""
    return {"api_key": e2b.api_key, "api_url": e2b.url}


def test_a_volume_outlives_its_sandboxes_and_is_the_tenants_own(
    alpha: sdk.E2B, beta: sdk.E2B
) -> None:
    vol = Volume.create("data", **api(alpha))
    assert vol.name == "data" and vol.volume_id.startswith("ws-")
    listed = Volume.list(**api(alpha))
    assert [(v.volume_id, v.name) for v in listed] == [(vol.volume_id, "data")]
    info = Volume.get_info(vol.volume_id, **api(alpha))
    assert (info.volume_id, info.name) == (vol.volume_id, "data")
    assert Volume.connect(vol.volume_id, **api(alpha)).name == "data"

    first = alpha.create(volume_mounts={"/mnt/data": vol})
    try:
        first.commands.run("echo kept > /mnt/data/note.txt && mkdir /mnt/data/sub")
        assert first.get_info().volume_mounts == [{"name": "data", "path": "/mnt/data"}]
        # mounted: not destroyed under the sandbox
        with pytest.raises(VolumeException, match="409"):
            Volume.destroy(vol.volume_id, **api(alpha))
    finally:
        assert first.kill() is True

    # E2B's home is /workspace here: /home/user/data is /workspace/data, for every call
    second = alpha.create(volume_mounts={"/home/user/data": "data"})
    try:
        assert second.commands.run("cat data/note.txt").stdout == "kept\n"
        assert second.files.read("/home/user/data/note.txt") == "kept\n"
        second.files.write("/home/user/data/sub/two.txt", "by the files API")
        assert second.commands.run("cat /workspace/data/sub/two.txt").stdout == "by the files API"
        assert second.get_info().volume_mounts == [{"name": "data", "path": "/workspace/data"}]

        # another tenant: no such volume, whether by id or by name
        assert Volume.list(**api(beta)) == []
        for ref in (vol.volume_id, "data"):
            with pytest.raises(VolumeNotFoundException):
                Volume.get_info(ref, **api(beta))
            assert Volume.destroy(ref, **api(beta)) is False
        with pytest.raises(SandboxException, match="not found"):
            beta.create(volume_mounts={"/mnt/data": "data"})
    finally:
        assert second.kill() is True

    assert Volume.destroy(vol.volume_id, **api(alpha)) is True
    assert Volume.list(**api(alpha)) == []
    assert Volume.destroy(vol.volume_id, **api(alpha)) is False
    with pytest.raises(VolumeNotFoundException):
        Volume.get_info(vol.volume_id, **api(alpha))


def test_refusals_name_their_rule(alpha: sdk.E2B) -> None:
    with pytest.raises(VolumeException, match="400: volume name 'MyData' is not valid here"):
        Volume.create("MyData", **api(alpha))
    vol = Volume.create("scratch", **api(alpha))
    try:
        with pytest.raises(VolumeException, match="409"):
            Volume.create("scratch", **api(alpha))
        # the name also finds it, so a workspace made with the native API connects by name
        assert Volume.get_info("scratch", **api(alpha)).volume_id == vol.volume_id
        assert Volume.connect("scratch", **api(alpha)).name == "scratch"
        with pytest.raises(SandboxException, match="mount path '/opt/x' is not allowed"):
            alpha.create(volume_mounts={"/opt/x": vol})
        with pytest.raises(SandboxException, match="volume name 'No Such' is not valid"):
            alpha.create(volume_mounts={"/mnt/x": "No Such"})
        # the content API (files without a sandbox) is not served: 501, saying so
        with pytest.raises(VolumeException, match=r"501: .*volume content API"):
            vol.read_file("/a", api_url=alpha.url)
    finally:
        assert Volume.destroy("scratch", **api(alpha)) is True
    # and a create with no volumes still is what it was
    plain = Sandbox.create(**alpha.options())
    try:
        assert plain.get_info().volume_mounts == []
    finally:
        plain.kill()


def test_the_files_api_reaches_a_volume_outside_home(alpha: sdk.E2B) -> None:
    vol = Volume.create("outside", **api(alpha))
    sbx = alpha.create(volume_mounts={"/mnt/outside": vol})
    try:
        sbx.commands.run("echo seen > /mnt/outside/f")
        assert sbx.files.read("/mnt/outside/f") == "seen\n"
    finally:
        sbx.kill()
        Volume.destroy(vol.volume_id, **api(alpha))
