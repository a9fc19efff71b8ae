"""``refitd bench transport``: pull 256 MiB per run through each transport, vs memcpy.

The source region lives in another process (``python -m transports.servepeer``) for
``ucx`` and ``tcp`` (over loopback, its default 4 lanes; ``--lanes`` sets them); the
same-process transports (``local``, ``reference``) read a region of
this process. For each piece size (4 KiB … 256 MiB) and layout (``contiguous``:
piece i of the destination reads piece i of the source; ``shuffled``: a random
permutation, so no two adjacent reads can merge), the median of ``--repeat`` runs is
reported in GB/s (10^9 bytes/s) and as a ratio to memcpy's median for the same pieces
in the same layout, measured in the same run (one thread, C loop, no Python per piece);
``spread`` is (fastest - slowest) / median of those runs.
With ``ucx``, a ``cma`` row shows what the kernel call under UCX's same-host path does
on its own: the same (merged) reads as plain ``process_vm_readv`` calls from the peer's
process, one thread (UCX may beat it with ``--lanes`` > 1).
After the timed runs, every byte of the destination is verified against the source.

The header names the ``huge=`` mode of the tmpfs holding the segments and, for ``ucx``,
the share of the peer's source region that 2 MiB pages back: the cma path pins the
source page by page, so it runs about twice as fast from huge pages (see
``transports.segments``; a host allows them by mounting /dev/shm ``huge=advise``).

Last line: ``key=value`` pairs for scripts (``memcpy_gbps`` is one 256 MiB memcpy).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import statistics
import sys
import time
from typing import Any

SIZES = {
    "4KiB": 4 << 10,
    "64KiB": 64 << 10,
    "1MiB": 1 << 20,
    "16MiB": 16 << 20,
    "256MiB": 256 << 20,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--total-mib", type=int, default=256, help="bytes pulled per run, MiB (default 256)"
    )
    parser.add_argument(
        "--pieces", default=",".join(SIZES), help=f"piece sizes (default {','.join(SIZES)})"
    )
    parser.add_argument(
        "--schemes",
        default="reference,local,ucx,tcp",
        help="transports to run (default reference,local,ucx,tcp)",
    )
    parser.add_argument(
        "--repeat", type=int, default=5, help="timed runs per case; the median is reported"
    )
    parser.add_argument(
        "--lanes",
        type=int,
        default=0,
        help="ucx lanes (threads posting GETs) and tcp lanes (connections); 0: the default",
    )


def run(args: argparse.Namespace) -> int:
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    import numpy as np

    from transports.batch import coalesce
    from transports.checks import shuffled_batch
    from transports.interface import PeerInfo, create_transport
    from transports.native import copy_lib
    from transports.segments import SharedSegment, huge_fraction, huge_page_mode
    from transports.servepeer import REGION_ID, SECRET_ENV, pattern

    total = args.total_mib << 20
    pieces = [(name, _size(name)) for name in args.pieces.split(",")]
    pieces = [(name, p) for name, p in pieces if p <= total and total % p == 0]
    schemes = [s for s in args.schemes.split(",") if s]
    secret = secrets.token_bytes(32)
    copy = copy_lib()
    results: dict[tuple[str, str, str], float] = {}
    verified = True
    src_bytes = pattern(total, 7)

    def layout(piece: int, shuffled: bool) -> Any:
        b = shuffled_batch(total // piece, piece, seed=piece)
        b["local_region"], b["remote_region"] = 1, REGION_ID
        if not shuffled:
            b["remote_offset"] = b["local_offset"]
        return b

    def check(dst: SharedSegment, b: Any, piece: int) -> bool:
        got = dst.numpy().reshape(-1, piece)
        want = src_bytes.reshape(-1, piece)[b["remote_offset"] // piece]
        return bool(np.array_equal(got[b["local_offset"] // piece], want))

    cases = [
        (n, p, lay)
        for n, p in pieces
        for lay in (("contiguous",) if p >= total else ("contiguous", "shuffled"))
    ]
    print(
        f"refitd bench transport: {total >> 20} MiB per run, median of {args.repeat}, "
        f"host cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}, "
        f"shared memory huge pages: {huge_page_mode()}"
    )
    print(
        f"{'transport':<10} {'piece':>7} {'layout':<10} {'reads':>7} {'posted':>7} {'GB/s':>7} {'x memcpy':>9} {'spread':>7}"
    )

    def row(
        name: str, piece: str, lay: str, reads: int, posted: int, runs: list[float], ok: bool
    ) -> None:
        gbps = statistics.median(runs)
        results[(name, piece, lay)] = gbps
        ratio = gbps / results[("memcpy", piece, lay)]
        spread = (max(runs) - min(runs)) / gbps
        flag = "" if ok else "  VERIFY FAILED"
        print(
            f"{name:<10} {piece:>7} {lay:<10} {reads:>7} {posted:>7} {figures(gbps):>7} {figures(ratio):>9} {spread:>7.2f}{flag}"
        )

    async with contextlib.AsyncExitStack() as stack:
        dst = stack.enter_context(SharedSegment.create(total, "bench-dst"))
        src = stack.enter_context(SharedSegment.create(total, "bench-src"))
        src.numpy()[:] = src_bytes
        peers = {}
        cma_pid = 0  # the ucx peer's data-plane pid: the "cma" row reads it directly
        cma_base = 0
        src_huge = None
        for scheme in schemes:
            extra = {"lanes": args.lanes} if scheme in ("ucx", "tcp") and args.lanes else {}
            t = await stack.enter_async_context(
                create_transport(scheme, secret=secret, peer_id=f"bench-{scheme}", **extra)
            )
            await t.register(1, dst)
            if scheme in ("ucx", "tcp"):  # the source is another process
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "transports.servepeer", "--scheme", scheme, "--size", str(total), "--seed", "7",
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    env=dict(os.environ, **{SECRET_ENV: secret.hex()}),
                )  # fmt: skip
                stack.push_async_callback(_stop, proc)
                assert proc.stdout is not None
                info = PeerInfo.decode(bytes.fromhex((await proc.stdout.readline()).decode()))
                pid = int((await proc.stdout.readline()).decode())
                if scheme == "ucx":
                    cma_pid, cma_base = pid, info.regions[0].address

            else:  # same-process transports read a region of this process
                source = await stack.enter_async_context(
                    create_transport(scheme, secret=secret, peer_id=f"bench-{scheme}-source")
                )
                await source.register(REGION_ID, src)
                info = source.advertise()
            peers[scheme] = await stack.enter_async_context(await t.connect(info))

        # Per case, memcpy and then every transport back to back, so each ratio
        # compares runs made under the same load.
        for name, piece, lay in cases:
            b = layout(piece, lay == "shuffled")
            d = (dst.address + b["local_offset"]).astype(np.int64)
            s = (src.address + b["remote_offset"]).astype(np.int64)
            n = b["nbytes"].astype(np.int64)
            dst.numpy()[:] = 0
            runs = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                copy.rfx_copy_batch(len(n), d.ctypes.data, s.ctypes.data, n.ctypes.data)
                runs.append(total / (time.perf_counter() - t0) / 1e9)
            ok = check(dst, b, piece)
            verified &= ok
            results[("memcpy", name, lay)] = statistics.median(runs)
            row("memcpy", name, lay, len(b), len(b), runs, ok)
            for scheme, peer in peers.items():
                dst.numpy()[:] = 0
                await peer.get(b)  # warm: first touch of the pages in the data plane
                runs = []
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    await peer.get(b)
                    runs.append(total / (time.perf_counter() - t0) / 1e9)
                ok = check(dst, b, piece)
                verified &= ok
                row(
                    scheme,
                    name,
                    lay,
                    len(b),
                    len(coalesce(b)) if scheme == "ucx" else len(b),
                    runs,
                    ok,
                )
            if cma_pid:
                # The kernel call under the cma path on its own: one process_vm_readv
                # per (merged) read from the same process, one thread, no UCX.
                m = coalesce(b)
                d = (dst.address + m["local_offset"]).astype(np.int64)
                s = (cma_base + m["remote_offset"]).astype(np.int64)
                n = m["nbytes"].astype(np.int64)
                dst.numpy()[:] = 0
                runs = []
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    if copy.rfx_pvr_batch(
                        cma_pid, len(n), d.ctypes.data, s.ctypes.data, n.ctypes.data
                    ):
                        raise SystemExit(f"process_vm_readv from pid {cma_pid} failed")
                    runs.append(total / (time.perf_counter() - t0) / 1e9)
                ok = check(dst, b, piece)
                verified &= ok
                row("cma", name, lay, len(b), len(m), runs, ok)

        if cma_pid:  # after the pulls: a page is mapped in the peer once first read
            src_huge = huge_fraction(cma_pid, cma_base, total)
            print(f"ucx peer's source region: {src_huge:.0%} in 2 MiB pages")

    # memcpy_gbps: one 256 MiB memcpy (the contiguous, single-piece case when run).
    whole = next(
        (results[("memcpy", n, "contiguous")] for n, p in reversed(pieces) if p >= total), None
    )
    kv = {"memcpy_gbps": f"{(whole or max(v for k, v in results.items() if k[0] == 'memcpy')):.2f}"}
    for scheme in [*schemes, "cma"]:
        for name, _ in pieces:
            for lay in ("contiguous", "shuffled"):
                if (scheme, name, lay) in results:
                    suffix = "" if lay == "contiguous" else "_shuffled"
                    g = results[(scheme, name, lay)]
                    kv[f"{scheme}_{name}{suffix}_gbps"] = figures(g)
                    kv[f"{scheme}_{name}{suffix}_ratio"] = figures(
                        g / results[("memcpy", name, lay)]
                    )
                    if scheme == "ucx" and ("cma", name, lay) in results:
                        kv[f"ucx_{name}{suffix}_of_cma"] = f"{g / results[('cma', name, lay)]:.2f}"
    kv["shm_huge"] = huge_page_mode()
    if src_huge is not None:
        kv["ucx_src_huge_share"] = f"{src_huge:.2f}"
    kv["verified"] = "1" if verified else "0"
    print(" ".join(f"{k}={v}" for k, v in kv.items()))
    return 0 if verified else 1


def figures(x: float) -> str:
    """``x`` with two decimals, or two significant figures where two decimals would
    print a measured rate as ``0.00`` (a slow transport on a busy host): a rate the
    bench measured is never reported as none."""
    return f"{x:.2f}" if x == 0 or abs(x) >= 0.1 else f"{x:.2g}"


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """Ask a servepeer process to exit (stdin EOF) and wait for it."""
    if proc.stdin is not None:
        proc.stdin.close()
    await proc.wait()


def _size(text: str) -> int:
    """``4KiB`` / ``1MiB`` / ``4096`` -> bytes."""
    for unit, mult in (("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("", 1)):
        if text.endswith(unit) and text[: len(text) - len(unit)].isdigit():
            return int(text[: len(text) - len(unit)]) * mult
    raise SystemExit(f"piece size {text!r} refused: write it as 4096, 4KiB, 1MiB or 1GiB")
