"""Who may talk to the daemon, and how much they may send.

Policy (``[server]`` in the config):

- **Loopback by default.** With no ``token_file`` the TCP listener must be on a
  loopback address; :func:`check_startup` refuses anything else, so the daemon
  never starts exposed. Every local client is then one principal, ``"loopback"``:
  they could read each other's shared memory anyway, so ownership is not enforced
  between them.
- **Bearer tokens.** With ``token_file`` every TCP request must carry
  ``Authorization: Bearer TOKEN``; the principal is the token's name. The file is
  refused if it is missing, empty, or readable by group or others.
- **Unix socket.** The peer's uid comes from the kernel (``SO_PEERCRED``); root, the
  daemon's own uid and ``allowed_uids`` are admitted, as principal ``uid:<n>``.
  A token, if sent, is not needed there: the kernel's word is stronger.
- **No listener gives more than another.** With a Unix socket and no ``token_file``,
  TCP serves only the public paths (health, the API document): otherwise any local
  uid, refused by the socket, would get in over TCP as ``loopback``, whose ownership
  is never enforced. With ``token_file``, TCP callers are their tokens' principals.
- **Ownership.** With an authenticated principal (token or uid) a region belongs to
  whoever created it; :func:`check_owner` refuses reading, writing or deleting
  another principal's region (403), and an object that belongs to nobody (owner
  ``""``). Root on the Unix socket may act on any. :meth:`Principal.seen_region`
  hides a region's segment name and process from everyone but its owner. Who sees what is
  one rule, :meth:`Principal.sees`: every check, listing and scrape asks it.
- **Size.** A request body over ``max_request_bytes`` is refused with 413 and a
  JSON body naming the limit, before the body is read.

Refusals are ``{"error": ..., "detail": ...}`` like every other error (made in
:mod:`refitd.daemon.app.refusals`), with ``error`` one of ``Unauthenticated`` (401),
``AccessDenied`` (403) or ``RequestTooLarge`` (413).

Integration: ``policy = check_startup(config.server)`` before binding, then
``setup_auth(app, policy)`` in the app factory; the part that creates a region records
the owner :meth:`Principal.owner_of` gives, and the parts that touch one refuse
another's with :meth:`Principal.check_owns` (handlers with only a request at hand:
``owner_for(request, body.owner)``, ``check_owner(request, owner, action, what)``).
"""

from __future__ import annotations

import hmac
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec
from aiohttp import web
from aiohttp.typedefs import Middleware

from refitd.config import ServerConfig, is_loopback_host, resolve_group
from refitd.daemon.app.refusals import forbidden, refused, too_large
from refitd.errors import AccessDenied, ConfigError
from refitd.wire import RegionInfo
from refitd.wire import routes as api

__all__ = [
    "POLICY_KEY",
    "PRINCIPAL_KEY",
    "AccessPolicy",
    "Principal",
    "TokenBook",
    "check_owner",
    "check_startup",
    "owner_for",
    "peer_uid",
    "principal_of",
    "setup_auth",
]

#: Paths served without credentials: liveness and the API description reveal nothing.
PUBLIC_PATHS = frozenset({api.HEALTH.path, api.OPENAPI.path})


@dataclass(frozen=True)
class Principal:
    """Who sent a request. ``name`` is what region ownership is recorded against."""

    name: str
    via: Literal["loopback", "token", "unix"]
    uid: int | None = None

    @property
    def authenticated(self) -> bool:
        """True when the identity was proven (token or kernel), not assumed."""
        return self.via != "loopback"

    @property
    def admin(self) -> bool:
        """Root on the Unix socket may act on any region."""
        return self.via == "unix" and self.uid == 0

    def sees(self, *owners: str) -> bool:
        """The one access rule: whether this principal sees (and may act on) an object
        that any of ``owners`` owns. Without authentication every client is the one
        principal ``loopback`` and sees everything; root on the Unix socket sees
        everything; an authenticated principal sees only what it owns. An object
        without an owner (``""``) belongs to nobody an authenticated principal could
        be."""
        return not self.authenticated or self.admin or self.name in owners

    def refusal(self, owner: str, action: str, what: str) -> str | None:
        """Why this principal may not ``action`` (a verb) ``what`` (an object named
        for the refusal) that ``owner`` owns, or None when it may (:meth:`sees`)."""
        if self.sees(owner):
            return None
        whose = f"it belongs to {owner}" if owner else "it belongs to no principal"
        return f"{self.name} may not {action} {what}: {whose}"

    def seen_region(self, info: RegionInfo) -> RegionInfo:
        """Region ``info`` as this principal may see it: a region's segment name and
        process are its owner's (and root's) to know (:meth:`sees`); anyone else gets
        the record without them (the name is what maps the memory, the process who
        keeps it)."""
        if self.sees(info.owner):
            return info
        return msgspec.structs.replace(info, handle="", process="")

    def owner_of(self, requested: str = "") -> str:
        """The owner to record for a region (or pool) this principal creates, asking
        for ``requested``: an authenticated principal owns what it creates, whatever
        it asks (root may name another); asking for someone else is refused
        (:class:`AccessDenied`, 403). An unauthenticated loopback client names itself."""
        if not self.authenticated:
            return requested
        if requested and not self.sees(requested):
            raise AccessDenied(f"{self.name} may not create a region owned by {requested!r}")
        return requested if requested and self.admin else self.name

    def check_owns(self, owner: str, action: str, what: str) -> None:
        """Refuse (:class:`AccessDenied`, 403) :meth:`refusal`'s cases."""
        why = self.refusal(owner, action, what)
        if why is not None:
            raise AccessDenied(why)


