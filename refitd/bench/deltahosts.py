"""``refitd bench delta --link-gbit R``: the delta bench across a link slower than memory.

Two simulated hosts (:mod:`refitd.bench.simhosts`: network namespaces, a private
``/dev/shm`` each), both links shaped to ``R`` Gbit/s with ``tc``. Host ``a`` runs
the trainer's daemon (deltas on) and a process training and publishing the model
(:class:`~refitd.bench.deltamodel.Trainer`); host ``b`` runs the engines' daemon and a
process holding both TP 2 engines (:class:`~refitd.bench.deltamodel.Engines`), whose
pulls cross the link. Each process answers one JSON request per line on its stdin;
this driver prints the same table and last lines as the one-host run, with
``link_gbit=R``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from typing import Any

__all__ = ["across"]

_ARGS = ("hidden", "layers", "vocab", "steps", "lr", "batch", "seq", "prefer", "chunk_mib")


def across(args: argparse.Namespace) -> int:
    import uvloop

    from refitd.bench.simhosts import missing

    why = missing()
    if why is not None:
        print(f"refitd bench delta --link-gbit: cannot run here: {why}")
        return 2
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_across(args))


async def _across(args: argparse.Namespace) -> int:
    from refitd.bench.deltamodel import Report
    from refitd.bench.hostpaths import shape
    from refitd.bench.simhosts import Cluster, HostWorker, SimHost, SimNet

    sent = {k: getattr(args, k) for k in _ARGS}
    with tempfile.TemporaryDirectory() as tmp:
        async with SimNet() as net:
            a, b = await net.add_host("a"), await net.add_host("b")
            for h in (a, b):
                await shape(h, args.link_gbit)
            async with Cluster(net, tmp) as cluster:

                async def role(host: SimHost) -> HostWorker:
                    proc = await host.exec(
                        sys.executable,
                        "-m",
                        "refitd.bench.deltahosts",
                        stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.PIPE,
                    )
                    w = HostWorker(host, proc, cluster.token)
                    cluster.stack.push_async_callback(w.close)
                    return w

                async def call(w: HostWorker, op: str, **req: Any) -> dict[str, Any]:
                    out = await w.call(op, 600.0, **req)
                    if not out.get("ok"):
                        raise RuntimeError(f"{op} on {w.host.name} failed: {out.get('detail')}")
                    return out

                src = await cluster.daemon(a, "trainer-host", "--set", "pulls.deltas=true")
                mirrored = ("--set", "mirrors.policy=always") if args.mirror else ()
                dst = await cluster.daemon(b, "engine-host", *mirrored)
                trainer, engines = await role(a), await role(b)
                opened = await call(trainer, "open", args=sent, url=src.url)
                behind = ", the engines' daemon mirroring every version" if args.mirror else ""
                print(
                    f"{opened['describe']}; link {args.link_gbit:g} Gbit/s, trainer and engines "
                    f"on two hosts{behind}"
                )
                await call(engines, "open", args=sent, local=dst.url, source=src.url)
                await call(trainer, "version", v=1)
                await call(engines, "refit", v=1)
                report = Report()
                for v in range(2, args.steps + 2):
                    got = await call(trainer, "version", v=v)
                    report.version(v, got, await call(engines, "refit", v=v))
                await call(engines, "close")
    return report.end(f"link_gbit={args.link_gbit:g} ")


class _Role:
    """One host's side: ``open`` makes the trainer (``url``) or the engines (``local``,
    ``source``); ``version`` and ``refit`` call them; ``close`` closes the engines."""

    def __init__(self) -> None:
        self.clients: list[Any] = []
        self.trainer: Any = None
        self.engines: Any = None

    async def _client(self, url: str, token: str) -> Any:
        from refitd.client.http import RefitClient

        c = await RefitClient(url, token=token).__aenter__()
        self.clients.append(c)
        return c

    async def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        from refitd.bench.deltamodel import Engines, Trainer

        op, token = req["op"], req["token"]
        if op == "open":
            args = argparse.Namespace(**req["args"])
            if "url" in req:
                self.trainer = Trainer(args, await self._client(req["url"], token))
                return {"ok": True, "describe": self.trainer.describe()}
            local = await self._client(req["local"], token)
            source = await self._client(req["source"], token)
            self.engines = Engines(args, local, source, args.prefer)
            return {"ok": True}
        if op == "version":
            return {"ok": True, **await self.trainer.version(int(req["v"]))}
        if op == "refit":
            return {"ok": True, **await self.engines.refit(int(req["v"]))}
        if op == "close":
            await self.engines.close()
            return {"ok": True}
        return {"ok": False, "detail": f"unknown op {op!r}"}

    async def close(self) -> None:
        for c in self.clients:
            await c.__aexit__(None, None, None)


async def _serve() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    role = _Role()
    try:
        while line := await reader.readline():
            req = json.loads(line)
            if req.get("op") == "quit":
                break
            out = await role.handle(req)
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()
    finally:
        await role.close()


if __name__ == "__main__":
    asyncio.run(_serve())
