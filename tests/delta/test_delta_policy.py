"""``prefer="auto"``: a delta only where it is expected to be faster than a full refit:
from a source across a link, not from one whose memory this host reads directly."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from support.daemons import daemon_config, serving_daemons
from support.deltas import Change, DoubleBuffered, changed
from support.engines import mismatched, zeroed_engine

from refitd.bench.refit import capture_for
from refitd.client.deltarefit import DeltaReceiver
from refitd.client.http import RefitClient
from refitd.daemon.app.node import Daemon
from refitd.testing.engines import EngineParallel, ToyEngine, dense_toy_config
from refitd.testing.layouts import full_state, megatron_tp_ep

pytestmark = [pytest.mark.timeout(120)]

CFG = dense_toy_config(torch.bfloat16)
PAR = EngineParallel(4, 2, 1)
SECRET = os.urandom(32)


def layout(state: dict[str, torch.Tensor]) -> Any:
    return megatron_tp_ep(CFG, 2, 1, state)


def receiver(local: RefitClient, source: RefitClient, **kw: Any) -> DeltaReceiver:
    return DeltaReceiver(
        local=local,
        source=source,
        model="m",
        engine=zeroed_engine(CFG, PAR),
        twin=lambda: ToyEngine(CFG, PAR),
        capture=capture_for(layout(full_state(CFG, seed=0))),
        max_reads_per_copy=2,
        **kw,
    )


def daemon(boot_id: str = "", **kw: Any) -> Daemon:
    return Daemon(
        daemon_config(allow=("http://127.0.0.1:*",), **kw), secret=SECRET, boot_id=boot_id
    )


async def test_auto_refits_in_full_from_a_source_on_this_host_and_by_delta_across_a_link() -> None:
    # "far" claims another host: pulls from it go over tcp, not shared memory.
    async with serving_daemons(daemon(deltas=True, boot_id="another-host"), daemon()) as (
        far,
        near,
    ):
        trainer = DoubleBuffered(far, "m", layout)
        state = full_state(CFG, seed=3)
        await trainer.publish(1, state)
        across = receiver(near, far, prefer="auto")  # engine on "near", source on "far"
        here = receiver(far, far, prefer="auto")  # engine on the source's own host
        always = receiver(far, far)  # prefer="delta", the default
        for r in (across, here, always):
            await r.refit(1)
            assert r.last is not None and r.last.kind == "full"
        assert across.last is not None and across.last.refit.pull.path == "tcp"
        for v in (2, 3):
            state = changed(state, Change("some", 0.02, v))
            await trainer.publish(v, state)
            for r in (across, here, always):
                await r.refit(v)
                assert mismatched(r.engine, CFG, PAR, state) == []
            assert across.last is not None and across.last.kind == "delta", across.last.reason
            assert across.last.wire_bytes < across.last.full_bytes
            assert here.last is not None and here.last.kind == "full"
            assert here.last.reason.startswith("auto: the source is on this host")
            # ... and its full path keeps no delta bookkeeping: no base recorded (no
            # wait for the source's comparison, no digest read of the engine memory).
            assert here.base_version is None
            assert always.last is not None and always.last.kind == "delta", always.last.reason
        for r in (across, here, always):
            await r.close()


def test_a_receiver_refuses_a_policy_or_check_cadence_it_does_not_know() -> None:
    client = RefitClient("http://127.0.0.1:9")
    with pytest.raises(ValueError, match="prefer='sometimes' refused"):
        receiver(client, client, prefer="sometimes")
    with pytest.raises(ValueError, match="verify_every=0 refused"):
        receiver(client, client, verify_every=0)
