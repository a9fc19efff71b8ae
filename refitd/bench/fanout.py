"""``refitd bench fanout``: many replicas on many hosts, direct pulls vs host mirrors.

Simulated hosts (:mod:`refitd.bench.simhosts`): one trainer host and up to ``N``
engine hosts, each link (both directions of its veth) shaped with a ``tc`` token
bucket to ``--link-gbit`` (default 1 Gbit/s), so the link, not memory, is what is
shared. The trainer's daemon publishes a model of ``--mib`` MiB (one new version per
round). Every engine host runs two daemons, one with ``[mirrors] policy = "never"``
and one with ``"always"``, and ``--replicas`` engine replicas (2), each of which
leases the version at the trainer, pulls every byte through its host's daemon and
checks every byte. The cases and their rounds: :mod:`refitd.bench.fanoutcases`; the
process on each host: :mod:`refitd.bench.fanoutwork`.

Per ``N`` (1, 2, 4; 8 with ``--hosts 8``), in the same run: *direct* (every replica
reads the trainer) and *mirrored* (one mirror per host; before it, an untimed version
pulled by exactly those ``N`` hosts' mirrors, so the source's holder book has seen
them):

- seconds from the start until every replica holds the version;
- bytes the trainer host sent on its link ÷ model bytes;
- mirrored: per host, the chunks its mirror read from each holder and the chunks it
  asked again of another holder (where the time goes).

At N = 4 (``--hosts`` 4 or more), in the same run: the mirrored case again with one
host's link shaped to a quarter of the others' (*straggler*), and with one host's
mirrored daemon SIGKILLed at half its mirror (*kill*); then that daemon is started
again and its replicas refit the next version. In the same run too, one model's time
over one link: the best of one and of four plain TCP streams moving the model's bytes
from the trainer host to the first engine host.

The last line::

    fanout_ratio_4=… direct_ratio_4=… uplink_ratio_4=… mirrored_n1_ratio=…
    straggler_ratio_4=… kill_ratio_4=… restarted_refit=1 verified=1

``fanout_ratio_4`` is mirrored seconds at N = 4 ÷ mirrored seconds at N = 1,
``direct_ratio_4`` the same for direct pulls (about N: the trainer's link carries
every replica's copy), ``uplink_ratio_4`` the trainer's bytes ÷ model bytes at N = 4
mirrored, ``mirrored_n1_ratio`` the mirrored seconds at N = 1 ÷ one model's time over
one link. ``straggler_ratio_4``: when the other three hosts' last replica held the
version with the straggler ÷ when the same three's did in the plain N = 4 mirrored
case; ``kill_ratio_4`` the same with the killed host; ``restarted_refit`` 1 when every
replica of the restarted host refitted the next version exactly. ``verified`` is 1
when every replica of every case (untimed versions included) was bit-exact, the
killed host's replicas of the killed version aside. With ``--hosts 8`` also
``fanout_ratio_8`` and ``uplink_ratio_8``. Where the mirrored time at N = 4 goes:
``first_done_ratio_4``, when the first mirror completed at N = 4 ÷ at N = 1, and
``hop_lag_4``, the most any mirror completed after the holder it last read (s).
Needs root, ``ip``, ``unshare``, ``nsenter`` and ``tc``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

from refitd.bench.fanoutcases import MIB, Case, fanout, sizes

__all__ = ["add_arguments", "lines", "run", "summary", "where_time_goes"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mib", type=int, default=64, help="model size, MiB (default 64)")
    parser.add_argument(
        "--link-gbit", type=float, default=1.0, help="every host's link, Gbit/s (default 1)"
    )
    parser.add_argument(
        "--hosts",
        type=int,
        default=4,
        help="most engine hosts: 4 (N = 1, 2, 4, with the straggler and the kill at 4) "
        "or 8 (adds 8)",
    )
    parser.add_argument("--replicas", type=int, default=2, help="replicas per host (default 2)")


def run(args: argparse.Namespace) -> int:
    import uvloop

    from refitd.bench.simhosts import missing

    why = missing()
    if why is None and shutil.which("tc") is None:
        why = "simulated links need `tc` (iproute2) on PATH"
    if why is not None:
        print(f"refitd bench fanout: cannot run here: {why}")
        return 2
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    nbytes = max(1, args.mib) * MIB
    ns = sizes(args.hosts)
    t0 = time.perf_counter()
    print(
        f"refitd bench fanout: {nbytes / MIB:.0f} MiB model, links {args.link_gbit:g} Gbit/s, "
        f"{args.replicas} replicas per host, N = {ns}"
        f"{', straggler and kill at N = 4' if 4 in ns else ''}; host cores: "
        f"{os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        cases = await fanout(
            Path(tmp), nbytes, args.link_gbit, args.hosts, args.replicas, 4 if 4 in ns else 0
        )
    for line in lines(cases, nbytes * 8 / (args.link_gbit * 1e9)):
        print(line)
    out = summary(cases)
    print(f"{time.perf_counter() - t0:.0f} s in all")
    print(" ".join(f"{k}={v}" for k, v in out.items()))
    return 0 if out["verified"] == "1" else 1


def lines(cases: list[Case], ideal_s: float) -> list[str]:
    """What a run prints for ``cases`` before its last line; ``ideal_s``: one model's
    time at the link's nominal rate."""
    by = {(c.n, c.mode): c for c in cases}
    out = []
    for c in cases:
        ok = "verified" if c.verified else "NOT VERIFIED"
        if c.mode == "link":
            out.append(f"one model over one link (best of 1 and 4 TCP streams): {c.seconds:7.3f} s")
            continue
        if c.mode in ("direct", "mirrored"):
            out.append(
                f"N={c.n} {c.mode:>8}: {c.seconds:7.3f} s until every replica holds it "
                f"({c.seconds / ideal_s:.2f}x one model over one link); trainer sent "
                f"{c.uplink_ratio:.3f}x the model; paths {'+'.join(c.paths)}; {ok}"
            )
        else:
            plain = by.get((c.n, "mirrored"))
            others = (
                f"; the other hosts' last replica at {c.others_s(c.faulted):.3f} s "
                f"({plain.others_s(c.faulted):.3f} s in the plain case)"
                if plain is not None and c.mode != "restarted"
                else ""
            )
            out.append(
                f"N={c.n} {c.mode} ({c.note}): {c.seconds:.3f} s until every "
                f"replica{' of the others' if c.mode == 'kill' else ''} holds it{others}; "
                f"trainer sent {c.uplink_ratio:.3f}x the model; {ok}"
            )
        if c.mode == "direct":
            continue
        out.append(
            f"N={c.n} {c.mode} mirrors: "
            + "; ".join(
                f"{h.name} from [{', '.join(h.tried)}] {h.began_s:.2f}-"
                + (f"{h.completed_s:.2f} s" if h.completed_s > 0 else "(not complete)")
                for h in c.hosts
            )
        )
        if c.mode == "mirrored":
            out.append(
                f"N={c.n} mirrored: first mirror complete at {c.first_done_s:.3f} s; each "
                "mirror after the holder it last read: "
                f"{' '.join(f'+{x:.3f}' for x in c.hop_lags_s) or '-'} s"
            )
        out.append(where_time_goes(c))
    return out


