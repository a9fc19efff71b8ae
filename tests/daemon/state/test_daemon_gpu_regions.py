"""GPU regions at the daemon's edge, on a host without a GPU: what is refused, and why.

Real daemons on 127.0.0.1:0, real HTTP, real tokens. The GPU path itself (a handle
opened, copies on the device) is tests/gpu/'s; here run the rules that hold before
any CUDA call: who may register GPU memory, what a host without CUDA says, and that
a device region never reaches a path that needs host memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support.daemons import daemon_config, served, token_file
from support.devices import HostDeviceEngine, HostDeviceMemory

from refitd.client.http import RefitClient
from refitd.config import ServerConfig
from refitd.daemon.app.node import Daemon
from refitd.daemon.state.memory import byte_view
from refitd.errors import AccessDenied, PlanError, ProtocolError
from refitd.wire import MemoryKind
from transports.cuda import missing, parse_handle

pytestmark = pytest.mark.timeout(60)

no_gpu = pytest.mark.skipif(missing() is None, reason="this host has a CUDA device")

HANDLE = "ab" * 16 + ":" + "cd" * 64  # well formed: a device UUID and a 64-byte handle


@contextlib.asynccontextmanager
async def daemon(tmp: Path, tokens: bool) -> AsyncIterator[tuple[Daemon, RefitClient]]:
    access = (
        ServerConfig(port=0, token_file=token_file(tmp, {"a": "token-of-a"})) if tokens else None
    )
    d = Daemon(daemon_config(node_id="gpu-edge", transport="shm"))
    async with (
        served(d, access=access) as s,
        RefitClient(s.url, token="token-of-a" if tokens else None) as c,
    ):
        yield d, c


async def test_a_tokens_tenant_cannot_register_gpu_memory_whose_handle_proves_no_owner(
    tmp_path: Path,
) -> None:
    async with daemon(tmp_path, tokens=True) as (d, a):
        with pytest.raises(AccessDenied, match="Unix socket"):
            await a.attach_region(HANDLE, 1 << 20, kind=MemoryKind.CUDA)
        assert len(d.store.regions) == 0


@no_gpu
async def test_attaching_gpu_memory_on_a_host_without_cuda_is_refused_naming_why(
    tmp_path: Path,
) -> None:
    async with daemon(tmp_path, tokens=False) as (d, c):
        with pytest.raises(PlanError, match="no CUDA device"):
            await c.attach_region(HANDLE, 1 << 20, kind=MemoryKind.CUDA)
        with pytest.raises(PlanError, match="no CUDA device"):
            await c.create_region(1 << 20, kind=MemoryKind.CUDA)
        assert len(d.store.regions) == 0
        # The host path is untouched by the refusal.
        info = await c.create_region(4096)
        assert [r.region_id for r in await c.regions()] == [info.region_id]


def test_a_malformed_gpu_handle_is_refused_before_the_driver_sees_it() -> None:
    assert parse_handle(HANDLE) == ("ab" * 16, bytes.fromhex("cd" * 64))
    for bad in ("", "ab" * 16, "zz" * 16 + ":" + "cd" * 64, "ab" * 16 + ":" + "cd" * 63):
        with pytest.raises(ProtocolError, match="CUDA IPC handle refused"):
            parse_handle(bad)


def test_device_memory_is_refused_where_the_daemon_needs_host_memory() -> None:
    memory = HostDeviceMemory(4096, HostDeviceEngine())
    try:
        with pytest.raises(PlanError, match="hostdev memory"):
            byte_view(memory)  # an expert pool's rows and slots, a staging region
    finally:
        memory.close()


def test_a_handle_with_zero_bytes_reaches_the_driver_whole() -> None:
    from transports.cudadriver import IpcHandle

    raw = bytes([1, 0, 0, 2]) * 16  # real handles hold zero bytes
    _, parsed = parse_handle("00" * 16 + ":" + raw.hex())
    assert bytes(IpcHandle.from_buffer_copy(parsed).reserved) == raw


@no_gpu
async def test_on_the_unix_socket_gpu_memory_needs_a_process_of_the_callers_uid(
    tmp_path: Path,
) -> None:
    # The handler passes the kernel-named uid; here the daemon is called as it would.
    import os

    from refitd.wire import RegionAttach
    from transports.segments import owner_tag

    async with daemon(tmp_path, tokens=False) as (d, _):
        mine = RegionAttach(HANDLE, 1 << 20, MemoryKind.CUDA, process=owner_tag())
        other_uid = os.getuid() + 1
        with pytest.raises(AccessDenied, match=f"live and of the caller's uid {other_uid}"):
            await d.store.attach_region(mine, other_uid, "unix")
        with pytest.raises(AccessDenied, match="must name its process"):
            await d.store.attach_region(RegionAttach(HANDLE, 1 << 20, MemoryKind.CUDA), 0, "unix")
        # The caller's own process passes the owner check; this host then has no CUDA.
        with pytest.raises(PlanError, match="no CUDA device"):
            await d.store.attach_region(mine, os.getuid(), "unix")
        assert len(d.store.regions) == 0


async def test_no_refusal_of_gpu_memory_quotes_its_handle(tmp_path: Path) -> None:
    secret = HANDLE.split(":")[1]
    refusals: list[str] = []
    async with daemon(tmp_path, tokens=True) as (_, a):
        with pytest.raises(AccessDenied) as token:
            await a.attach_region(HANDLE, 1 << 20, kind=MemoryKind.CUDA)
        refusals.append(str(token.value))
    async with daemon(tmp_path, tokens=False) as (_, c):
        for handle in (HANDLE, HANDLE[:-2]):  # well formed, and malformed
            with pytest.raises((PlanError, ProtocolError)) as refused:
                await c.attach_region(handle, 1 << 20, kind=MemoryKind.CUDA)
            refusals.append(str(refused.value))
    assert refusals and not [r for r in refusals if secret[:32] in r], refusals
