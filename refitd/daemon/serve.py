"""``refitd serve``: run one daemon until SIGTERM/SIGINT.

The daemon owns its event loop (``asyncio.Runner`` with uvloop) and its shutdown
order: stop accepting connections, let running pulls finish for up to
``grace_s`` seconds, then cancel the rest with a reason, close the data plane and
unlink the segments it owns.

Once listening and with the data plane up it prints one JSON line on stdout::

    {"event": "ready", "url": "http://127.0.0.1:PORT", "unix": null, "node_id": ..., "pid": ...}

so a parent that started it with ``--port 0`` learns the bound port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

from aiohttp import web

__all__ = ["add_arguments", "listening", "read_secret", "run", "serve"]

SECRET_ENV = "REFITD_SECRET_FILE"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="TCP address (default loopback)")
    parser.add_argument("--port", type=int, default=7450, help="TCP port; 0 picks a free one")
    parser.add_argument("--unix", default=None, help="also listen on this Unix socket path")
    parser.add_argument(
        "--transport",
        default="shm",
        help="data plane: 'shm' (same host, default) or a transports scheme such as 'ucx'",
    )
    parser.add_argument(
        "--secret-file",
        default=os.environ.get(SECRET_ENV),
        help=f"file holding the deployment's peer-record secret (or ${SECRET_ENV})",
    )
    parser.add_argument("--node-id", default="", help="name of this daemon (default host-pid)")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds to drain pulls")


def read_secret(path: str | None) -> bytes | None:
    """The secret in ``path`` (≥ 16 bytes after stripping whitespace), or None."""
    from refitd.errors import ConfigError

    if not path:
        return None
    data = Path(path).read_bytes().strip()
    if len(data) < 16:
        raise ConfigError(f"secret file {path}: {len(data)} bytes, need at least 16")
    return data


@contextlib.asynccontextmanager
async def listening(options: Any, **app_kwargs: Any) -> AsyncIterator[tuple[web.Application, str]]:
    """Run the app in the current loop for the ``with`` block; yields ``(app, url)``.

    On exit: stop accepting, let running pulls finish for up to ``options.grace_s``
    seconds, then clean up (cancelling what is left, closing the data plane).
    """
    from refitd.daemon.app import PULLS, create_app

    app = create_app(options, **app_kwargs)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=options.grace_s)
    await runner.setup()  # runs cleanup_ctx startup: the data plane is up after this
    sites: list[web.BaseSite] = [web.TCPSite(runner, options.host, options.port)]
    if options.unix_path:
        sites.append(web.UnixSite(runner, options.unix_path))
    try:
        for site in sites:
            await site.start()
        port = options.port
        server = getattr(sites[0], "_server", None)
        if server is not None and server.sockets:
            port = server.sockets[0].getsockname()[1]
        yield app, f"http://{options.host}:{port}"
        for site in sites:
            await site.stop()  # stop accepting; running pulls continue
        pending = [j.finished.wait() for j in app[PULLS].jobs.values() if not j.finished.is_set()]
        if pending:
            try:
                async with asyncio.timeout(options.grace_s):
                    await asyncio.gather(*pending)
            except TimeoutError:
                pass  # the rest are cancelled, with a reason, by the app's cleanup
    finally:
        await runner.cleanup()


async def serve(
    options: Any,
    *,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[dict[str, Any]], None] | None = None,
    on_stopping: Callable[[], None] | None = None,
    app_kwargs: dict[str, Any] | None = None,
) -> None:
    """Serve until ``stop`` is set. ``on_ready`` receives the ready record once the
    listener and the data plane are both up (sd_notify READY=1 hooks in here);
    ``on_stopping`` runs when shutdown begins (STOPPING=1)."""
    from refitd.daemon.app import DAEMON

    async with listening(options, **(app_kwargs or {})) as (app, url):
        record = {
            "event": "ready",
            "url": url,
            "unix": options.unix_path,
            "node_id": app[DAEMON].node_id,
            "pid": os.getpid(),
        }
        if on_ready is not None:
            on_ready(record)
        await (stop or asyncio.Event()).wait()
        if on_stopping is not None:
            on_stopping()


def _print_ready(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def run(args: argparse.Namespace, *, extra: Iterable[Any] = ()) -> int:
    import uvloop

    from refitd.daemon.node import DaemonOptions

    secret = read_secret(args.secret_file)
    kw: dict[str, Any] = {}
    if secret is not None:
        kw["secret"] = secret
    options = DaemonOptions(
        host=args.host,
        port=args.port,
        unix_path=args.unix,
        transport=args.transport,
        node_id=args.node_id,
        grace_s=args.grace,
        **kw,
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await serve(options, stop=stop, on_ready=_print_ready)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
    return 0
