"""The data-plane process: the only process of a daemon that talks UCX.

Started by `transports.ucx.UcxTransport` with one end of a socketpair as its
argument. It owns the UCX context and worker (made through ucxx), maps shared
segments by name and registers them, creates endpoints from peers' worker
addresses with error handling off (the only way UCX takes the zero-copy ``cma``
path on one host), and posts batches of GETs from the C helper.

One such process serves (its worker address and keys are advertised; on the tcp
path it answers peers' GETs) and one more pulls from each connected peer: see
`transports.ucx.transport` for why.

Why a separate process: on the ``cma`` path UCX aborts the reading process when a
peer dies, and a corrupt key or wild address crashes it. Here that costs this
process; the owner sees the socket close, fails the batches in flight with their
suspect destination ranges, and starts a new one.

Every GET batch carries a deadline. A batch still unfinished at its deadline (a
hung or stopped peer) is answered with kind "timeout", and then this process
exits at once (exit status `EXIT_TIMED_OUT`): its GETs may still be in flight, and
only a dead process can promise that none of them lands after the owner reported
the pull failed.

It re-validates every batch against its own region records before posting, exits
when its owner dies (PR_SET_PDEATHSIG) or closes the socket, and never spins: when
idle it sleeps in poll() on the socket and the UCX worker's event fd.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NoReturn

import msgspec
import numpy as np
import numpy.typing as npt

from ..batch import READ_DTYPE, coalesce, split_shares, validate_batch
from ..interface import ReadRefused
from ..segments import SharedSegment
from .protocol import (
    EXIT_TIMED_OUT,
    Connect,
    Deregister,
    Disconnect,
    Envelope,
    Get,
    Register,
    Reply,
    Stop,
    frame,
    frame_size,
)

PR_SET_PDEATHSIG = 1
UCS_ERR_NO_MEMORY = -4  # a batch that could not wait for its flush: GETs may be in flight
LANE_MIN_BYTES = 1 << 20  # smaller batches stay on one lane: a thread hop costs more


@dataclass
class _Local:
    segment: SharedSegment
    memhs: list[int]  # one registration per lane's context


@dataclass
class _Remote:
    address: int
    size: int
    rkeys: list[int]  # one unpacked key per lane (a key belongs to one endpoint)


@dataclass
class _Peer:
    eps: list[object]  # ucxx UCXEndpoint per lane, kept alive here
    handles: list[int]
    regions: dict[int, _Remote]


@dataclass
class _Lane:
    """One UCX context and worker, driven by one thread during a batch.

    Each lane has its own context: contexts are not safe to share between threads
    posting at once (their registration caches are not locked for that)."""

    context: object
    ctx_h: ctypes.c_void_p
    worker: object
    handle: ctypes.c_void_p
    efd: int


class UcxError(Exception):
    def __init__(self, what: str, status: int) -> None:
        super().__init__(f"{what} failed with UCX status {status}")


class DataPlane:
    """UCX state of the process. ``lanes`` UCX workers share one context; a large
    batch is cut into one share per lane, posted from that many threads (ctypes
    releases the GIL), so both cores issue reads. Peers connect to lane 0's address."""

    def __init__(self, lanes: int = 1) -> None:
        from ucxx._lib import libucxx as ucx_api

        from ..native import ucx_lib

        self.api = ucx_api
        self.lib = ucx_lib()
        self.lanes: list[_Lane] = []
        for _ in range(max(1, lanes)):
            context = ucx_api.UCXContext({})
            worker = ucx_api.UCXWorker(context)
            handle = ctypes.c_void_p(worker.handle)
            efd = ctypes.c_int(-1)
            self._check("ucp_worker_get_efd", self.lib.rfx_worker_efd(handle, ctypes.byref(efd)))
            self.lanes.append(
                _Lane(context, ctypes.c_void_p(context.handle), worker, handle, efd.value)
            )
        self.worker_h, self.efd = self.lanes[0].handle, self.lanes[0].efd
        self.address = bytes(self.lanes[0].worker.address.tobytes())  # type: ignore[attr-defined]
        self.pool = ThreadPoolExecutor(len(self.lanes) - 1) if len(self.lanes) > 1 else None
        self.locals: dict[int, _Local] = {}
        self.peers: dict[int, _Peer] = {}
        self.timed_out: int = self.lib.rfx_timed_out()
        #: set once a batch gave up with GETs possibly in flight: the process must end
        self.must_exit = False

    @staticmethod
    def _check(what: str, status: int) -> None:
        if status != 0:
            raise UcxError(what, status)

    def register(self, msg: Register) -> Reply:
        self.deregister(Deregister(msg.region_id))
        seg = SharedSegment.attach(msg.name, msg.size)
        local = _Local(seg, [])
        self.locals[msg.region_id] = local
        for lane in self.lanes:
            memh = ctypes.c_void_p()
            self._check(
                "ucp_mem_map",
                self.lib.rfx_mem_map(lane.ctx_h, seg.address, seg.size, ctypes.byref(memh)),
            )
            assert memh.value is not None
            local.memhs.append(memh.value)
        if not msg.pack:
            return Reply(0, address=seg.address)
        # Peers read through lane 0 (its worker address is the one advertised).
        buf = ctypes.create_string_buffer(4096)
        size = ctypes.c_size_t()
        self._check(
            "ucp_rkey_pack",
            self.lib.rfx_rkey_pack(
                self.lanes[0].ctx_h, ctypes.c_void_p(local.memhs[0]), buf, 4096, ctypes.byref(size)
            ),
        )
        return Reply(0, address=seg.address, rkey=buf.raw[: size.value])

    def deregister(self, msg: Deregister) -> Reply:
        local = self.locals.pop(msg.region_id, None)
        if local is not None:
            for lane, memh in zip(self.lanes, local.memhs, strict=False):
                self.lib.rfx_mem_unmap(lane.ctx_h, ctypes.c_void_p(memh))
            local.segment.close()
        return Reply(0)

    def connect(self, msg: Connect) -> Reply:
        self.disconnect(Disconnect(msg.peer))
        peer = _Peer([], [], {})
        self.peers[msg.peer] = peer
        for lane in self.lanes:
            addr = self.api.UCXAddress.create_from_buffer(msg.address)
            # Error handling off: the only mode in which same-host GETs take cma.
            ep = self.api.UCXEndpoint.create_from_worker_address(lane.worker, addr, False)
            peer.eps.append(ep)
            peer.handles.append(ep.handle)
        for r in msg.regions:
            keys = []
            for handle in peer.handles:
                rkey = ctypes.c_void_p()
                self._check(
                    f"ucp_ep_rkey_unpack of region {r.region_id}",
                    self.lib.rfx_rkey_unpack(ctypes.c_void_p(handle), r.key, ctypes.byref(rkey)),
                )
                assert rkey.value is not None
                keys.append(rkey.value)
            peer.regions[r.region_id] = _Remote(r.address, r.size, keys)
        return Reply(0)

    def disconnect(self, msg: Disconnect) -> Reply:
        peer = self.peers.pop(msg.peer, None)
        if peer is not None:
            for r in peer.regions.values():
                for key in r.rkeys:
                    self.lib.rfx_rkey_destroy(ctypes.c_void_p(key))
            # The endpoints are closed by ucxx when the objects go.
        return Reply(0)

    def get(self, msg: Get) -> Reply:
        peer = self.peers.get(msg.peer)
        if peer is None:
            return Reply(0, error=f"get refused: peer {msg.peer} is not connected", kind="refused")
        batch = np.frombuffer(msg.batch, dtype=READ_DTYPE)
        # The owner validated too; this process trusts only its own records.
        validate_batch(
            batch,
            {k: v.segment.size for k, v in self.locals.items()},
            {k: v.size for k, v in peer.regions.items()},
        )
        reads = coalesce(batch)
        n = len(reads)
        if n == 0:
            return Reply(0)
        l_ids = np.array(sorted(self.locals), np.int64)
        l_base = np.array([self.locals[int(i)].segment.address for i in l_ids], np.int64)
        r_ids = np.array(sorted(peer.regions), np.int64)
        r_base = np.array([peer.regions[int(i)].address for i in r_ids], np.int64)
        li = np.searchsorted(l_ids, reads["local_region"])
        ri = np.searchsorted(r_ids, reads["remote_region"])
        dst = l_base[li] + reads["local_offset"]
        src = r_base[ri] + reads["remote_offset"]
        lanes = len(self.lanes) if int(reads["nbytes"].sum()) >= LANE_MIN_BYTES else 1
        shares = split_shares(dst, src, reads["nbytes"], lanes, ri)
        deadline = msg.deadline_ns
        if self.pool is None or len(shares) == 1:
            statuses = [self._post(peer, r_ids, 0, deadline, *shares[0])]
        else:
            # Shares 1.. go to the pool; share 0 is posted from this thread meanwhile,
            # so no lane waits for a thread hand-off to start.
            jobs = [
                self.pool.submit(self._post, peer, r_ids, k, deadline, *sh)
                for k, sh in enumerate(shares)
                if k > 0
            ]
            statuses = [self._post(peer, r_ids, 0, deadline, *shares[0])]
            statuses += [j.result() for j in jobs]  # each lane stops by the deadline
        if self.timed_out in statuses or UCS_ERR_NO_MEMORY in statuses:
            self.must_exit = True  # GETs may be in flight: see the module docstring
            late = (time.monotonic_ns() - deadline) / 1e9
            return Reply(
                0,
                error=f"the batch of {n} reads did not finish by its deadline "
                f"({late:+.3f} s past it when it gave up)",
                kind="timeout",
                reads=n,
            )
        status = next((st for st in statuses if st != 0), 0)
        if status != 0:
            return Reply(
                0,
                error=f"ucp_get_nbx/flush failed with UCX status {status}",
                kind="transport",
                reads=n,
            )
        return Reply(0, reads=n)

    def _post(
        self,
        peer: _Peer,
        r_ids: npt.NDArray[np.int64],
        lane: int,
        deadline_ns: int,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        length: npt.NDArray[np.int64],
        region_index: npt.NDArray[np.int64],
    ) -> int:
        """Post one share on one lane and wait for it; returns a ucs_status_t."""
        keys = np.array([peer.regions[int(i)].rkeys[lane] for i in r_ids], np.uint64)[region_index]
        d, s, n = (np.ascontiguousarray(x, dtype=np.int64) for x in (dst, src, length))
        posted = ctypes.c_int64()
        status: int = self.lib.rfx_get_batch(
            self.lanes[lane].handle,
            self.lanes[lane].efd,
            ctypes.c_void_p(peer.handles[lane]),
            len(n),
            d.ctypes.data,
            s.ctypes.data,
            n.ctypes.data,
            keys.ctypes.data,
            deadline_ns,
            ctypes.byref(posted),
        )
        return status

    def handle(self, env: Envelope) -> Reply:
        body = env.body
        try:
            if isinstance(body, Register):
                reply = self.register(body)
            elif isinstance(body, Deregister):
                reply = self.deregister(body)
            elif isinstance(body, Connect):
                reply = self.connect(body)
            elif isinstance(body, Disconnect):
                reply = self.disconnect(body)
            elif isinstance(body, Get):
                reply = self.get(body)
            else:
                reply = Reply(0)
        except ReadRefused as exc:
            reply = Reply(0, error=str(exc), kind="refused")
        except UcxError as exc:
            reply = Reply(0, error=str(exc), kind="transport")
        except Exception as exc:  # the owner must get an answer for every request
            reply = Reply(0, error=f"{type(exc).__name__}: {exc}", kind="refused")
        return msgspec.structs.replace(reply, seq=env.seq)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def _end(code: int) -> NoReturn:
    """Exit now, without interpreter teardown: ucxx closing endpoints to a hung
    peer could block, and nothing here needs an orderly goodbye (the owner unlinks
    the segments; the kernel reclaims the rest)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(fd: int, lanes: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:
        return 1  # the owner died before we could ask to follow it
    sock = socket.socket(fileno=fd)
    plane = DataPlane(lanes)
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(Envelope)
    sock.sendall(frame(enc.encode(Reply(0, worker_address=plane.address))))
    while True:
        plane.lib.rfx_idle(plane.worker_h, plane.efd, sock.fileno(), -1)
        header = _recv_exact(sock, 4)
        if header is None:
            _end(0)
        body = _recv_exact(sock, frame_size(header))
        if body is None:
            _end(0)
        env = dec.decode(body)
        if isinstance(env.body, Stop):
            for rid in list(plane.locals):
                plane.deregister(Deregister(rid))
            sock.sendall(frame(enc.encode(Reply(env.seq))))
            _end(0)
        sock.sendall(frame(enc.encode(plane.handle(env))))
        if plane.must_exit:
            _end(EXIT_TIMED_OUT)


if __name__ == "__main__":
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1))
