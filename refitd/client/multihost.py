"""Refit from a version spread over several hosts, found through the cluster registry.

A trainer split over hosts publishes each rank's shards to its own host's daemon,
so a version's parts live on several daemons. :class:`ClusterReceiver` asks the
engine host's daemon (``local``) where the version lives
(``GET /v1/cluster/sources/{model}/versions/{version}``), then:

1. leases the version at every holder (each renewed in the background);
2. fetches each holder's manifest and merges them into one, the regions of holder
   ``i`` renamed ``i * REGION_STRIDE + region`` so the planner sees one address
   space (a block two holders both hold is read from the first, by node id);
3. plans and compiles once (or replays: the signature covers every holder's
   incarnation and placement), exactly as :class:`DaemonReceiver` does;
4. submits one pull per holder to the local daemon, all at once, and waits for
   every one: if any fails, the refit fails naming that holder, and — in
   ``staging`` mode, the default — nothing is installed;
5. installs, and releases every lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import msgspec

from refitd.client.http import RefitClient
from refitd.client.leases import held_lease
from refitd.client.receiver import DaemonReceiver, RefitStats
from refitd.errors import ConflictError, NotFoundError, PlanError, RefitError
from refitd.wire import (
    DescriptorTable,
    LeaseInfo,
    MergedManifest,
    PullProgress,
    PullRequest,
    ShardEntry,
    SourceRecord,
    TensorEntry,
)

__all__ = ["REGION_STRIDE", "ClusterReceiver"]

REGION_STRIDE = 1 << 16
"""Holder ``i``'s region ``r`` is region ``i * REGION_STRIDE + r`` in the merged
manifest (the planner's synthetic addresses then still fit in int64)."""


def merge_manifests(manifests: list[MergedManifest]) -> MergedManifest:
    """One manifest over every holder's, regions renamed per holder; a block (same
    global offset and shape) held by several holders is listed once, from the first."""
    tensors: dict[str, TensorEntry] = {}
    blocks: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], ShardEntry]] = {}
    for i, m in enumerate(manifests):
        for t in m.tensors:
            seen = tensors.get(t.name)
            if seen is None:
                tensors[t.name] = t
            elif (seen.shape, seen.dtype) != (t.shape, t.dtype):
                raise ConflictError(
                    f"tensor {t.name!r}: {m.node_id!r} holds {t.shape} {t.dtype}, "
                    f"{manifests[0].node_id!r} {seen.shape} {seen.dtype}"
                )
            own = blocks.setdefault(t.name, {})
            for s in t.shards:
                if s.region >= REGION_STRIDE:
                    raise PlanError(
                        f"region id {s.region} of {m.node_id!r} is too large to merge "
                        f"(limit {REGION_STRIDE})"
                    )
                renamed = ShardEntry(s.offset, s.shape, i * REGION_STRIDE + s.region, s.byte_offset)
                own.setdefault((tuple(s.offset), tuple(s.shape)), renamed)
    first = manifests[0]
    who = "+".join(f"{m.node_id}@{m.incarnation}" for m in manifests)
    merged = [
        TensorEntry(n, t.shape, t.dtype, list(blocks[n].values())) for n, t in tensors.items()
    ]
    return MergedManifest(first.model, first.version, who, 0, merged)


