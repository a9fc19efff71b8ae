"""Starting daemons in the tests, and two fakes.

A daemon's settings are a :class:`~refitd.config.Config`, as ``refitd serve`` loads
it: :func:`daemon_config` builds one from the defaults and a few keys
(``daemon_config(transport="shm", deltas=True)``), and ``Daemon(config, secret=...)``
makes one. The one way to start a daemon in the test's own process is :func:`served`:
one daemon, with its app, URL and a client, its options keyword arguments (the
``[server]`` access settings checked and enforced as ``refitd serve`` does; wired with
the operator service, auth, metrics and the API document, as ``refitd serve`` wires
it; the token it presents to its peers). The rest are named uses of it:
:func:`serving_daemons` (several that trust each other) and, for a synchronous test,
:func:`served_in_a_thread`. Each serves a real daemon on 127.0.0.1:0 through
:func:`refitd.daemon.app.process.listening`, as ``refitd serve`` does, with its
ordered shutdown; an in-process daemon starts in a few milliseconds
(docs/testing.md). A test that needs the process boundary (its exit, its signals, a
crash) starts ``refitd serve`` through :func:`refitd.client.spawn.spawn_daemon`.

A server that is not a daemon (a peer that records what it is sent, a proxy that
breaks a stream, a miniature app of one product part) is served by
:func:`serving_app`. No other test module builds an aiohttp runner or site, or calls
``listening`` (``tests/test_one_way_to_start.py`` checks it).

The fakes, a settable clock and a gated copier, implement the daemon's own
interfaces (the ``clock`` callable and :class:`transports.local.Copier`);
everything else is real: HTTP on 127.0.0.1:0, shared memory, the data plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
from aiohttp import web

from refitd.client.http import RefitClient
from refitd.config import Config, ServerConfig, load_config
from refitd.daemon.access.auth import check_startup, setup_auth
from refitd.daemon.app.handlers import DAEMON
from refitd.daemon.app.node import Daemon
from refitd.daemon.app.process import listening
from refitd.daemon.app.sdnotify import Notifier
from refitd.daemon.app.service import Service
from transports.local import copy_addresses


def daemon_config(**settings: Any) -> Config:
    """The default configuration with ``settings`` over it, and ``server.port`` 0 (an
    in-process daemon binds any free port) unless given.

    A setting is named by its key alone (every key is in one section:
    ``transport="shm"`` is ``data_plane.transport``, ``readers=(...)`` is
    ``models.readers``), or by its section with a whole table
    (``limits=LimitsConfig(...)``). Loaded by :func:`refitd.config.load_config`, so a
    key or value the daemon would refuse is refused here too (the environment is
    ignored)."""
    sections = {f.name: f.type for f in msgspec.structs.fields(Config)}
    section_of = {
        key.name: section
        for section, table in sections.items()
        for key in msgspec.structs.fields(table)
    }
    overrides: dict[str, Any] = {"server.port": 0}
    for name, value in settings.items():
        if name in sections:
            table = msgspec.structs.asdict(value)
            overrides.update({f"{name}.{key}": v for key, v in table.items()})
        elif name in section_of:
            overrides[f"{section_of[name]}.{name}"] = value
        else:
            raise TypeError(f"daemon_config: {name!r} is no section, nor a key of one")
    return load_config(None, {}, overrides)


@dataclass(frozen=True)
class Served:
    """One daemon served in the test's process: the daemon, its app, its base URL
    and a client of it (without a token: the ``loopback`` principal)."""

    daemon: Daemon
    app: web.Application
    url: str
    client: RefitClient


def token_file(directory: Path, tokens: Mapping[str, str]) -> str:
    """A token file (``PRINCIPAL TOKEN`` lines, mode 0600) in ``directory``: its path,
    as ``ServerConfig(token_file=...)`` takes it."""
    path = directory / "tokens"
    path.write_text("".join(f"{name} {token}\n" for name, token in tokens.items()))
    path.chmod(0o600)
    return str(path)


@contextlib.asynccontextmanager
async def served(
    daemon: Daemon | None = None,
    *,
    access: ServerConfig | None = None,
    wired: bool = False,
    setup: Iterable[Callable[[web.Application], None]] = (),
    token: str | None = None,
    **settings: Any,
) -> AsyncIterator[Served]:
    """Serve ``daemon`` (else a new one of ``daemon_config(**settings)``) in this
    process for the block, on 127.0.0.1 and the port its config says (0 from
    :func:`daemon_config`: any free one).

    ``access`` is the ``[server]`` access configuration (token file, Unix socket
    uids, request size limit), checked and enforced as ``refitd serve`` does;
    ``wired`` sets the daemon up with the operator service as ``refitd serve`` does
    (access control by ``access``, else by the daemon's own ``[server]``; metrics,
    the API document, the shared-memory group); ``setup`` are more ``create_app``
    setup hooks (after those); ``token`` is the bearer token this daemon sends to
    its peers."""
    if daemon is not None and settings:
        raise TypeError(f"served: settings {sorted(settings)} are for a new daemon, not one given")
    d = daemon if daemon is not None else Daemon(daemon_config(**settings))
    hooks = list(setup)
    if wired:
        server = access if access is not None else d.config.server
        config = msgspec.structs.replace(d.config, server=server)
        hooks.insert(0, Service(config, check_startup(server), Notifier({})).setup)
    elif access is not None:
        policy = check_startup(access)
        hooks.insert(0, lambda app: setup_auth(app, policy))
    async with (
        listening(d, setup=hooks, token=token) as (app, url),
        RefitClient(url) as client,
    ):
        yield Served(d, app, url, client)


@dataclass(frozen=True)
class InAThread:
    """A daemon :func:`served` by an event loop of its own, in a thread: what
    :func:`served` yields, and that loop (the daemon's state is the loop's)."""

    served: Served
    loop: asyncio.AbstractEventLoop

    @property
    def url(self) -> str:
        return self.served.url

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the daemon's loop, answered here."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30.0)

    async def on_loop(self, coro: Callable[[], Awaitable[Any]]) -> Any:
        """Await ``coro()`` on the daemon's loop from the test's loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro(), self.loop))


