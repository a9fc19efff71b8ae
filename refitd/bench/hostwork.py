"""A trainer or engine process on a simulated host, driven by JSON lines on stdin.

``python -m refitd.bench.hostwork`` runs on one host of :mod:`refitd.bench.simhosts`
(started through ``SimHost.wrap``), so its shared memory is that host's. Each line
on stdin is one command; each answer is one JSON line on stdout:

- ``{"op": "publish", "url", "model", "gib", "layout", "world", "ranks", "version"}``
  publishes trainer ranks ``ranks`` of a ``world``-rank layout (``"fsdp"``: dim-0
  shards, ``"megatron"``: TP) of the synthetic model as publisher parts of
  ``version`` at the daemon ``url``. A later version rewrites the same memory once
  the previous one has drained, so receivers replay their compiled plans.
  Answers ``{"ok": true, "bytes": N}``.
- ``{"op": "refit", "local", "source" | "sources", "model", "gib", "layout", "world",
  "tp", "version"}`` refits ``tp`` engine ranks (made on first use, kept) through the
  daemon ``local``, reading from the daemon(s) holding the version, then checks every
  parameter bit for bit. Answers ``{"ok": true, "verified", "replayed", "paths",
  "bytes", "seconds"}``, or ``{"ok": false, "error": class, "detail": message,
  "unchanged": bool}`` where ``unchanged`` says every parameter still holds the
  previous version (nothing was installed).
- ``{"op": "quit"}`` closes everything and exits.

Every request carries ``token``: the bearer token of the daemons (they listen on a
non-loopback address, which needs one).
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

__all__ = ["main"]


def _layout(cfg: Any, name: str, world: int, state: Any) -> Any:
    from refitd.testing.layouts import fsdp_dim0, megatron_tp_ep

    if name == "fsdp":
        return fsdp_dim0(cfg, world, state)
    if name == "megatron":
        return megatron_tp_ep(cfg, world, 1, state)
    raise ValueError(f"unknown layout {name!r}: 'fsdp' or 'megatron'")


def pattern(n: int) -> Any:
    """``n`` bytes that differ from position to position (cheap to make twice)."""
    import numpy as np

    words = np.arange((n + 7) // 8, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    return words.view(np.uint8)[:n]


class Worker:
    def __init__(self) -> None:
        self.clients: dict[str, Any] = {}
        self.publishers: dict[str, list[Any]] = {}  # model -> Publisher by part (or None)
        self.published: dict[str, int] = {}  # model -> last version published here
        self.ranks: dict[str, list[Any]] = {}  # model -> [(par, engine, receiver)]
        self.cfgs: dict[float, Any] = {}
        self._pending: asyncio.Task[dict[str, Any]] | None = None

    def cfg(self, gib: float) -> Any:
        from refitd.bench.synthetic import synthetic_config

        if gib not in self.cfgs:
            self.cfgs[gib] = synthetic_config(gib)
        return self.cfgs[gib]

    async def client(self, url: str, token: str) -> Any:
        from refitd.client.http import RefitClient

        c = self.clients.get(url)
        if c is None:
            c = self.clients[url] = await RefitClient(url, token=token).__aenter__()
        return c

    async def publish(self, req: dict[str, Any]) -> dict[str, Any]:
        from refitd.bench.synthetic import SyntheticState
        from refitd.bench.trainer import publish_layout

        client = await self.client(req["url"], req["token"])
        model, version, world = req["model"], int(req["version"]), int(req["world"])
        cfg = self.cfg(float(req["gib"]))
        published = _layout(cfg, req["layout"], world, SyntheticState(cfg, version))
        sessions = sorted(published.buffers, key=lambda s: int(s[len(published.layout) :]))
        last = self.published.get(model)
        if last is not None:
            await self.publishers[model][int(req["ranks"][0])].wait_drain(last)
        ranks = [int(r) for r in req["ranks"]]
        self.publishers[model] = await publish_layout(
            client, model, published, version, self.publishers.get(model), parts=ranks
        )
        nbytes = sum(published.buffers[sessions[r]].numel() for r in ranks)
        self.published[model] = version
        return {"ok": True, "bytes": nbytes}

    async def refit(self, req: dict[str, Any]) -> dict[str, Any]:
        from refitd.bench.synthetic import verify_ranks
        from refitd.bench.trainer import capture_for
        from refitd.client.multihost import ClusterReceiver
        from refitd.client.receiver import DaemonReceiver
        from refitd.errors import RefitError
        from refitd.testing.engines import EngineParallel, ToyEngine

        model, tp = req["model"], int(req["tp"])
        cfg = self.cfg(float(req["gib"]))
        local = await self.client(req["local"], req["token"])
        ranks = self.ranks.get(model)
        if ranks is None:
            capture = capture_for(_layout(cfg, req["layout"], int(req["world"]), None))
            ranks = []
            for rank in range(tp):
                par = EngineParallel(tp, rank)
                engine = ToyEngine(cfg, par)
                common = {
                    "model": model,
                    "engine": engine,
                    "twin": functools.partial(ToyEngine, cfg, par),
                    "capture": capture,
                }
                if req.get("source"):
                    source = await self.client(req["source"], req["token"])
                    r: Any = DaemonReceiver(local=local, source=source, **common)
                else:  # where the version lives comes from the cluster registry
                    r = ClusterReceiver(local=local, token=req["token"], **common)
                ranks.append((par, engine, r))
            self.ranks[model] = ranks
        version = int(req["version"])
        t = time.perf_counter()
        results = await asyncio.gather(
            *(r.refit(version) for _, _, r in ranks), return_exceptions=True
        )
        errors = [
            (rank, e)
            for rank, e in zip(ranks, results, strict=True)
            if isinstance(e, BaseException)
        ]
        for _, e in errors:
            if not isinstance(e, RefitError):
                raise e
        if errors:
            # Each rank installs only a refit that fully succeeded: the ranks that
            # failed must still hold the previous version, bit for bit.
            before = req.get("previous")
            unchanged = before is not None and verify_ranks(
                cfg, int(before), [r for r, _ in errors]
            )
            return {
                "ok": False,
                "error": type(errors[0][1]).__name__,
                "detail": " | ".join(str(e) for _, e in errors),
                "failed_ranks": len(errors),
                "unchanged": unchanged,
            }
        stats = [s for s in results if not isinstance(s, BaseException)]
        seconds = time.perf_counter() - t
        return {
            "ok": True,
            "verified": verify_ranks(cfg, version, ranks),
            "replayed": all(s.replayed for s in stats),
            "paths": sorted({s.pull.path for s in stats}),
            "bytes": sum(s.bytes for s in stats),
            "seconds": seconds,
        }

    async def refit_start(self, req: dict[str, Any]) -> dict[str, Any]:
        """Start :meth:`refit` in the background; :meth:`refit_wait` answers it."""
        self._pending = asyncio.create_task(self.refit(req))
        return {"ok": True}

    async def refit_wait(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self._pending is not None, "refit_wait without refit_start"
        out: dict[str, Any] = await self._pending
        return out

    async def pulls(self, req: dict[str, Any]) -> dict[str, Any]:
        """The local daemon's pulls: state and bytes done (to see one under way)."""
        local = await self.client(req["local"], req["token"])
        return {
            "ok": True,
            "pulls": [
                {"state": str(p.state), "bytes_done": p.bytes_done, "path": p.path}
                for p in await local.pulls()
            ],
        }

    async def source(self, req: dict[str, Any]) -> dict[str, Any]:
        """A daemon region of ``nbytes`` filled with :func:`pattern`, published as
        version 1 of ``model`` (one uint8 tensor): the far end of ``pull_bytes``."""
        from refitd.wire import ManifestIn, ShardEntry, TensorEntry
        from transports.segments import SharedSegment

        client = await self.client(req["url"], req["token"])
        n = int(req["nbytes"])
        region = await client.create_region(n, label="bench-source")
        seg = SharedSegment.attach(region.handle, n)
        seg.numpy()[:] = pattern(n)
        seg.close()
        t = TensorEntry("blob", (n,), "uint8", [ShardEntry((0,), (n,), region.region_id, 0)])
        await client.publish(ManifestIn(req["model"], 1, 0, 1, [t]))
        return {"ok": True, "region": region.region_id}

    async def pull_bytes(self, req: dict[str, Any]) -> dict[str, Any]:
        """Pull ``nbytes`` of region ``region`` at ``source`` into a new region of the
        local daemon ``repeat`` times; answers each pull's seconds (submit to done,
        control plane included), its path, and whether every byte matched.

        ``piece`` (bytes, optional): the pull is ``nbytes / piece`` descriptors of that
        size, each destination piece reading a shuffled source piece (no two merge),
        as a refit's scattered layout does; absent, one descriptor of every byte."""
        import numpy as np

        from refitd.wire import DescriptorTable, PullRequest
        from transports.segments import SharedSegment

        local = await self.client(req["local"], req["token"])
        source = await self.client(req["source"], req["token"])
        n = int(req["nbytes"])
        dst = await local.create_region(n, label="bench-dest")
        seg = SharedSegment.attach(dst.handle, n)
        view = seg.numpy()
        piece = int(req.get("piece") or n)
        count = n // piece
        perm = np.random.default_rng(piece).permutation(count) if count > 1 else np.zeros(1, int)
        rows = np.empty((count, 5), dtype=np.int64)
        rows[:, 0], rows[:, 1] = int(req["region"]), perm * piece
        rows[:, 2], rows[:, 3], rows[:, 4] = dst.region_id, np.arange(count) * piece, piece
        want = pattern(count * piece).reshape(count, piece)[perm]
        seconds, paths, ok = [], set(), True
        for _ in range(int(req.get("repeat", 1))):
            view[:] = 0
            lease = await source.acquire_lease(req["model"], 1, 120.0)
            pull = PullRequest(
                req["model"], 1, lease.lease_id, DescriptorTable.pack(rows), [], req["source"]
            )
            t = time.perf_counter()
            done = await local.pull(pull)
            seconds.append(time.perf_counter() - t)
            await source.release_lease(lease.lease_id)
            paths.add(done.path)
            ok = ok and bool(np.array_equal(view[: count * piece].reshape(count, piece), want))
        seg.close()
        await local.delete_region(dst.region_id)
        return {"ok": True, "seconds": seconds, "paths": sorted(paths), "verified": ok}

    async def close(self) -> None:
        for ranks in self.ranks.values():
            for _, _, r in ranks:
                await r.close()
        for pubs in self.publishers.values():
            for pub in pubs:
                if pub is not None:
                    await pub.close()
        for c in self.clients.values():
            await c.__aexit__(None, None, None)


def main() -> int:
    from refitd.bench.simhosts import serve_worker

    return serve_worker(
        Worker(), ("publish", "refit", "refit_start", "refit_wait", "pulls", "source", "pull_bytes")
    )


if __name__ == "__main__":
    raise SystemExit(main())