def where_time_goes(c: Case) -> str:
    """Per host of a mirrored case: the chunks its mirror read from each holder (by
    host name, ``trainer`` the source) and the chunks it asked again of another."""
    tags = {"straggler": "slowed", "kill": "killed: as last seen", "restarted": "restarted"}
    parts = []
    for h in c.hosts:
        tag = f" ({tags[c.mode]})" if c.mode in tags and h.name == c.faulted else ""
        read = " ".join(f"{who}:{k}" for who, k in h.reads) or "-"
        parts.append(f"{h.name}{tag} <- {read}, re-asked {h.reasked}")
    return f"N={c.n} {c.mode}, chunks read per holder: " + "; ".join(parts)


def summary(cases: list[Case]) -> dict[str, str]:
    """The last line's values from ``cases``: ratios at the largest N up to 4 (when
    N = 1 was run too), at N = 8, and of the straggler and kill cases against the
    plain mirrored case of their N."""
    by = {(c.n, c.mode): c for c in cases}
    out: dict[str, str] = {}
    top = max((n for n, mode in by if mode == "mirrored" and n <= 4), default=0)
    if top and (1, "mirrored") in by:
        for mode, key in (("mirrored", "fanout"), ("direct", "direct")):
            if (top, mode) in by and (1, mode) in by:
                out[f"{key}_ratio_{top}"] = f"{by[top, mode].seconds / by[1, mode].seconds:.3f}"
        out[f"uplink_ratio_{top}"] = f"{by[top, 'mirrored'].uplink_ratio:.3f}"
        m1, mt = by[1, "mirrored"], by[top, "mirrored"]
        if m1.first_done_s > 0 and mt.first_done_s > 0:  # where N = top's extra time goes
            out[f"first_done_ratio_{top}"] = f"{mt.first_done_s / m1.first_done_s:.3f}"
            out[f"hop_lag_{top}"] = f"{max(mt.hop_lags_s, default=0.0):.3f}"
        if (1, "link") in by:
            out["mirrored_n1_ratio"] = f"{m1.seconds / by[1, 'link'].seconds:.3f}"
        if (8, "mirrored") in by:
            out["fanout_ratio_8"] = f"{by[8, 'mirrored'].seconds / m1.seconds:.3f}"
            out["uplink_ratio_8"] = f"{by[8, 'mirrored'].uplink_ratio:.3f}"
    for c in cases:
        plain = by.get((c.n, "mirrored"))
        if c.mode in ("straggler", "kill") and plain is not None:
            # the same hosts, the faulted one left out of both
            base = plain.others_s(c.faulted)
            if base > 0:
                out[f"{c.mode}_ratio_{c.n}"] = f"{c.others_s(c.faulted) / base:.3f}"
    for c in cases:
        if c.mode == "restarted":
            back = [h for h in c.hosts if h.name == c.faulted]
            out["restarted_refit"] = str(int(bool(back) and all(h.exact for h in back)))
    out["verified"] = str(int(all(c.verified for c in cases)))
    return out
