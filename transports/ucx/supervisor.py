"""The ucx transport's child processes: start one, talk to it, stop it.

A child (`transports.ucx.worker`, run as ``python -P -m``) owns the UCX contexts;
the owner talks to it over a socketpair in length-prefixed msgpack frames
(`transports.ucx.protocol`). This module is the mechanics of one child, and no
policy: which children exist, and what happens when one dies (restart the serving
one, fail the pulls of a pulling one), is `transports.ucx.transport`'s.

- `start_child` spawns a child, waits for its hello (its UCX worker address), and
  starts the task that routes its replies; once the reply stream ends it waits for
  the exit status and hands the child to ``on_exit``.
- `Child.call` sends a request and waits for its reply for a bounded time; a child
  that misses the bound is killed (only a dead process cannot still write into
  memory whose pull was already reported failed).
- `Child.stop` asks it to stop, kills it if it does not, and reaps it.
- A child's stdout and stderr are drained into the logger ``refitd.dataplane``; the
  last lines are kept to say why it died.
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
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import msgspec

from refitd.errors import ProtocolError, TransportError

from ..batch import ReadBatch
from .protocol import EXIT_TIMED_OUT, Envelope, Reply, Request, Stop, frame, frame_size

__all__ = ["SERVING", "Child", "ChildTimedOut", "describe", "start_child"]

log = logging.getLogger("refitd.dataplane")
OUTPUT_TAIL = 40  # lines of a child's stdout/stderr kept to explain its death
SERVING = "serving"
"""The role of the serving child; a pulling child's role is its peer's key."""
STOP_LIMIT_S = 10.0
"""Seconds a child gets to stop when asked, and again to exit, before it is killed."""

HELLO_S = 60.0
"""Seconds a new child gets to say hello (its UCX context made) before it is killed
and its start fails, saying so."""


class ChildTimedOut(TransportError):
    """A child gave up a batch at its deadline (and is exiting)."""


@dataclass
class Pending:
    """A request awaiting its reply; ``batch`` is set for a GET (its suspect ranges
    are reported if the child dies under it)."""

    future: asyncio.Future[Reply]
    batch: ReadBatch | None = None
    peer_id: str = ""


class Output:
    """Drains a child's stdout+stderr into the daemon's log (logger
    ``refitd.dataplane``) and keeps the last lines, to say why it died."""

    def __init__(self, stream: asyncio.StreamReader | None, pid: int) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL)
        self.pid = pid
        self.task = asyncio.create_task(self._drain(stream), name=f"ucx-output-{pid}")

    async def _drain(self, stream: asyncio.StreamReader | None) -> None:
        """Read until the child closes its output, a line at a time; a line longer
        than the stream's limit is logged cut short, and reading goes on (a child
        whose pipe nobody reads blocks on its next write)."""
        if stream is None:
            return
        while True:
            try:
                line = await stream.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:
                line = exc.partial  # its last words, with no newline: then the end
            except asyncio.LimitOverrunError as exc:
                line = await stream.readexactly(exc.consumed) + b" [cut short]"
            if not line:
                return
            text = line.decode(errors="replace").rstrip()
            if text:
                self.lines.append(text)
                log.warning("data-plane process %d: %s", self.pid, text)

    async def cause(self) -> str:
        """The child's last words once its output is closed: the last line of a
        traceback names the exception and its message; after a fatal signal
        (faulthandler's report) they are the error and the innermost frame."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await asyncio.shield(self.task)
        lines = list(self.lines)
        fatal = [i for i, text in enumerate(lines) if text.startswith("Fatal Python error")]
        if fatal:
            frames = [t.strip() for t in lines[fatal[-1] :] if t.strip().startswith("File ")]
            return "; ".join([lines[fatal[-1]], *frames[:1]])
        return lines[-1] if lines else ""


@dataclass(eq=False)  # compared and hashed by identity
class Child:
    """One data-plane child process and the requests in flight to it."""

    proc: asyncio.subprocess.Process
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    address: bytes
    role: str  # SERVING, or the key of the peer it pulls from
    incarnation: int = 0  # the serving child's incarnation: 1 for the first start
    pending: dict[int, Pending] = field(default_factory=dict)
    reader_task: asyncio.Task[None] | None = None
    dead: bool = False  # set once its death was handled: nothing may wait on it after
    stopping: bool = False  # asked to stop: its exit is expected
    output: Output | None = None
    # pulling children only
    peer_id: str = ""
    connected: set[int] = field(default_factory=set)  # UcxPeer handles connected in it
    registered: dict[int, str] = field(default_factory=dict)  # region id -> segment name
    last_used: float = 0.0
    seq: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def send(
        self, body: Request, batch: ReadBatch | None = None, peer_id: str = ""
    ) -> asyncio.Future[Reply]:
        """Queue ``body``; the future gets its reply (or its death)."""
        if self.dead:
            raise TransportError("the ucx data-plane process died before the request was sent")
        seq = next(self.seq)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self.pending[seq] = Pending(fut, batch, peer_id)
        self.writer.write(frame(msgspec.msgpack.encode(Envelope(seq, body))))
        return fut

    async def call(
        self, body: Request, batch: ReadBatch | None = None, *, peer_id: str = "", limit: float
    ) -> Reply:
        """Send ``body`` and wait for its reply, ``limit`` s at most. A child that
        misses it is killed, and TimeoutError raised. A reply of kind "timeout" (the
        child gave up a batch at its deadline, and is exiting) raises `ChildTimedOut`,
        one of kind "refused" `ProtocolError`."""
        fut = self.send(body, batch, peer_id)
        try:
            async with asyncio.timeout(limit):
                # A broken pipe means the child died: the reader task reports that to `fut`.
                with contextlib.suppress(ConnectionError):
                    await self.writer.drain()
                reply = await fut
        except TimeoutError:
            # A child that does not answer in time is as good as dead: a serving child
            # is restarted by its supervision, a pulling one on its peer's next get.
            log.warning(
                "ucx data-plane process %d did not answer a %s request within %s s: killed",
                self.proc.pid,
                type(body).__name__.lower(),
                limit,
            )
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            raise
        if reply.error:
            if reply.kind == "refused":
                raise ProtocolError(f"ucx data plane refused: {reply.error}")
            if reply.kind == "timeout":
                raise ChildTimedOut(reply.error)
            raise TransportError(reply.error)
        return reply

    async def why(self, code: int) -> str:
        """Why it exited with status ``code``, with its last output where that says more."""
        why = describe(code)
        last = await self.output.cause() if self.output is not None else ""
        if last and code not in (0, EXIT_TIMED_OUT):
            why = f"{why}; its last output: {last}"
        return why

    async def stop(self, request_timeout: float) -> None:
        """Ask it to stop (bounded), kill it if it does not, and reap it."""
        self.stopping = True
        if not self.dead:
            with contextlib.suppress(TransportError, OSError, TimeoutError):
                await self.call(Stop(), limit=min(request_timeout, STOP_LIMIT_S))
        self.writer.close()
        try:
            async with asyncio.timeout(STOP_LIMIT_S):
                await self.proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        if self.reader_task is not None:
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                async with asyncio.timeout(STOP_LIMIT_S):  # fails what was pending on it
                    await asyncio.shield(self.reader_task)
            self.reader_task.cancel()
        if self.output is not None:
            await self.output.cause()  # its output is drained to the end
            self.output.task.cancel()


WORKER = "transports.ucx.worker"
"""The module a child runs (``python -P -X faulthandler -m``)."""
START_ATTEMPTS = 3
"""Tries to start a child whose earlier try died by a signal before its hello: such a
child was never sent a request, so starting another loses and risks nothing. Two such
deaths in a row (SIGSEGV inside UCX's start, in the simulated-hosts cluster test on a
quiet machine) were seen once, so a start gets three tries."""


class _DiedAtStart(TransportError):
    """A child died by a signal before its hello."""


async def start_child(
    lanes: int,
    role: str,
    peer_id: str,
    on_exit: Callable[[Child, int], Awaitable[None]],
    module: str = WORKER,
) -> Child:
    """Spawn a child with ``lanes`` UCX contexts and wait (``HELLO_S`` at most) for its hello.

    Its replies are routed to their requests until its reply stream ends; then its
    exit status is awaited and ``on_exit(child, status)`` is called (from the reply
    task). A child that fails to start raises `TransportError` naming its last words;
    one killed by a signal before its hello is started again (`START_ATTEMPTS`), with
    a warning naming why the first died.
    """
    for attempt in itertools.count(1):
        try:
            return await _spawn(lanes, role, peer_id, on_exit, module)
        except _DiedAtStart as exc:
            if attempt >= START_ATTEMPTS:
                raise TransportError(f"{exc} (after {attempt} tries)") from exc
            log.warning("%s; starting it again", exc)
    raise AssertionError("unreachable")  # pragma: no cover


async def _spawn(
    lanes: int,
    role: str,
    peer_id: str,
    on_exit: Callable[[Child, int], Awaitable[None]],
    module: str,
) -> Child:
    parent, child = socket.socketpair()
    env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n")
    try:
        # -P: the daemon's working directory must not shadow the installed modules;
        # -X faulthandler: a fatal signal (inside UCX) prints the frame it hit.
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-P",
            "-X",
            "faulthandler",
            "-m",
            module,
            str(child.fileno()),
            str(lanes),
            pass_fds=(child.fileno(),),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
    finally:
        child.close()
    output = Output(proc.stdout, proc.pid)
    reader, writer = await asyncio.open_unix_connection(sock=parent)
    try:
        async with asyncio.timeout(HELLO_S):
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
        if isinstance(exc, TimeoutError):  # its SIGKILL was ours: say so, not the signal
            cause = cause or f"it said no hello within {HELLO_S:g} s and was killed"
            code_said = f"no hello within {HELLO_S:g} s: killed"
        else:
            code_said = describe(code)
        what = f"ucx data-plane process failed to start: {cause or code_said}" + (
            f" ({code_said})" if cause else ""
        )
        signalled = code < 0 and not isinstance(exc, TimeoutError)
        raise (_DiedAtStart if signalled else TransportError)(what) from exc
    c = Child(proc, reader, writer, hello.worker_address, role, output=output, peer_id=peer_id)
    c.reader_task = asyncio.create_task(_route_replies(c, on_exit), name=f"ucx-replies-{proc.pid}")
    return c


async def _route_replies(c: Child, on_exit: Callable[[Child, int], Awaitable[None]]) -> None:
    try:
        while True:
            reply = msgspec.msgpack.decode(await _read_frame(c.reader), type=Reply)
            p = c.pending.pop(reply.seq, None)
            if p is not None and not p.future.done():
                p.future.set_result(reply)
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    await on_exit(c, await c.proc.wait())


def describe(code: int) -> str:
    """A child's exit status in words."""
    if code == EXIT_TIMED_OUT:
        return f"exit status {code}: it gave up a batch at its deadline"
    try:
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    except ValueError:
        return f"signal {-code}"


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    n = frame_size(await reader.readexactly(4))
    return await reader.readexactly(n)