@contextlib.contextmanager
def served_in_a_thread(
    daemon: Callable[[], Daemon] | None = None, *, start_s: float = 30.0, **options: Any
) -> Iterator[InAThread]:
    """:func:`served` (with ``options``) for a synchronous test, or one that measures
    the daemon apart from its clients: the daemon ``daemon()`` makes (else one of
    ``daemon_config(**options)``), made and served by an event loop of its own in a
    thread for the block."""
    box: list[InAThread] = []
    up = threading.Event()
    stop: list[asyncio.Event] = []

    async def main() -> None:
        done = asyncio.Event()
        stop.append(done)
        async with served(daemon() if daemon is not None else None, **options) as s:
            box.append(InAThread(s, asyncio.get_running_loop()))
            up.set()
            await done.wait()

    failed: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # reported by the test's thread, below
            failed.append(exc)
            up.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    up.wait(start_s)
    if failed:
        raise failed[0]
    assert box, f"the daemon did not start in {start_s} s"
    try:
        yield box[0]
    finally:
        box[0].loop.call_soon_threadsafe(stop[0].set)
        thread.join(start_s)


@contextlib.asynccontextmanager
async def serving_daemons(*daemons: Daemon, **options: Any) -> AsyncIterator[list[RefitClient]]:
    """:func:`served` (with ``options``) for each daemon on 127.0.0.1:0 for the block;
    yields one client per daemon.

    Each daemon trusts every other as a peer (as ``[peers] allow`` listing them
    would), so any of them may read from any other."""
    async with contextlib.AsyncExitStack() as stack:
        each = [await stack.enter_async_context(served(d, **options)) for d in daemons]
        trusting_each_other(*each)
        yield [s.client for s in each]


def trusting_each_other(*each: Served) -> None:
    """Each daemon served trusts every other as a peer (as ``[peers] allow`` listing
    them would), so any of them may read from any other."""
    for s in each:
        s.daemon.peers.replace("test", [o.url for o in each if o is not s])


@contextlib.asynccontextmanager
async def serving_app(app: web.Application, unix_path: str | None = None) -> AsyncIterator[str]:
    """Serve ``app``, a server that is not a daemon (a recording peer, a proxy, a
    miniature of one product part), on 127.0.0.1:0 (and the Unix socket
    ``unix_path`` if given) for the block; yields its base URL.

    A daemon's app (``create_app``'s) is refused: a daemon starts through
    :func:`served`, with the ordered shutdown and the set-up ``refitd serve`` gives it."""
    if DAEMON in app:
        raise TypeError("serving_app serves a test's own app, not a daemon's: use served()")
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        if unix_path is not None:
            await web.UnixSite(runner, unix_path).start()
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


class FakeClock:
    """A clock in seconds that moves only when the test sets or advances ``now``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class GatedCopier:
    """A real copy (the data plane's own engine, on the loop) that first waits for
    the test to open ``gate``; ``entered`` is set once a copy is waiting there. It is
    the daemon's same-host copy engine (:class:`transports.local.Copier`): every
    pull a daemon makes from itself or a peer on this host ends in it.

    This is the only way to hold a pull "mid-flight" deterministically: a real memory
    copy cannot be made to pause at a chosen point."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def copy(
        self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]
    ) -> None:
        self.entered.set()
        await self.gate.wait()
        await copy_addresses(dst, src, nbytes, threads=1, pool=None)