LOOPBACK = Principal("loopback", "loopback")


class TokenBook:
    """Bearer tokens by name, read once from ``token_file``.

    Format: one token per line, ``NAME TOKEN`` or just ``TOKEN`` (named
    ``token<line>``); blank lines and ``#`` comments are ignored.
    """

    def __init__(self, tokens: dict[str, str]) -> None:
        if not tokens:
            raise ConfigError("server.token_file holds no tokens; expected at least one line")
        self._tokens = dict(tokens)  # name -> token

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TokenBook:
        """Read and check the file; refuses missing, unreadable or over-shared files."""
        path = Path(path)
        try:
            st = path.stat()
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(
                f"server.token_file {path} cannot be read ({exc.strerror}); "
                "expected a readable file of bearer tokens"
            ) from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"server.token_file {path} has mode {stat.S_IMODE(st.st_mode):04o}; "
                "expected no access for group or others (chmod 600): anyone who can "
                "read it can act as any client"
            )
        tokens: dict[str, str] = {}
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) > 2:
                raise ConfigError(
                    f"server.token_file {path} line {number}: expected 'NAME TOKEN' or 'TOKEN'"
                )
            name, token = (parts[0], parts[1]) if len(parts) == 2 else (f"token{number}", parts[0])
            if name in tokens:
                raise ConfigError(f"server.token_file {path} line {number}: name {name!r} repeats")
            if name == LOOPBACK.name or name.startswith(("uid:", "refitd-")):
                raise ConfigError(
                    f"server.token_file {path} line {number}: name {name!r} is the name of "
                    "another kind of principal (the unauthenticated 'loopback', a Unix-"
                    "socket uid 'uid:<n>', or the daemon itself, 'refitd-*', which owns "
                    "its host mirrors), whose objects the token would own; rename it"
                )
            tokens[name] = token
        return cls(tokens)

    def lookup(self, presented: str) -> str | None:
        """The name of the token ``presented``, or None; constant time per token."""
        found = None
        for name, token in self._tokens.items():
            if hmac.compare_digest(presented.encode(), token.encode()):
                found = name
        return found


@dataclass(frozen=True)
class AccessPolicy:
    """The checks :func:`setup_auth` applies; build it with :func:`check_startup`."""

    tokens: TokenBook | None
    allowed_uids: frozenset[int]
    max_request_bytes: int
    #: a Unix socket is served (``server.unix_socket``): without tokens, TCP then
    #: serves only the public paths, never more than the socket's uid check admits
    unix_socket: bool = False

    def admits_uid(self, uid: int) -> bool:
        return uid in self.allowed_uids or uid in (0, os.getuid())


def check_startup(server: ServerConfig) -> AccessPolicy:
    """Refuse to start unsafely; otherwise return the policy to serve with.

    A non-loopback ``host`` needs ``token_file``, and the token file (when set)
    must be valid now, not at the first request.
    """
    if not is_loopback_host(server.host) and server.token_file is None:
        raise ConfigError(
            f"server.host {server.host!r} is not a loopback address and server.token_file "
            "is unset; refusing to start: set a bearer-token file or bind 127.0.0.1"
        )
    tokens = TokenBook.load(server.token_file) if server.token_file else None
    if server.shm_group is not None:
        resolve_group(server.shm_group)  # an unknown group stops the start, not a request
    return AccessPolicy(
        tokens=tokens,
        allowed_uids=frozenset(server.allowed_uids),
        max_request_bytes=server.max_request_bytes,
        unix_socket=server.unix_socket is not None,
    )


