"""The data-plane process: the only process of a daemon that talks UCX.

Started by `transports.ucx.UcxTransport` with one end of a socketpair as its
argument. It owns the UCX context and worker (made through ucxx), maps shared
segments by name and registers them, creates endpoints from peers' worker
addresses with error handling off (the only way UCX takes the zero-copy ``cma``
path on one host), and posts batches of GETs from the C helper.

Why a separate process: on the ``cma`` path UCX aborts the reading process when a
peer dies, and a corrupt key or wild address crashes it. Here that costs this
process; the owner sees the socket close, fails the batches in flight with their
suspect destination ranges, and starts a new one.

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
from dataclasses import dataclass

import msgspec
import numpy as np

from ..core import READ_DTYPE, ReadRefused, coalesce, validate_batch
from ..shm import SharedSegment
from .protocol import (
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


@dataclass
class _Local:
    segment: SharedSegment
    memh: int


@dataclass
class _Remote:
    address: int
    size: int
    rkey: int


@dataclass
class _Peer:
    ep: object  # ucxx UCXEndpoint, kept alive here
    handle: int
    regions: dict[int, _Remote]


class UcxError(Exception):
    def __init__(self, what: str, status: int) -> None:
        super().__init__(f"{what} failed with UCX status {status}")


class DataPlane:
    def __init__(self) -> None:
        from ucxx._lib import libucxx as ucx_api

        from ..native import ucx_lib

        self.api = ucx_api
        self.context = ucx_api.UCXContext({})
        self.worker = ucx_api.UCXWorker(self.context)
        self.lib = ucx_lib()
        self.ctx_h = ctypes.c_void_p(self.context.handle)
        self.worker_h = ctypes.c_void_p(self.worker.handle)
        efd = ctypes.c_int(-1)
        self._check("ucp_worker_get_efd", self.lib.rfx_worker_efd(self.worker_h, ctypes.byref(efd)))
        self.efd = efd.value
        self.address = bytes(self.worker.address.tobytes())
        self.locals: dict[int, _Local] = {}
        self.peers: dict[int, _Peer] = {}

    @staticmethod
    def _check(what: str, status: int) -> None:
        if status != 0:
            raise UcxError(what, status)

    def register(self, msg: Register) -> Reply:
        self.deregister(Deregister(msg.region_id))
        seg = SharedSegment.attach(msg.name, msg.size)
        memh = ctypes.c_void_p()
        self._check(
            "ucp_mem_map",
            self.lib.rfx_mem_map(self.ctx_h, seg.address, seg.size, ctypes.byref(memh)),
        )
        buf = ctypes.create_string_buffer(4096)
        size = ctypes.c_size_t()
        self._check(
            "ucp_rkey_pack", self.lib.rfx_rkey_pack(self.ctx_h, memh, buf, 4096, ctypes.byref(size))
        )
        assert memh.value is not None
        self.locals[msg.region_id] = _Local(seg, memh.value)
        return Reply(0, address=seg.address, rkey=buf.raw[: size.value])

    def deregister(self, msg: Deregister) -> Reply:
        local = self.locals.pop(msg.region_id, None)
        if local is not None:
            self.lib.rfx_mem_unmap(self.ctx_h, ctypes.c_void_p(local.memh))
            local.segment.close()
        return Reply(0)

    def connect(self, msg: Connect) -> Reply:
        self.disconnect(Disconnect(msg.peer))
        addr = self.api.UCXAddress.create_from_buffer(msg.address)
        # Error handling off: the only mode in which same-host GETs take cma.
        ep = self.api.UCXEndpoint.create_from_worker_address(self.worker, addr, False)
        peer = _Peer(ep, ep.handle, {})
        self.peers[msg.peer] = peer
        for r in msg.regions:
            rkey = ctypes.c_void_p()
            self._check(
                f"ucp_ep_rkey_unpack of region {r.region_id}",
                self.lib.rfx_rkey_unpack(ctypes.c_void_p(peer.handle), r.rkey, ctypes.byref(rkey)),
            )
            assert rkey.value is not None
            peer.regions[r.region_id] = _Remote(r.address, r.size, rkey.value)
        return Reply(0)

    def disconnect(self, msg: Disconnect) -> Reply:
        peer = self.peers.pop(msg.peer, None)
        if peer is not None:
            for r in peer.regions.values():
                self.lib.rfx_rkey_destroy(ctypes.c_void_p(r.rkey))
            # The endpoint is closed by ucxx when the object goes.
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
        l_ids = sorted(self.locals)
        l_base = np.array([self.locals[i].segment.address for i in l_ids], np.uint64)
        r_ids = sorted(peer.regions)
        r_base = np.array([peer.regions[i].address for i in r_ids], np.uint64)
        r_key = np.array([peer.regions[i].rkey for i in r_ids], np.uint64)
        li = np.searchsorted(np.array(l_ids, np.int64), reads["local_region"])
        ri = np.searchsorted(np.array(r_ids, np.int64), reads["remote_region"])
        dst = l_base[li] + reads["local_offset"].astype(np.uint64)
        src = r_base[ri] + reads["remote_offset"].astype(np.uint64)
        length = reads["nbytes"].astype(np.uint64)
        rkeys = r_key[ri]
        posted = ctypes.c_int64()
        status = self.lib.rfx_get_batch(
            self.worker_h,
            self.efd,
            ctypes.c_void_p(peer.handle),
            n,
            dst.ctypes.data,
            src.ctypes.data,
            length.ctypes.data,
            rkeys.ctypes.data,
            ctypes.byref(posted),
        )
        if status != 0:
            return Reply(
                0,
                error=f"ucp_get_nbx/flush failed with UCX status {status}",
                kind="transport",
                reads=n,
            )
        return Reply(0, reads=n)

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


def main(fd: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:
        return 1  # the owner died before we could ask to follow it
    sock = socket.socket(fileno=fd)
    plane = DataPlane()
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(Envelope)
    sock.sendall(frame(enc.encode(Reply(0, worker_address=plane.address))))
    while True:
        plane.lib.rfx_idle(plane.worker_h, plane.efd, sock.fileno(), -1)
        header = _recv_exact(sock, 4)
        if header is None:
            return 0
        body = _recv_exact(sock, frame_size(header))
        if body is None:
            return 0
        env = dec.decode(body)
        if isinstance(env.body, Stop):
            for rid in list(plane.locals):
                plane.deregister(Deregister(rid))
            sock.sendall(frame(enc.encode(Reply(env.seq))))
            return 0
        sock.sendall(frame(enc.encode(plane.handle(env))))


if __name__ == "__main__":
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    sys.exit(main(int(sys.argv[1])))
