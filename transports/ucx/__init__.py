"""The ``ucx`` transport: one-sided UCX GETs from a supervised data-plane process.

The owner (this class, in the daemon's process) never loads UCX. It starts a child
(`transports.ucx.worker`) that owns the UCX context, and talks to it over a
socketpair. Records and batches are validated here before anything is sent, and
again in the child against its own records before anything is posted.

Supervision: when the child dies (a peer died on the ``cma`` path, a crash), every
batch in flight fails with `PeerLost` naming its suspect destination ranges, a new
child is started, every local region is registered again (new keys, new epochs —
re-advertise after `generation` changes) and peers are reconnected lazily on their
next `get`. A child that cannot start ``max_restarts`` times in a row closes the
transport.

Regions must be named shared segments (`transports.shm.SharedSegment`): the child
maps them by name, so bytes land directly in the owner's memory.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np
import numpy.typing as npt

from refitd.errors import NotFoundError, ProtocolError, TransportError

from ..core import (
    LocalRegion,
    Peer,
    PeerInfo,
    PeerLost,
    PullFailed,
    ReadBatch,
    ReadRefused,
    RegionInfo,
    Segment,
    Transport,
    TransportClosed,
    as_read_batch,
    suspect_ranges,
    validate_batch,
)
from .protocol import (
    Connect,
    Deregister,
    Disconnect,
    Envelope,
    Get,
    Register,
    Reply,
    Request,
    Stop,
    frame,
    frame_size,
)

__all__ = ["UcxPeer", "UcxTransport"]

log = logging.getLogger("refitd.dataplane")
OUTPUT_TAIL = 40  # lines of a child's stdout/stderr kept to explain its death


@dataclass
class _Pending:
    future: asyncio.Future[Reply]
    batch: ReadBatch | None = None


@dataclass
class _Child:
    proc: asyncio.subprocess.Process
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    address: bytes
    generation: int
    pending: dict[int, _Pending] = field(default_factory=dict)
    reader_task: asyncio.Task[None] | None = None
    dead: bool = False  # set once its death was handled: nothing may wait on it after
    output: _Output | None = None


class _Output:
    """Drains a child's stdout+stderr into the daemon's log (logger
    ``refitd.dataplane``) and keeps the last lines, to say why it died."""

    def __init__(self, stream: asyncio.StreamReader | None, pid: int) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL)
        self.pid = pid
        self.task = asyncio.create_task(self._drain(stream), name=f"ucx-output-{pid}")

    async def _drain(self, stream: asyncio.StreamReader | None) -> None:
        if stream is None:
            return
        while line := await stream.readline():
            text = line.decode(errors="replace").rstrip()
            if text:
                self.lines.append(text)
                log.warning("data-plane process %d: %s", self.pid, text)

    async def cause(self) -> str:
        """The child's last words once its output is closed: the last line of a
        traceback names the exception and its message."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await asyncio.shield(self.task)
        return self.lines[-1] if self.lines else ""


class UcxPeer(Peer):
    def __init__(self, owner: UcxTransport, handle: int, info: PeerInfo) -> None:
        self.owner = owner
        self.handle = handle
        self.info = info
        self._sizes = {r.region_id: r.size for r in info.regions}
        self.connected_generation = -1
        self._closed = False

    async def update(self, info: PeerInfo) -> None:
        info.verify(self.owner.secret)  # before any key reaches UCX
        self.info = info
        self._sizes = {r.region_id: r.size for r in info.regions}
        self.connected_generation = -1

    async def get(self, batch: ReadBatch | npt.NDArray[np.int64] | Iterable[Sequence[int]]) -> None:
        if self._closed:
            raise TransportClosed(f"get refused: connection to {self.info.peer_id!r} is closed")
        reads = as_read_batch(batch)
        validate_batch(reads, self.owner.local_sizes(), self._sizes)
        if not (reads["nbytes"] > 0).any():
            return
        await self.owner._pull(self, reads)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.owner._peers.pop(self.handle, None)
        child = self.owner._child
        if child is not None and self.connected_generation == child.generation:
            with contextlib.suppress(TransportError):
                await self.owner._call(Disconnect(self.handle))


