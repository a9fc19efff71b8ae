"""The demo/bench flow itself at toy size: a trainer *process* publishes, four engine
ranks refit through two `refitd serve` processes, every version verified."""

from __future__ import annotations

import pytest

from refitd.bench.refit import refit_flow, report

pytestmark = pytest.mark.timeout(180)


async def test_the_refit_flow_verifies_every_version_and_replays_after_the_first() -> None:
    res = await refit_flow(
        gib=0.001, versions=3, transport="auto", measure_manifest=False, log=lambda _: None
    )
    assert [v.verified for v in res.versions] == [True, True, True]
    assert [v.replayed for v in res.versions] == [False, True, True]
    fields = report(res)
    assert fields["verified"] == 1 and fields["refit_gbps"] > 0 and fields["memcpy_gbps"] > 0
    # Every version has its own memcpy beside it; the ratio is their median, with a spread.
    assert all(v.memcpy_gbps > 0 for v in res.versions)
    assert fields["refit_ratio_spread"] >= 0
    # Where the time went, so a regression explains itself.
    for key in ("manifest_s", "plan_s", "pull_daemon_s", "pull_overhead_s", "install_s"):
        assert fields[key] >= 0, key
    assert fields["pull_daemon_s"] > 0
    # Two daemons on one host in the default mode: every pull took shared memory.
    assert fields["transport"] == "auto" and fields["path"] == "shm"
    # What a reader needs to judge the spread: every replayed ratio, the page faults
    # the pulls and the baseline took, and the CPU pressure during the pulls.
    assert len(fields["ratios"].split(",")) == 2
    assert all(set(v.faults) == {"engine daemon", "source daemon", "engine"} for v in res.versions)
    assert fields["pull_faults"] >= 0 and fields["memcpy_faults"] >= 0
    # The first pull maps the engine's and the trainer's segments in the engine daemon.
    assert res.versions[0].faults["engine daemon"].minor > 0


async def test_the_refit_flow_forced_to_ucx_reports_that_it_pulled_over_ucx() -> None:
    res = await refit_flow(
        gib=0.001, versions=1, transport="ucx", measure_manifest=False, log=lambda _: None
    )
    fields = report(res)
    assert fields["verified"] == 1 and fields["path"] == "ucx"
