"""The host worker of ``refitd bench fanout``: a trainer or engine process on one
simulated host, driven by JSON lines on stdin.

``python -m refitd.bench.fanoutwork`` runs on one host of :mod:`refitd.bench.simhosts`
(started through ``SimHost.wrap``, :func:`refitd.bench.fanoutcases.start_worker`), so
its shared memory is that host's. Each line on stdin is one request ``{"op": …,
"token": …, …}`` (``token``: the daemons' bearer token); each answer is one JSON line
on stdout, ``{"ok": false, "error": class, "detail": message}`` when refitd refused
or failed. The ops are :class:`Worker`'s methods of the same name: ``publish``,
``prepare``, ``replicas``, ``verify``, ``forget``, ``mirror`` and ``pulls``;
``{"op": "quit"}`` closes everything and exits.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

__all__ = ["Worker", "main", "pattern"]


def pattern(n: int, version: int) -> Any:
    """``n`` bytes that differ from position to position and from version to version."""
    import numpy as np

    words = np.arange((n + 7) // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    words += np.uint64(version)
    return words.view(np.uint8)[:n]


class Worker:
    def __init__(self) -> None:
        self.clients: dict[str, Any] = {}
        self.prepared: dict[str, list[Any]] = {}  # daemon URL -> regions made by prepare
        self.pulled: list[tuple[str, Any]] = []  # (daemon URL, region) pulled, unchecked

    async def client(self, url: str, token: str) -> Any:
        from refitd.client.http import RefitClient

        c = self.clients.get(url)
        if c is None:
            c = self.clients[url] = await RefitClient(url, token=token).__aenter__()
        return c

    async def publish(self, req: dict[str, Any]) -> dict[str, Any]:
        """Version ``version``: one uint8 tensor of ``nbytes`` in a new region."""
        from refitd.wire import ManifestIn, ShardEntry, TensorEntry
        from transports.segments import SharedSegment

        c = await self.client(req["url"], req["token"])
        n, version = int(req["nbytes"]), int(req["version"])
        region = await c.create_region(n, label=f"model-v{version}")
        seg = SharedSegment.attach(region.handle, n)
        seg.numpy()[:] = pattern(n, version)
        seg.close()
        t = TensorEntry("w", (n,), "uint8", [ShardEntry((0,), (n,), region.region_id, 0)])
        await c.publish(ManifestIn("fanout", version, 0, 1, [t]))
        return {"ok": True}

    async def prepare(self, req: dict[str, Any]) -> dict[str, Any]:
        """``count`` engine memories of ``nbytes`` at ``local``, every page touched (an
        engine's weights exist before a refit): made before the clock starts."""
        from transports.segments import SharedSegment

        local = await self.client(req["local"], req["token"])
        n = int(req["nbytes"])
        for _ in range(int(req["count"])):
            dst = await local.create_region(n, label="replica")
            seg = SharedSegment.attach(dst.handle, n)
            seg.numpy()[:] = 0
            seg.close()
            self.prepared.setdefault(req["local"], []).append(dst)
        return {"ok": True}

    async def replicas(self, req: dict[str, Any]) -> dict[str, Any]:
        """``count`` replicas at once, each leasing ``version`` at ``source`` and pulling
        it whole through ``local`` into memory :meth:`prepare` made. Answers the paths
        and when the last pull ended (``time.time()``: the simulated hosts share one
        clock); :meth:`verify` checks the bytes later, so that checking on one host
        does not take the CPU from pulls still running on another. When one replica
        fails (its daemon was killed), the answer is that failure, once every
        replica's pull has ended."""
        got = await asyncio.gather(
            *(self._replica(req) for _ in range(int(req["count"]))), return_exceptions=True
        )
        results: list[tuple[str, float]] = []
        for r in got:
            if isinstance(r, BaseException):
                raise r
            results.append(r)
        return {
            "ok": True,
            "paths": sorted({p for p, _ in results}),
            "held_at": max(t for _, t in results),
        }

    async def _replica(self, req: dict[str, Any]) -> tuple[str, float]:
        import numpy as np

        from refitd.wire import DescriptorTable, PullRequest

        local = await self.client(req["local"], req["token"])
        source = await self.client(req["source"], req["token"])
        n, version = int(req["nbytes"]), int(req["version"])
        lease = await source.acquire_lease("fanout", version, 300.0)
        try:
            manifest = await source.manifest("fanout", version)
            shard = manifest.tensors[0].shards[0]
            dst = self.prepared[req["local"]].pop()
            self.pulled.append((req["local"], dst))
            rows = np.array([[shard.region, shard.byte_offset, dst.region_id, 0, n]], np.int64)
            pull = PullRequest(
                "fanout", version, lease.lease_id, DescriptorTable.pack(rows), [], req["source"]
            )
            done = await local.pull(pull)
            return str(done.path), time.time()
        finally:
            await source.release_lease(lease.lease_id)

    async def verify(self, req: dict[str, Any]) -> dict[str, Any]:
        """Whether every replica :meth:`replicas` pulled holds ``version`` bit for bit;
        their memory is freed."""
        import numpy as np

        from transports.segments import SharedSegment

        n, version = int(req["nbytes"]), int(req["version"])
        want = pattern(n, version)
        ok = bool(self.pulled)
        for url, dst in self.pulled:
            seg = SharedSegment.attach(dst.handle, n)
            try:
                ok = ok and bool(np.array_equal(seg.numpy(), want))
            finally:
                seg.close()
            await (await self.client(url, req["token"])).delete_region(dst.region_id)
        self.pulled.clear()
        return {"ok": True, "verified": ok}

    async def forget(self, req: dict[str, Any]) -> dict[str, Any]:
        """Drop every region this worker made or pulled at the daemon ``url`` without
        asking it (a daemon that was killed: its regions went with it), and its client."""
        url = req["url"]
        self.prepared.pop(url, None)
        self.pulled = [(u, dst) for u, dst in self.pulled if u != url]
        c = self.clients.pop(url, None)
        if c is not None:
            await c.__aexit__(None, None, None)
        return {"ok": True}

    async def mirror(self, req: dict[str, Any]) -> dict[str, Any]:
        """The state of the mirror of ``version`` at the daemon ``url``."""
        import msgspec

        from refitd.wire import routes as api

        c = await self.client(req["url"], req["token"])
        st = await c.send(api.MIRROR_STATE, model="fanout", version=int(req["version"]))
        out: dict[str, Any] = msgspec.to_builtins(st)
        return out

    async def pulls(self, req: dict[str, Any]) -> dict[str, Any]:
        """The pulls the daemon ``url`` lists to this worker's principal."""
        import msgspec

        from refitd.wire import routes as api

        c = await self.client(req["url"], req["token"])
        return {"ok": True, "pulls": msgspec.to_builtins(await c.send(api.LIST_PULLS))}

    async def close(self) -> None:
        for c in self.clients.values():
            await c.__aexit__(None, None, None)


def main() -> int:
    from refitd.bench.simhosts import serve_worker

    return serve_worker(
        Worker(), ("publish", "prepare", "replicas", "verify", "forget", "mirror", "pulls")
    )


if __name__ == "__main__":
    raise SystemExit(main())
