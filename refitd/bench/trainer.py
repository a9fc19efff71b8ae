"""The trainer side of ``bench refit`` and of the end-to-end tests: a trainer layout
published, the capture a receiver of it runs, and the trainer process.

- :func:`publish_layout` publishes a trainer layout from :mod:`refitd.testing.layouts`
  (every rank one publisher part) through a :class:`~refitd.client.Publisher`;
- :func:`capture_for` returns the capture callable a receiver needs for a layout
  (through the layout's ``convert`` when it has one);
- ``python -m refitd.bench.trainer URL MODEL GIB TP`` is the trainer process bench
  refit runs beside its engine: it publishes versions of the synthetic model
  (:mod:`refitd.bench.synthetic`) as Megatron TP ``TP`` on command.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from refitd.bench.synthetic import SyntheticState, synthetic_config

if TYPE_CHECKING:
    import torch

    from refitd.client.http import RefitClient
    from refitd.testing.layouts import Published

__all__ = ["capture_for", "publish_layout", "trainer_main"]


async def publish_layout(
    client: RefitClient,
    model: str,
    published: Published,
    version: int,
    publishers: list[Any] | None = None,
    parts: list[int] | None = None,
) -> list[Any]:
    """Publish every rank of ``published`` (or only ranks ``parts``: a trainer split
    over hosts publishes each host's ranks to its own daemon) as one part of
    ``version``; returns the publishers, by part (None for a part not published
    here). Pass the publishers of an earlier version (same layout) to rewrite
    their memory in place, so the manifest's placement is unchanged and a receiver
    replays its compiled plan; wait for that version's leases to drain first."""
    from refitd.client.publisher import Publisher

    sessions = sorted(published.buffers, key=lambda s: int(s[len(published.layout) :]))
    pubs: list[Any] = list(publishers or [])
    pubs += [None] * (len(sessions) - len(pubs))
    for part in range(len(sessions)) if parts is None else parts:
        session = sessions[part]
        buf = published.buffers[session]
        if pubs[part] is None:
            pubs[part] = Publisher(client, model, part, len(sessions))
            await pubs[part].reserve(buf.numel() + 64 * (len(published.sources) + 1), label=session)
        pub = pubs[part]
        base = buf.data_ptr()
        for name, info in published.sources.items():
            for sh in info.shards:
                if sh.session != session:
                    continue
                n = math.prod(sh.shape) * info.elsize
                at = sh.addr - base
                block = buf[at : at + n].view(info.dtype).view(sh.shape)
                pub.put(name, block, tuple(info.global_shape), tuple(sh.shard_offset))
        await pub.publish(version)
    return pubs


def capture_for(published: Published) -> Callable[[torch.nn.Module, list[Any]], Any]:
    """The receiver's capture callable for a trainer layout."""
    from refitd.reshard.geometry import capture_geometry, capture_weights, convert_source_weights
    from refitd.testing.engines import default_weight_loader

    convert = published.convert

    def capture(twin: torch.nn.Module, manifest: list[Any]) -> Any:
        if convert is None:
            return capture_geometry(twin, manifest, default_weight_loader)
        return capture_weights(
            twin, convert_source_weights(convert, manifest), default_weight_loader
        )

    return capture


def trainer_main(argv: list[str]) -> int:
    """The trainer process: publish versions of the synthetic model on command.

    Reads ``publish V`` lines on stdin, answers ``published V BYTES`` on stdout once
    version V is READY at the daemon; ``quit`` ends it.
    """
    import asyncio
    import gc

    import uvloop

    from refitd.client.http import RefitClient
    from refitd.testing.layouts import megatron_tp_ep

    url, model, gib, tp = argv[0], argv[1], float(argv[2]), int(argv[3])
    cfg = synthetic_config(gib)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        pubs: list[Any] = []
        async with RefitClient(url) as client:
            while line := (await reader.readline()).decode().split():
                if line[0] == "quit":
                    break
                version = int(line[1])
                if pubs:
                    # Readers of the previous version must be done before we overwrite.
                    await pubs[0].wait_drain(version - 1)
                published = megatron_tp_ep(cfg, tp, 1, SyntheticState(cfg, version))
                pubs = await publish_layout(client, model, published, version, pubs)
                nbytes = published.published_bytes
                del published
                gc.collect()
                sys.stdout.write(f"published {version} {nbytes}\n")
                sys.stdout.flush()
            for p in pubs:
                await p.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
    return 0


if __name__ == "__main__":
    sys.exit(trainer_main(sys.argv[1:]))
