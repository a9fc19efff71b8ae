"""One daemon process (``refitd serve``): run it until SIGTERM/SIGINT.

The daemon owns its event loop (``asyncio.Runner`` with uvloop) and its shutdown
order: stop accepting connections, let running pulls finish for up to
``[pulls] shutdown_grace_s`` seconds, then cancel the rest with a reason, close the data plane and
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
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from refitd.daemon.app.node import Daemon

__all__ = ["add_arguments", "listening", "read_secret", "run", "serve"]

SECRET_ENV = "REFITD_SECRET_FILE"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Flags default to None so that, unless given, the configuration decides
    # (defaults < --config FILE < REFITD_<SECTION>_<KEY> < --set < these flags).
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "examples:\n"
        "  refitd serve                                   # loopback, port 7450, auto\n"
        "  refitd serve --config /etc/refitd/refitd.toml  # as the systemd unit runs it\n"
        "  refitd serve --port 0 --set logging.json=true  # any free port, JSON logs\n"
        "  REFITD_SERVER_PORT=7451 refitd serve"
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="TOML configuration (default $REFITD_CONFIG, else built-in defaults)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one configuration key (repeatable)",
    )
    parser.add_argument("--host", default=None, help="TCP address (server.host; default loopback)")
    parser.add_argument(
        "--port", type=int, default=None, help="TCP port (server.port); 0 picks a free one"
    )
    parser.add_argument(
        "--unix", default=None, help="also listen on this Unix socket path (server.unix_socket)"
    )
    parser.add_argument(
        "--transport",
        default=None,
        help="data plane (data_plane.transport): 'auto' (default: same-host peers read "
        "through shared memory, others through UCX where both have RDMA, else tcp), 'shm' "
        "(same host only) or a transports scheme such as 'tcp' or 'ucx' (every other-host "
        "peer through it)",
    )
    parser.add_argument(
        "--secret-file",
        default=os.environ.get(SECRET_ENV),
        help=f"file holding the deployment's peer-record secret (server.secret_file, "
        f"or ${SECRET_ENV})",
    )
    parser.add_argument(
        "--node-id", default=None, help="name of this daemon (server.node_id; default host-pid)"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=None,
        help="seconds to drain pulls on shutdown (pulls.shutdown_grace_s)",
    )


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
async def listening(
    daemon: Daemon, **app_kwargs: Any
) -> AsyncIterator[tuple[web.Application, str]]:
    """Serve ``daemon``'s app in the current loop for the ``with`` block, where its
    ``[server]`` config says (``port`` 0: any free one, reported in the URL); yields
    ``(app, url)``.

    On exit: stop accepting, let running pulls finish for up to ``[pulls]
    shutdown_grace_s`` seconds, then clean up (cancelling what is left, closing the
    data plane).
    """
    from refitd.daemon.app.handlers import PULLS, create_app
    from refitd.daemon.pull.pulls import SHUTTING_DOWN

    server_config, grace_s = daemon.config.server, daemon.config.pulls.shutdown_grace_s
    app = create_app(daemon, **app_kwargs)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=grace_s)
    await runner.setup()  # runs cleanup_ctx startup: the data plane is up after this
    host, port = server_config.host, server_config.port
    sites: list[web.BaseSite] = [web.TCPSite(runner, host, port)]
    if server_config.unix_socket:
        sites.append(web.UnixSite(runner, server_config.unix_socket))
    try:
        for site in sites:
            await site.start()
        server = getattr(sites[0], "_server", None)
        if server is not None and server.sockets:
            port = server.sockets[0].getsockname()[1]
        url = f"http://{host}:{port}"
        from refitd.daemon.app.membership import MEMBERSHIP

        await app[MEMBERSHIP].register(url)  # peers learn of this daemon only once it answers
        yield app, url
        for site in sites:
            await site.stop()  # stop accepting; running pulls continue
        pending = [j.finished.wait() for j in app[PULLS].jobs.values() if not j.finished.is_set()]
        if pending:
            try:
                async with asyncio.timeout(grace_s):
                    await asyncio.gather(*pending)
            except TimeoutError:
                # Cancelled here, while the server still answers the requests in
                # flight, so a client waiting on a pull reads why it ended.
                await app[PULLS].cancel_all(SHUTTING_DOWN)
    finally:
        await runner.cleanup()


async def serve(
    daemon: Daemon,
    *,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[dict[str, Any]], None] | None = None,
    on_stopping: Callable[[], None] | None = None,
    app_kwargs: dict[str, Any] | None = None,
) -> None:
    """Serve until ``stop`` is set. ``on_ready`` receives the ready record once the
    listener and the data plane are both up (sd_notify READY=1 hooks in here);
    ``on_stopping`` runs when shutdown begins (STOPPING=1)."""
    from refitd.daemon.app.handlers import DAEMON

    async with listening(daemon, **(app_kwargs or {})) as (app, url):
        record = {
            "event": "ready",
            "url": url,
            "unix": daemon.config.server.unix_socket,
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


def run(args: argparse.Namespace) -> int:
    import uvloop

    from refitd.config import load_config, parse_overrides, read_token
    from refitd.daemon.access.auth import check_startup
    from refitd.daemon.app.node import Daemon
    from refitd.daemon.app.service import Service, configure_logging
    from refitd.errors import ConfigError

    flags = {
        "host": "server.host",
        "port": "server.port",
        "unix": "server.unix_socket",
        "transport": "data_plane.transport",
        "secret_file": "server.secret_file",
        "node_id": "server.node_id",
        "grace": "pulls.shutdown_grace_s",
    }
    try:
        overrides: dict[str, Any] = dict(parse_overrides(args.set))
        overrides.update(
            {key: getattr(args, f) for f, key in flags.items() if getattr(args, f) is not None}
        )
        config = load_config(args.config, os.environ, overrides)
        policy = check_startup(config.server)  # refuses an unsafe bind before binding
        secret = read_secret(config.server.secret_file)
        peer_token = (
            read_token(config.server.peer_token_file) if config.server.peer_token_file else None
        )
    except ConfigError as exc:
        sys.stderr.write(f"refitd serve: refusing to start: {exc}\n")
        return 2
    configure_logging(config.logging)
    service = Service(config, policy)

    def on_ready(record: dict[str, Any]) -> None:
        service.on_ready(record)  # first: the socket's mode is set before anyone is told
        _print_ready(record)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await serve(
                Daemon(config, secret=secret),
                stop=stop,
                on_ready=on_ready,
                on_stopping=service.on_stopping,
                app_kwargs={"setup": [service.setup], "token": peer_token},
            )
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    from refitd.daemon.app.service import log
    from refitd.errors import RefitError

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main())
    except RefitError as exc:
        # The cause (a data-plane child's own last words included) goes to the log and
        # to the exit message; the unit's journal shows both.
        what = "stopped on error" if service.ready_sent else "failed to start"
        log.error("%s: %s", what, exc)
        sys.stderr.write(f"refitd serve: {what}: {exc}\n")
        return 1
    log.info("stopped")
    return 0
