"""The last line of ``refitd bench fanout`` from made-up cases: its ratios' arithmetic,
the straggler's and the killed host's own times left out of both sides. Pure: no
simulated hosts."""

from __future__ import annotations

from refitd.bench.fanout import summary, where_time_goes
from refitd.bench.fanoutcases import Case, HostRun


def _hosts(*held: float, exact: bool = True) -> tuple[HostRun, ...]:
    return tuple(HostRun(f"e{i}", s, exact) for i, s in enumerate(held))


def _cases() -> list[Case]:
    killed = (
        HostRun("e0", 0.75, True),
        HostRun("e1", 2.0, False),  # its own time is nobody's finish
        HostRun("e2", 0.9, True),
        HostRun("e3", 1.2, True),
    )
    return [
        Case(1, "link", 0.5, 0.0, True, ("tcp-stream",)),
        Case(1, "direct", 0.6, 1.0, True, ("tcp",), hosts=_hosts(0.6)),
        Case(1, "mirrored", 0.55, 1.0, True, ("shm",), 0.5, (), _hosts(0.55)),
        Case(4, "direct", 2.4, 8.0, True, ("tcp",), hosts=_hosts(2.4, 2.3, 2.2, 2.1)),
        # the plain case: e3 last (1.0), e1 second (0.9)
        Case(
            4,
            "mirrored",
            1.0,
            1.002,
            True,
            ("shm",),
            0.6,
            (0.05, 0.125),
            _hosts(0.7, 0.9, 0.75, 1.0),
        ),
        Case(
            4,
            "straggler",
            3.0,
            1.0,
            True,
            ("shm",),
            hosts=_hosts(1.0, 1.35, 0.9, 3.0),
            faulted="e3",
        ),
        Case(4, "kill", 1.2, 1.3, True, ("shm",), hosts=killed, faulted="e1"),
        Case(
            4,
            "restarted",
            0.8,
            1.0,
            True,
            ("shm",),
            hosts=_hosts(0.7, 0.8, 0.75, 0.6),
            faulted="e1",
        ),
    ]


def test_straggler_and_kill_ratios_compare_the_other_hosts_with_themselves_unfaulted() -> None:
    line = summary(_cases())
    assert list(line) == [
        "fanout_ratio_4",
        "direct_ratio_4",
        "uplink_ratio_4",
        "first_done_ratio_4",
        "hop_lag_4",
        "mirrored_n1_ratio",
        "straggler_ratio_4",
        "kill_ratio_4",
        "restarted_refit",
        "verified",
    ]
    assert line["fanout_ratio_4"] == "1.818"  # 1.0 / 0.55
    assert line["direct_ratio_4"] == "4.000"
    assert line["uplink_ratio_4"] == "1.002"
    assert line["first_done_ratio_4"] == "1.200"
    assert line["hop_lag_4"] == "0.125"
    assert line["mirrored_n1_ratio"] == "1.100"
    # e0-e2: 1.35 s with e3 slowed, 0.9 s in the plain case (e3's 1.0 left out)
    assert line["straggler_ratio_4"] == "1.500"
    # e0, e2, e3: 1.2 s with e1 killed (its 2.0 left out), 1.0 s in the plain case
    assert line["kill_ratio_4"] == "1.200"
    assert line["restarted_refit"] == "1"
    assert line["verified"] == "1"


def test_a_restarted_host_that_did_not_refit_exactly_reads_0_and_fails_verified() -> None:
    cases = _cases()
    cases[-1] = Case(
        4,
        "restarted",
        0.8,
        1.0,
        False,
        ("shm",),
        hosts=(*_hosts(0.7), HostRun("e1", 0.8, False)),
        faulted="e1",
    )
    line = summary(cases)
    assert line["restarted_refit"] == "0"
    assert line["verified"] == "0"


def test_fault_cases_alone_give_their_keys_at_their_n_and_no_fanout_ratio() -> None:
    plain = Case(3, "mirrored", 1.0, 1.0, True, ("shm",), hosts=_hosts(0.8, 1.0, 0.9))
    slow = Case(3, "straggler", 2.0, 1.0, True, ("shm",), hosts=_hosts(2.0, 1.1, 0.9), faulted="e0")
    assert summary([plain, slow]) == {"straggler_ratio_3": "1.100", "verified": "1"}


def test_where_time_goes_names_each_hosts_holders_and_its_reasked_chunks() -> None:
    hosts = (
        HostRun("e0", 1.0, True, (("e1", 30), ("trainer", 34)), 2),
        HostRun("e1", 0.0, False, (("trainer", 10),), 0),
    )
    kill = Case(2, "kill", 1.0, 1.0, True, ("shm",), hosts=hosts, faulted="e1")
    assert where_time_goes(kill) == (
        "N=2 kill, chunks read per holder: e0 <- e1:30 trainer:34, re-asked 2; "
        "e1 (killed: as last seen) <- trainer:10, re-asked 0"
    )