POLICY_KEY = web.AppKey("refitd_access_policy", AccessPolicy)
PRINCIPAL_KEY = web.RequestKey("refitd_principal", Principal)

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_uid(request: web.BaseRequest) -> int | None:
    """The peer's uid on a Unix socket (kernel-attested), None on TCP."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    _pid, uid, _gid = _PEERCRED.unpack(raw)
    return int(uid)


def _identify(request: web.Request, policy: AccessPolicy) -> Principal | web.Response:
    uid = peer_uid(request)
    if uid is not None:
        if not policy.admits_uid(uid):
            return refused(
                request,
                403,
                "AccessDenied",
                f"uid {uid} may not use this daemon's Unix socket; expected root, the "
                "daemon's own user or one of server.allowed_uids",
            )
        return Principal(f"uid:{uid}", "unix", uid)
    if policy.tokens is None and policy.unix_socket:
        return refused(
            request,
            403,
            "AccessDenied",
            f"{request.method} {request.path} over TCP refused: this daemon serves its API "
            "on its Unix socket (server.unix_socket), where the kernel names each caller's "
            "uid; without server.token_file a TCP caller would be the one unauthenticated "
            "principal 'loopback', whom no uid check binds. Use the socket, or set "
            "server.token_file so TCP callers prove who they are",
        )
    if policy.tokens is None:
        # check_startup guaranteed a loopback bind; the peer check guards a proxy.
        if request.remote is None or not is_loopback_host(request.remote):
            return refused(
                request, 403, "AccessDenied", f"peer {request.remote} is not on loopback"
            )
        return LOOPBACK
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    name = policy.tokens.lookup(presented.strip()) if scheme.lower() == "bearer" else None
    if name is None:
        return refused(
            request,
            401,
            "Unauthenticated",
            f"{request.method} {request.path} needs 'Authorization: Bearer TOKEN' with a "
            "token from the daemon's server.token_file",
            **{"WWW-Authenticate": 'Bearer realm="refitd"'},
        )
    return Principal(name, "token")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _middleware(policy: AccessPolicy) -> Middleware:
    @web.middleware
    async def access(request: web.Request, handler: Handler) -> web.StreamResponse:
        limit = policy.max_request_bytes
        if request.content_length is not None and request.content_length > limit:
            return too_large(request, limit, request.content_length)
        if request.path not in PUBLIC_PATHS:
            who = _identify(request, policy)
            if isinstance(who, web.Response):
                return who
            request[PRINCIPAL_KEY] = who
        # A chunked body has no Content-Length: the limit then applies as it is read.
        limited = request.clone(client_max_size=limit)
        if PRINCIPAL_KEY in request:
            limited[PRINCIPAL_KEY] = request[PRINCIPAL_KEY]
        try:
            return await handler(limited)
        except web.HTTPRequestEntityTooLarge:  # without the error middleware inside
            return too_large(request, limit)

    return access


def setup_auth(app: web.Application, policy: AccessPolicy) -> None:
    """Install the access middleware (after metrics, before the error middleware).

    It goes at the front of ``app.middlewares``, or right after the metrics
    middleware if :func:`refitd.daemon.app.metrics.setup_metrics` ran first, so refusals
    here are counted and never reach a handler.
    """
    app[POLICY_KEY] = policy
    from refitd.daemon.app.metrics import METRICS_KEY

    app.middlewares.insert(1 if METRICS_KEY in app else 0, _middleware(policy))


def principal_of(request: web.Request) -> Principal:
    """Who sent ``request`` (``loopback`` when auth is not installed or path is public)."""
    who: Principal = request.get(PRINCIPAL_KEY, LOOPBACK)
    return who


def owner_for(request: web.Request, requested: str = "") -> str:
    """The owner to record for a region ``request`` creates (:meth:`Principal.owner_of`)."""
    return principal_of(request).owner_of(requested)


def check_owner(request: web.Request, owner: str, action: str, what: str) -> None:
    """Refuse (403) when an authenticated principal acts on another's object.

    ``action`` is the verb ("read", "write", "delete"), ``what`` names the object
    (e.g. the region id); both go into the refusal. An object without an owner
    (``""``) belongs to nobody an authenticated principal could be: refused too.
    """
    why = principal_of(request).refusal(owner, action, what)
    if why is not None:
        raise forbidden(request, why)