class ClusterReceiver(DaemonReceiver):
    """A :class:`DaemonReceiver` whose version may be spread over several daemons.

    ``local`` is this host's daemon, whose cluster registry says where versions
    live; ``token`` is presented to the holders (their bearer token). A version
    asked for whose last parts the registry has not shown yet is waited for up to
    ``discovery_s`` seconds."""

    def __init__(
        self,
        *,
        local: RefitClient,
        token: str | None = None,
        discovery_s: float = 30.0,
        **kw: Any,
    ) -> None:
        super().__init__(local=local, source=local, **kw)
        self.token = token
        self.discovery_s = discovery_s
        self._clients: dict[str, RefitClient] = {}

    async def _client(self, url: str) -> RefitClient:
        if url.rstrip("/") == self.local.base_url:
            return self.local
        c = self._clients.get(url)
        if c is None:
            c = self._clients[url] = await RefitClient(url, token=self.token).__aenter__()
        return c

    async def close(self) -> None:
        await super().close()
        for c in self._clients.values():
            await c.close()
        self._clients.clear()

    async def refit(
        self,
        version: int | None = None,
        *,
        on_progress: Callable[[PullProgress], None] | None = None,
    ) -> RefitStats:
        """Refit to ``version`` (the newest complete one by default) from every
        daemon holding parts of it."""
        t0 = time.perf_counter()
        await self._place_engine()
        found = await self.local.cluster_version(
            self.model, "latest" if version is None else version
        )
        if not found.complete:
            # Its last parts may be a watch event away: wait for the registry to say
            # so (pushed, one request), then look again.
            with contextlib.suppress(NotFoundError):
                await self.local.next_version(self.model, found.version - 1, self.discovery_s)
            found = await self.local.cluster_version(self.model, found.version)
        if not found.complete:
            raise ConflictError(
                f"{self.model!r} v{found.version} is not complete across the cluster: "
                f"holders {[(h.node_id, h.parts) for h in found.holders]} of "
                f"{found.expected_parts} parts"
            )
        holders = found.holders
        clients = [await self._client(h.url) for h in holders]
        async with contextlib.AsyncExitStack() as stack:
            leases: list[LeaseInfo] = []
            for c in clients:  # each held until the refit ends, then released
                acquiring = c.acquire_lease(
                    self.model, found.version, self.lease_ttl_s, label="receiver"
                )
                held = held_lease(c, acquiring, self.lease_ttl_s)
                leases.append((await stack.enter_async_context(held)).granted)
            return await self._refit_holders(
                found.version, holders, clients, leases, t0, on_progress
            )

    async def _refit_holders(
        self,
        version: int,
        holders: list[SourceRecord],
        clients: list[RefitClient],
        leases: list[LeaseInfo],
        t0: float,
        on_progress: Callable[[PullProgress], None] | None,
    ) -> RefitStats:
        manifests = await asyncio.gather(*(c.manifest(self.model, version) for c in clients))
        m = merge_manifests(list(manifests))
        t1 = time.perf_counter()
        comp, replayed = await self._compiled_for(m, version)
        t2 = time.perf_counter()
        owner = comp.rows[:, 0] // REGION_STRIDE
        pack_owner = [p.src_region // REGION_STRIDE for p in comp.packs]
        requests: list[tuple[SourceRecord, PullRequest]] = []
        for i, (h, c, lease) in enumerate(zip(holders, clients, leases, strict=True)):
            rows = comp.rows[owner == i].copy()
            rows[:, 0] -= i * REGION_STRIDE
            packs = [
                msgspec.structs.replace(p, src_region=p.src_region - i * REGION_STRIDE)
                for p, o in zip(comp.packs, pack_owner, strict=True)
                if o == i
            ]
            if rows.shape[0] == 0 and not packs:
                continue
            url = "" if c is self.local else h.url
            requests.append(
                (
                    h,
                    PullRequest(
                        self.model, version, lease.lease_id, DescriptorTable.pack(rows), packs, url
                    ),
                )
            )
        results = await asyncio.gather(
            *(self.local.pull(req, on_progress=on_progress) for _, req in requests),
            return_exceptions=True,
        )
        failed = [
            (h, r)
            for (h, _), r in zip(requests, results, strict=True)
            if isinstance(r, BaseException)
        ]
        for _, res in failed:
            if not isinstance(res, RefitError):
                raise res
        if failed:
            # Every failed holder is named: one host dying can fail the others' pulls
            # too (the data plane restarts), and the caller must see which one died.
            first = self._name_suspects(failed[0][1])  # type: ignore[arg-type]
            detail = "; ".join(f"from {h.node_id!r} at {h.url}: {r}" for h, r in failed)
            raise type(first)(
                f"refit of {self.model!r} v{version} failed, nothing installed: {detail}"
            ) from failed[0][1]
        last = [r for r in results if isinstance(r, PullProgress)]
        return self._install_timed(comp, version, replayed, (t0, t1, t2), last[0])
