"""Refits through a host mirror (``[mirrors] policy = "always"`` on the engine's host)
for every pairing of trainer layout and engine layout a direct refit supports: dense
FSDP dim-0 over 1 and 3 ranks and Megatron TP 1/2/4, MoE Megatron TP 2 x EP 2 and
FSDP, into engine TP 1/2/4 (MoE with EP), each with the planner's default descriptor
budget and with a budget of 2 (strided copies become pack specs: runs under 256 B are
packed by the mirror's daemon, longer ones read directly, both while the mirror may
still fill). Every engine byte is compared with a direct refit of the same engine
layout from the trainer's own daemon, and with the engine's own loader.

Two real daemons over ``tcp`` (as if on two hosts), shared by the module.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
import torch
from support.engines import mismatched, zeroed_engine

from refitd.bench.refit import capture_for, publish_layout
from refitd.client.http import RefitClient
from refitd.client.receiver import DaemonReceiver
from refitd.client.spawn import spawn_daemon
from refitd.testing.engines import (
    EngineParallel,
    ModelConfig,
    ToyEngine,
    dense_toy_config,
    moe_toy_config,
)
from refitd.testing.layouts import Published, fsdp_dim0, full_state, megatron_tp_ep
from refitd.wire import routes as api
from refitd.wire.mirrors import MirrorState

pytestmark = [pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

DENSE = dense_toy_config(torch.bfloat16)
MOE = moe_toy_config(torch.bfloat16)
WIDE = ModelConfig(
    vocab_size=1024,
    hidden_size=256,
    num_layers=1,
    intermediate_size=512,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    dtype=torch.float32,
)
"""Tensors of 1 MiB and more (regions of several mirror chunks, reads across their
edges) and row-parallel runs of 256 B at engine TP 4 (read directly, not packed)."""

Layout = Callable[[ModelConfig, Any], Published]

TRAINERS: dict[str, tuple[ModelConfig, Layout]] = {
    "fsdp1": (DENSE, lambda c, s: fsdp_dim0(c, 1, s)),
    "fsdp3": (DENSE, lambda c, s: fsdp_dim0(c, 3, s)),
    "megatron-tp1": (DENSE, lambda c, s: megatron_tp_ep(c, 1, 1, s)),
    "megatron-tp2": (DENSE, lambda c, s: megatron_tp_ep(c, 2, 1, s)),
    "wide-megatron-tp4": (WIDE, lambda c, s: megatron_tp_ep(c, 4, 1, s)),
    "wide-megatron-tp2": (WIDE, lambda c, s: megatron_tp_ep(c, 2, 1, s)),
    "wide-fsdp2": (WIDE, lambda c, s: fsdp_dim0(c, 2, s)),
    "moe-megatron-tp2-ep2": (MOE, lambda c, s: megatron_tp_ep(c, 2, 2, s)),
    "moe-fsdp2": (MOE, lambda c, s: fsdp_dim0(c, 2, s)),
}
"""Trainer layout -> (model, how it publishes)."""

ENGINES = {
    DENSE: [EngineParallel(1, 0, 1), EngineParallel(2, 1, 1), EngineParallel(4, 3, 1)],
    WIDE: [EngineParallel(1, 0, 1), EngineParallel(4, 1, 1)],
    MOE: [EngineParallel(1, 0, 1), EngineParallel(2, 1, 2), EngineParallel(4, 2, 2)],
}
"""Engine layouts per model: one rank each (the others are the same plan shifted)."""


DIRECT: dict[tuple[str, EngineParallel], ToyEngine] = {}
"""(trainer layout, engine layout) -> an engine refitted directly from the trainer's
daemon (no mirror), the reference every mirrored refit of that pairing is held to."""


@dataclass
class Hosts:
    trainer: RefitClient  # the trainer's daemon: holds the published versions
    engine: RefitClient  # the engine's host: mirrors every version it pulls
    trainer_url: str


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def hosts(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Hosts]:
    secret = tmp_path_factory.mktemp("secret") / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    trust = ["--set", "peers.allow=http://127.0.0.1:*"]
    async with (
        spawn_daemon(
            secret_file=str(secret), transport="tcp", node_id="trainer", extra_args=trust
        ) as t,
        spawn_daemon(
            secret_file=str(secret),
            transport="tcp",
            node_id="engine-host",
            extra_args=[*trust, "--set", "mirrors.policy=always"],
        ) as h,
        RefitClient(t.url) as tc,
        RefitClient(h.url) as hc,
    ):
        yield Hosts(tc, hc, t.url)


async def refitted(
    local: RefitClient,
    source: RefitClient,
    model: str,
    cfg: ModelConfig,
    par: EngineParallel,
    pub: Published,
    budget: int,
) -> ToyEngine:
    """A zeroed engine of layout ``par`` refitted to version 1 of ``model`` through
    ``local``'s daemon."""
    eng = zeroed_engine(cfg, par)
    r = DaemonReceiver(
        local=local,
        source=source,
        model=model,
        engine=eng,
        twin=lambda: ToyEngine(cfg, par),
        capture=capture_for(pub),
        max_reads_per_copy=budget,
    )
    try:
        await r.refit(1)
    finally:
        await r.close()
    return eng


@pytest.mark.parametrize("budget", [64, 2])
@pytest.mark.parametrize("trainer", sorted(TRAINERS))
async def test_a_refit_through_a_host_mirror_is_exact_for_every_trainer_and_engine_layout(
    hosts: Hosts, trainer: str, budget: int
) -> None:
    cfg, layout = TRAINERS[trainer]
    state = full_state(cfg, seed=11)
    pub = layout(cfg, state)
    for par in ENGINES[cfg]:
        # A model of its own per engine: its mirror is made by this engine's pull,
        # which reads each piece as the mirror fills.
        model = f"{trainer}-b{budget}-tp{par.tp_size}r{par.tp_rank}e{par.ep_size}"
        pubs = await publish_layout(hosts.trainer, model, pub, 1)
        mirrored = await refitted(hosts.engine, hosts.trainer, model, cfg, par, pub, budget)
        key = (trainer, par)
        if key not in DIRECT:  # the same bytes whatever the budget: refitted once
            DIRECT[key] = await refitted(hosts.trainer, hosts.trainer, model, cfg, par, pub, 64)
        direct = DIRECT[key]
        st: MirrorState = await hosts.engine._send(api.MIRROR_STATE, model=model, version=1)
        assert st.complete and st.tried == [hosts.trainer_url], st
        want = dict(direct.named_parameters())
        differ = [n for n, p in mirrored.named_parameters() if not torch.equal(p, want[n])]
        assert differ == [], f"{model}: through the mirror, unlike a direct refit: {differ}"
        assert mismatched(mirrored, cfg, par, state) == [], model
        for p in pubs:
            await p.close()
