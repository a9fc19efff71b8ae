"""A small blocking face of :class:`~refitd.client.http.RefitClient`.

For scripts and REPLs that do not run an event loop. It owns a private loop
(``asyncio.Runner``) and runs each call to completion on it; do not use it from
inside a running loop (use the async client there).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Self, TypeVar

from refitd.client.http import RefitClient
from refitd.wire import (
    LeaseInfo,
    ManifestIn,
    MergedManifest,
    NodeInfo,
    PullProgress,
    PullRequest,
    RegionInfo,
    VersionInfo,
)

__all__ = ["SyncRefitClient"]

T = TypeVar("T")


class SyncRefitClient:
    """``with SyncRefitClient(url) as c: c.node()`` — same methods, same errors."""

    def __init__(self, base_url: str = "http://127.0.0.1:7450", **kwargs: Any) -> None:
        self._runner = asyncio.Runner()
        self._client = RefitClient(base_url, **kwargs)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._runner.run(self._client.close())
        self._runner.close()

    def _run(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        async def call() -> T:
            return await fn(*args, **kwargs)

        return self._runner.run(call())

    def node(self) -> NodeInfo:
        return self._run(self._client.node)

    def health(self) -> dict[str, str]:
        return self._run(self._client.health)

    def create_region(self, nbytes: int, **kwargs: Any) -> RegionInfo:
        return self._run(self._client.create_region, nbytes, **kwargs)

    def attach_region(self, handle: str, nbytes: int, **kwargs: Any) -> RegionInfo:
        return self._run(self._client.attach_region, handle, nbytes, **kwargs)

    def regions(self) -> list[RegionInfo]:
        return self._run(self._client.regions)

    def delete_region(self, region_id: int) -> RegionInfo:
        return self._run(self._client.delete_region, region_id)

    def publish(self, manifest: ManifestIn) -> VersionInfo:
        return self._run(self._client.publish, manifest)

    def versions(self, model: str) -> list[VersionInfo]:
        return self._run(self._client.versions, model)

    def manifest(self, model: str, version: int) -> MergedManifest:
        return self._run(self._client.manifest, model, version)

    def wait_drain(
        self, model: str, version: int, timeout_s: float = 60.0, *, retire: bool = False
    ) -> VersionInfo:
        return self._run(self._client.wait_drain, model, version, timeout_s, retire=retire)

    def acquire_lease(self, model: str, version: int, ttl_s: float = 30.0) -> LeaseInfo:
        return self._run(self._client.acquire_lease, model, version, ttl_s)

    def release_lease(self, lease_id: str) -> None:
        self._run(self._client.release_lease, lease_id)

    def pull(self, req: PullRequest) -> PullProgress:
        return self._run(self._client.pull, req)

    def pulls(self) -> list[PullProgress]:
        return self._run(self._client.pulls)
