"""Starting daemons in the tests, and two fakes.

A daemon's settings are a :class:`~refitd.config.Config`, as ``refitd serve`` loads
it: :func:`daemon_config` builds one from the defaults and a few keys
(``daemon_config(transport="shm", deltas=True)``), and ``Daemon(config, secret=...)``
runs it. One way to start a daemon in the test's own process: :func:`served` (one daemon,
with its app, URL and a client), :func:`serving_daemons` (several that trust each
other) and, for a synchronous test, :func:`served_in_a_thread`. Each serves a real
daemon on 127.0.0.1:0 through :func:`refitd.daemon.app.process.listening`, as
``refitd serve`` does, with its ordered shutdown; an in-process daemon starts in a
few milliseconds (docs/testing.md). A test that needs the process boundary (its
exit, its signals, a crash) starts ``refitd serve`` through
:func:`refitd.client.spawn.spawn_daemon`.

The fakes, a settable clock and a gated copier, implement the daemon's own
interfaces (the ``clock`` callable and :class:`transports.local.Copier`);
everything else is real: HTTP on 127.0.0.1:0, shared memory, the data plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
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
from refitd.daemon.app.node import Daemon
from refitd.daemon.app.process import listening
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
    setup: Iterable[Callable[[web.Application], None]] = (),
    token: str | None = None,
    **settings: Any,
) -> AsyncIterator[Served]:
    """Serve ``daemon`` (else a new one of ``daemon_config(**settings)``) in this
    process for the block, on 127.0.0.1 and the port its config says (0 from
    :func:`daemon_config`: any free one).

    ``access`` is the ``[server]`` access configuration (token file, Unix socket,
    allowed uids), checked and enforced as ``refitd serve`` does; ``setup`` are more
    ``create_app`` setup hooks (after the access one); ``token`` is the bearer token
    this daemon sends to its peers."""
    d = daemon if daemon is not None else Daemon(daemon_config(**settings))
    hooks = list(setup)
    if access is not None:
        policy = check_startup(access)
        hooks.insert(0, lambda app: setup_auth(app, policy))
    async with (
        listening(d, setup=hooks, token=token) as (app, url),
        RefitClient(url) as client,
    ):
        yield Served(d, app, url, client)


@contextlib.contextmanager
def served_in_a_thread(
    daemon: Callable[[], Daemon], *, access: ServerConfig | None = None, start_s: float = 30.0
) -> Iterator[str]:
    """:func:`served` for a synchronous test: the daemon ``daemon()`` makes, served by
    an event loop of its own in a thread for the block; yields its base URL."""
    url: list[str] = []
    up = threading.Event()
    stop: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    async def main() -> None:
        done = asyncio.Event()
        stop.append((asyncio.get_running_loop(), done))
        async with served(daemon(), access=access) as s:
            url.append(s.url)
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
    assert url, f"the daemon did not start in {start_s} s"
    try:
        yield url[0]
    finally:
        loop, done = stop[0]
        loop.call_soon_threadsafe(done.set)
        thread.join(start_s)


@contextlib.asynccontextmanager
async def serving_daemons(*daemons: Daemon) -> AsyncIterator[list[RefitClient]]:
    """Serve each daemon on 127.0.0.1:0 for the block; yields one client per daemon.

    Each daemon trusts every other as a peer (as ``[peers] allow`` listing them
    would), so any of them may read from any other."""
    async with contextlib.AsyncExitStack() as stack:
        each = [await stack.enter_async_context(served(d)) for d in daemons]
        for s in each:
            s.daemon.peers.replace("test", [o.url for o in each if o is not s])
        yield [s.client for s in each]


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
