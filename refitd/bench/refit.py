"""``refitd bench refit`` and the daemon demo: trainer → two daemons → engine refit.

Shared pieces used by the end-to-end tests too:

- :func:`publish_layout` publishes a trainer layout from :mod:`refitd.bench.layouts`
  (every rank one publisher slot) through a :class:`~refitd.client.Publisher`;
- :func:`capture_for` returns the capture callable a receiver needs for a layout
  (through the layout's ``convert`` when it has one).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from refitd.bench.layouts import Published
    from refitd.client.http import RefitClient

__all__ = ["add_arguments", "capture_for", "publish_layout", "run"]


async def publish_layout(
    client: RefitClient,
    model: str,
    published: Published,
    version: int,
    publishers: list[Any] | None = None,
) -> list[Any]:
    """Publish every rank of ``published`` as one slot of ``version``; returns the
    publishers. Pass the publishers of an earlier version (same layout) to rewrite
    their memory in place, so the manifest's placement is unchanged and a receiver
    replays its compiled plan; wait for that version's leases to drain first."""
    from refitd.client.publisher import Publisher

    sessions = sorted(published.buffers, key=lambda s: int(s[len(published.layout) :]))
    pubs = list(publishers or [])
    for slot, session in enumerate(sessions):
        buf = published.buffers[session]
        if slot >= len(pubs):
            pub = Publisher(client, model, slot, len(sessions))
            await pub.reserve(buf.numel() + 64 * (len(published.sources) + 1), label=session)
            pubs.append(pub)
        pub = pubs[slot]
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
    from refitd.bench.engines import default_weight_loader
    from refitd.reshard.geometry import capture_geometry, capture_weights, convert_source_weights

    convert = published.convert

    def capture(twin: torch.nn.Module, manifest: list[Any]) -> Any:
        if convert is None:
            return capture_geometry(twin, manifest, default_weight_loader)
        return capture_weights(
            twin, convert_source_weights(convert, manifest), default_weight_loader
        )

    return capture


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gib", type=float, default=2.0, help="model size in GiB")
    parser.add_argument("--versions", type=int, default=3, help="versions to refit")


def run(args: argparse.Namespace) -> int:
    raise SystemExit("refitd bench refit: not implemented yet")
