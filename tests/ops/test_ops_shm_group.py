"""``server.shm_group``: a daemon running as its own user shares its regions with one
group, so trainers and engines under other uids in that group can map them.

The cross-user tests fork a child that drops to ``nobody`` with (or without) the
group as a supplementary group: a real second uid, real segments under /dev/shm.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator

import pytest
from support.daemons import served

from refitd.client.http import RefitClient
from refitd.config import ServerConfig, load_config
from refitd.daemon.access.auth import check_startup
from refitd.errors import ConfigError, ProtocolError
from transports.segments import GROUP_ENV, SHM_DIR, SharedSegment

GROUP = 48213  # a gid no account uses: only the test's child joins it
NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")


@pytest.fixture(autouse=True)
def restore_group_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Service.setup writes the variable process-wide; monkeypatch puts it back after.
    monkeypatch.setenv(GROUP_ENV, "")
    yield


def as_nobody(fn: Callable[[], None], groups: tuple[int, ...] = ()) -> tuple[int, str]:
    """Run ``fn`` in a forked child as uid/gid ``nobody`` with ``groups``; return its
    exit code (0: ``fn`` returned) and the message of whatever it raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: plain system calls only, then _exit
        code = 0
        try:
            os.close(read)
            os.setgroups(list(groups))
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
        except BaseException as exc:
            os.write(write, f"{type(exc).__name__}: {exc}".encode())
            code = 3
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), message


def mode_and_group(name: str) -> tuple[int, int]:
    st = os.stat(SHM_DIR / name)
    return stat.S_IMODE(st.st_mode), st.st_gid


async def test_without_a_group_the_daemons_regions_stay_0600() -> None:
    async with served(wired=True) as daemon, RefitClient(daemon.url) as c:
        region = await c.create_region(4096)
        assert mode_and_group(region.handle)[0] == 0o600
    assert os.environ.get(GROUP_ENV) is None


@needs_root
async def test_a_process_of_another_uid_in_the_group_maps_and_writes_the_daemons_region() -> None:
    async with (
        served(wired=True, access=ServerConfig(port=0, shm_group=str(GROUP))) as daemon,
        RefitClient(daemon.url) as c,
    ):
        region = await c.create_region(4096, label="weights")
        assert mode_and_group(region.handle) == (0o660, GROUP)

        def write_weights() -> None:
            seg = SharedSegment.attach(region.handle, region.nbytes)
            seg.numpy()[:16] = 0x7F
            seg.close()

        code, message = as_nobody(write_weights, groups=(GROUP,))
        assert (code, message) == (0, "")
        with SharedSegment.attach(region.handle, region.nbytes) as seg:
            assert (seg.numpy()[:16] == 0x7F).all() and not seg.numpy()[16:].any()


@needs_root
async def test_the_daemon_attaches_a_group_segment_another_uid_created() -> None:
    names: list[str] = []
    async with (
        served(wired=True, access=ServerConfig(port=0, shm_group=str(GROUP))) as daemon,
        RefitClient(daemon.url) as c,
    ):
        read, write = os.pipe()

        def create_engine_segment() -> None:
            seg = SharedSegment.create(8192, "engine")  # the group came with the env
            seg.numpy()[:] = 0x11
            os.write(write, seg.name.encode())
            seg.owner = False  # leave it for the daemon to map; the test unlinks it

        code, message = as_nobody(create_engine_segment, groups=(GROUP,))
        os.close(write)
        names.append(os.read(read, 4096).decode())
        os.close(read)
        try:
            assert (code, message) == (0, "")
            assert os.stat(SHM_DIR / names[0]).st_uid == NOBODY
            assert mode_and_group(names[0]) == (0o660, GROUP)
            region = await c.attach_region(names[0], 8192, label="engine")
            assert region.nbytes == 8192
        finally:
            (SHM_DIR / names[0]).unlink(missing_ok=True)


@needs_root
async def test_a_uid_outside_the_group_is_refused_naming_the_setting() -> None:
    async with (
        served(wired=True, access=ServerConfig(port=0, shm_group=str(GROUP))) as daemon,
        RefitClient(daemon.url) as c,
    ):
        region = await c.create_region(4096)

        def attach() -> None:
            SharedSegment.attach(region.handle, region.nbytes)

        code, message = as_nobody(attach)  # not a member of the group
        assert code == 3
        assert "ProtocolError" in message and "may not open it" in message
        assert GROUP_ENV in message


@needs_root
def test_a_group_segment_is_refused_by_a_process_not_sharing_with_that_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(GROUP_ENV, str(GROUP))
    with SharedSegment.create(100) as seg:
        assert mode_and_group(seg.name) == (0o660, GROUP)

        def attach_without_the_setting() -> None:
            os.environ.pop(GROUP_ENV, None)
            SharedSegment.attach(seg.name)

        code, message = as_nobody(attach_without_the_setting, groups=(GROUP,))
        assert code == 3 and f"belongs to uid 0, not ours ({NOBODY})" in message
        # Nor does a same-uid process that has not opted into the group.
        monkeypatch.setenv(GROUP_ENV, "")
        with pytest.raises(ProtocolError, match="lets other users in"):
            SharedSegment.attach(seg.name)


def test_an_unknown_shm_group_stops_the_daemon_before_it_starts() -> None:
    config = load_config(env={}, overrides={"server.shm_group": "no-such-group-here"})
    with pytest.raises(ConfigError, match=r"server\.shm_group .no-such-group-here. names no group"):
        check_startup(config.server)
    with pytest.raises(ConfigError, match=r"server\.shm_group"):
        load_config(env={}, overrides={"server.shm_group": "../etc"})
