"""Toy-engine helpers shared by the refit tests: a zeroed engine, a bit-exact check,
and a toy engine refitted in swap mode (:func:`swap_engine`, or
:func:`serving_swap_engine` with its two daemons served in this process)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from refitd.bench.refit import capture_for, publish_layout
from refitd.client.http import RefitClient
from refitd.client.receiver import DaemonReceiver
from refitd.daemon.app.node import Daemon
from refitd.testing.engines import EngineParallel, ModelConfig, ToyEngine, dense_toy_config
from refitd.testing.layouts import fsdp_dim0, full_state
from support.daemons import serving_daemons

SWAP_SEEDS: dict[int, int | None] = {1: None, 2: 3, 3: 5}
"""Version -> the seed of the checkpoint :meth:`SwapEngine.publish` publishes as it
(None: :func:`~refitd.testing.layouts.full_state`'s distinct values), so each
version's bytes differ from the others'."""


def zeroed_engine(cfg: ModelConfig, par: EngineParallel) -> ToyEngine:
    """An engine rank whose every parameter is zero (so a missed write shows)."""
    eng = ToyEngine(cfg, par)
    with torch.no_grad():
        for p in eng.parameters():
            p.zero_()
    return eng


def mismatched(
    engine: torch.nn.Module, cfg: ModelConfig, par: EngineParallel, state: dict[str, torch.Tensor]
) -> list[str]:
    """Names of ``engine``'s parameters that differ, bit for bit, from what the
    engine's own loader makes of the full checkpoint ``state`` (empty: all equal)."""
    truth = ToyEngine(cfg, par)
    truth.load_weights(state.items())
    want = dict(truth.named_parameters())
    return [n for n, p in engine.named_parameters() if not torch.equal(p, want[n])]


@dataclass
class SwapEngine:
    """A zeroed toy engine (the dense toy model, TP 2) and the swap-mode
    :class:`~refitd.client.receiver.DaemonReceiver` that refits it, with the
    trainer's side: :meth:`publish` publishes a version (FSDP over 2 ranks) at
    ``source``, and :meth:`mismatched` checks the engine against it."""

    cfg: ModelConfig
    par: EngineParallel
    engine: ToyEngine
    receiver: DaemonReceiver
    source: RefitClient
    model: str
    published: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Version -> the full checkpoint published as it."""
    publishers: list[Any] = field(default_factory=list)
    """Every publisher of every version, closed when the block ends."""

    async def publish(self, version: int, like: int | None = None) -> None:
        """Publish ``version`` with the checkpoint of version ``like`` (by default its
        own: :data:`SWAP_SEEDS`); a version publishes into regions of its own."""
        state = full_state(self.cfg, seed=SWAP_SEEDS[version if like is None else like])
        layout = fsdp_dim0(self.cfg, 2, state)
        self.publishers += await publish_layout(self.source, self.model, layout, version)
        self.published[version] = state

    @property
    def local(self) -> RefitClient:
        """The client of the engine's own daemon (the one its pulls run at)."""
        return self.receiver.local

    def mismatched(self, version: int) -> list[str]:
        """The engine's parameters that differ, bit for bit, from what its loader makes
        of the checkpoint published as ``version`` (empty: the engine holds it)."""
        return mismatched(self.engine, self.cfg, self.par, self.published[version])


@contextlib.asynccontextmanager
async def swap_engine(
    local: RefitClient, source: RefitClient, model: str = "m"
) -> AsyncIterator[SwapEngine]:
    """A :class:`SwapEngine` whose receiver pulls through ``local`` from versions of
    ``model`` published at ``source`` (leases of 30 s). Nothing is published yet; when
    the block ends the receiver and every publisher are closed."""
    cfg, par = dense_toy_config(), EngineParallel(2, 1)
    engine = zeroed_engine(cfg, par)
    receiver = DaemonReceiver(
        local=local,
        source=source,
        model=model,
        engine=engine,
        twin=lambda: ToyEngine(cfg, par),
        capture=capture_for(fsdp_dim0(cfg, 2, full_state(cfg))),
        lease_ttl_s=30.0,
        mode="swap",
    )
    toy = SwapEngine(cfg, par, engine, receiver, source, model)
    try:
        yield toy
    finally:
        await receiver.close()
        for p in toy.publishers:
            await p.close()


@contextlib.asynccontextmanager
async def serving_swap_engine(local: Daemon, source: Daemon) -> AsyncIterator[SwapEngine]:
    """:func:`swap_engine` with its daemons served in this process for the block
    (:func:`~support.daemons.serving_daemons`: each trusts the other): the engine's
    at ``local``, the versions published at ``source``."""
    async with (
        serving_daemons(source, local) as (at_source, at_local),
        swap_engine(at_local, at_source) as toy,
    ):
        yield toy