class UcxTransport(Transport):
    """UCX GETs through a supervised child. ``pull_timeout`` bounds one batch (s);
    ``lanes`` UCX contexts+workers in the child post a large batch's shares from
    that many threads (default: 2, or 1 on a 1-core host). Measured on 2 idle cores:
    1 MiB pieces 7.7 -> 12-14 GB/s, shuffled 4 KiB 1.9 -> 3.2 GB/s; on 2 cores
    saturated by other work a second lane gains nothing, so set 1 there."""

    scheme = "ucx"

    def __init__(
        self,
        *,
        secret: bytes,
        peer_id: str = "",
        pull_timeout: float = 120.0,
        max_restarts: int = 5,
        on_restart: Callable[[int], None] | None = None,
        lanes: int | None = None,
    ) -> None:
        super().__init__(secret=secret, peer_id=peer_id)
        self.pull_timeout = pull_timeout
        self.max_restarts = max_restarts
        self.on_restart = on_restart
        self.lanes = max(1, lanes if lanes is not None else min(2, os.cpu_count() or 1))
        self.generation = 0
        self.restarts = 0
        self._child: _Child | None = None
        self._regions: dict[int, LocalRegion] = {}
        self._peers: dict[int, UcxPeer] = {}
        self._seq = itertools.count(1)
        self._handles = itertools.count(1)
        self._epoch = time.time_ns()
        self._lock = asyncio.Lock()  # serialises (re)starts
        self._closed = True

    # -- child lifecycle

    async def start(self) -> None:
        self._closed = False
        async with self._lock:
            await self._spawn()

    async def _spawn(self) -> None:
        parent, child = socket.socketpair()
        env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n")
        try:
            # -P: the daemon's working directory must not shadow the installed modules.
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-P",
                "-m",
                "transports.ucx.worker",
                str(child.fileno()),
                str(self.lanes),
                pass_fds=(child.fileno(),),
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
        finally:
            child.close()
        output = _Output(proc.stdout, proc.pid)
        reader, writer = await asyncio.open_unix_connection(sock=parent)
        try:
            async with asyncio.timeout(60):
                hello = msgspec.msgpack.decode(await _read_frame(reader), type=Reply)
        except (asyncio.IncompleteReadError, TimeoutError) as exc:
            writer.close()
            try:  # it closed its end: let it finish dying, so its status is its own
                async with asyncio.timeout(0 if isinstance(exc, TimeoutError) else 5):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            code = await proc.wait()
            cause = await output.cause()
            raise TransportError(
                f"ucx data-plane process failed to start: {cause or _describe(code)}"
                + (f" ({_describe(code)})" if cause else "")
            ) from exc
        self.generation += 1
        c = _Child(proc, reader, writer, hello.worker_address, self.generation, output=output)
        c.reader_task = asyncio.create_task(
            self._read_replies(c), name=f"ucx-replies-{self.generation}"
        )
        self._child = c
        for rid, region in list(self._regions.items()):
            self._regions[rid] = await self._register_in(c, rid, region.segment)

    async def _read_replies(self, c: _Child) -> None:
        try:
            while True:
                reply = msgspec.msgpack.decode(await _read_frame(c.reader), type=Reply)
                p = c.pending.pop(reply.seq, None)
                if p is not None and not p.future.done():
                    p.future.set_result(reply)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        code = await c.proc.wait()
        await self._child_died(c, code)

    async def _child_died(self, c: _Child, code: int) -> None:
        why = _describe(code)
        last = await c.output.cause() if c.output is not None else ""
        if last and code != 0:
            why = f"{why}; its last output: {last}"
        if not self._closed:
            log.warning("ucx data-plane process %d died (%s)", c.proc.pid, why)
        c.dead = True
        c.writer.close()
        for p in c.pending.values():
            if p.future.done():
                continue
            if p.batch is None:
                p.future.set_exception(
                    TransportError(f"ucx data-plane process died ({why}) during a request")
                )
            else:
                p.future.set_exception(
                    PeerLost(
                        f"pull failed: the ucx data-plane process died ({why}), most likely because a "
                        "peer died mid-read",
                        suspect_ranges(p.batch),
                    )
                )
        c.pending.clear()
        if self._closed or self._child is not c:
            return
        self._child = None
        async with self._lock:
            if self._closed or self._child is not None:
                return
            for _ in range(self.max_restarts):
                try:
                    await self._spawn()
                    break
                except TransportError:
                    continue
            else:
                self._closed = True
                return
            self.restarts += 1
        if self.on_restart is not None:
            self.on_restart(self.generation)

    async def close(self) -> None:
        if self._closed and self._child is None:
            return
        self._closed = True
        for peer in list(self._peers.values()):
            peer._closed = True
        self._peers.clear()
        async with self._lock:  # let a restart in progress finish, then stop its child
            c, self._child = self._child, None
        if c is None:
            return
        with contextlib.suppress(TransportError, OSError, TimeoutError):
            async with asyncio.timeout(10):
                await self._call_in(c, Stop())
        c.writer.close()
        try:
            async with asyncio.timeout(10):
                await c.proc.wait()
        except TimeoutError:
            c.proc.kill()
            await c.proc.wait()
        if c.reader_task is not None:
            c.reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await c.reader_task
        if c.output is not None:
            await c.output.cause()  # its output is drained to the end
            c.output.task.cancel()
        self._regions.clear()

    @property
    def pid(self) -> int | None:
        """Process id of the current data-plane child (for supervision and tests)."""
        return self._child.proc.pid if self._child is not None else None

    # -- requests

    async def _ready(self) -> _Child:
        if self._closed:
            raise TransportClosed("ucx transport is closed")
        if self._child is None:
            async with self._lock:
                pass  # a restart in progress holds the lock
        if self._child is None:
            raise TransportClosed(
                "ucx transport is closed: its data-plane process could not be restarted"
            )
        return self._child

    async def _call_in(self, c: _Child, body: Request, batch: ReadBatch | None = None) -> Reply:
        if c.dead:
            raise TransportError("the ucx data-plane process died before the request was sent")
        seq = next(self._seq)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        c.pending[seq] = _Pending(fut, batch)
        c.writer.write(frame(msgspec.msgpack.encode(Envelope(seq, body))))
        # A broken pipe means the child died: the reader task reports that to `fut`.
        with contextlib.suppress(ConnectionError):
            await c.writer.drain()
        reply = await fut
        if reply.error:
            if reply.kind == "refused":
                raise ProtocolError(f"ucx data plane refused: {reply.error}")
            raise TransportError(reply.error)
        return reply

    async def _call(self, body: Request, batch: ReadBatch | None = None) -> Reply:
        return await self._call_in(await self._ready(), body, batch)

    # -- regions

    async def _register_in(self, c: _Child, region_id: int, segment: Segment) -> LocalRegion:
        reply = await self._call_in(c, Register(region_id, segment.name, segment.size))
        self._epoch += 1
        info = RegionInfo(
            region_id=region_id,
            epoch=self._epoch,
            address=reply.address,
            size=segment.size,
            rkey=reply.rkey,
        )
        return LocalRegion(region_id, segment, info)

    async def register(self, region_id: int, segment: Segment) -> LocalRegion:
        region = await self._register_in(await self._ready(), region_id, segment)
        self._regions[region_id] = region
        return region

    async def deregister(self, region_id: int) -> None:
        if region_id not in self._regions:
            raise NotFoundError(f"deregistering region {region_id} refused: not registered")
        del self._regions[region_id]
        await self._call(Deregister(region_id))

    @property
    def regions(self) -> dict[int, LocalRegion]:
        return dict(self._regions)

    async def wait_ready(self) -> None:
        """Return once a data-plane process is up (after a restart, its regions too)."""
        await self._ready()

    def advertise(self) -> PeerInfo:
        if self._child is None:
            raise TransportError(
                "advertise refused: the ucx data-plane process is restarting or closed; await wait_ready()"
            )
        return PeerInfo(
            scheme=self.scheme,
            peer_id=self.peer_id,
            address=self._child.address,
            regions=tuple(r.info for r in self._regions.values()),
        ).signed(self.secret)

    # -- peers

    async def connect(self, info: PeerInfo) -> Peer:
        await self._ready()
        info.verify(self.secret)  # a forged record never reaches ucp_ep_rkey_unpack
        if info.scheme != self.scheme:
            raise ProtocolError(
                f"connect refused: record is for scheme {info.scheme!r}, not {self.scheme!r}"
            )
        peer = UcxPeer(self, next(self._handles), info)
        await self._connect_peer(peer)
        self._peers[peer.handle] = peer
        return peer

    async def _connect_peer(self, peer: UcxPeer) -> _Child:
        c = await self._ready()
        if peer.connected_generation != c.generation:
            await self._call_in(c, Connect(peer.handle, peer.info.address, peer.info.regions))
            peer.connected_generation = c.generation
        return c

    async def _pull(self, peer: UcxPeer, reads: ReadBatch) -> None:
        c = await self._connect_peer(peer)
        try:
            async with asyncio.timeout(self.pull_timeout):
                await self._call_in(c, Get(peer.handle, reads.tobytes()), batch=reads)
        except TimeoutError:
            # A hung data plane is as good as dead: kill it; the supervisor restarts it.
            with contextlib.suppress(ProcessLookupError):
                c.proc.kill()
            raise PeerLost(
                f"pull from {peer.info.peer_id!r} timed out after {self.pull_timeout} s; the data-plane "
                "process was restarted",
                suspect_ranges(reads),
            ) from None
        except ProtocolError as exc:
            raise ReadRefused(0, tuple(int(v) for v in reads[0].tolist()), str(exc)) from exc  # type: ignore[arg-type]
        except PullFailed:
            raise
        except TransportError as exc:
            raise PullFailed(
                f"pull from {peer.info.peer_id!r} failed: {exc}", suspect_ranges(reads)
            ) from exc


def _describe(code: int) -> str:
    try:
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    except ValueError:
        return f"signal {-code}"


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    n = frame_size(await reader.readexactly(4))
    return await reader.readexactly(n)
