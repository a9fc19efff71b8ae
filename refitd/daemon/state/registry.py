"""The daemon's pure state about sources: manifests, versions and leases.

No I/O and no awaiting here: the HTTP layer calls these methods and turns the
exceptions into status codes. Time comes from an injectable ``clock`` (seconds,
monotonic) so lease expiry is tested without sleeping.

Rules this class enforces:

- a version is READY when every part in ``range(expected_parts)`` has published;
  when a version becomes READY, older versions of the same model are RETIRED;
- a lease may be acquired only on a READY version (or, across hosts, on a PENDING
  one whose missing parts the cluster registry says other daemons hold); renewing or checking an expired
  or unknown lease is a :class:`ConflictError` (the reader's view is stale);
- publishing over a version that holds live leases is refused (:class:`ConflictError`):
  readers may be mid-pull, and a rewrite would tear what they read;
- the merged manifest of a READY version lists each distinct block of a tensor once,
  however many parts hold a replica of it.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import secrets
import time
from collections.abc import Callable

from refitd.daemon.state.manifestcheck import (
    DTYPE_SIZES,
    check_manifest_bounds,
    manifest_cost,
)
from refitd.daemon.state.versions import Clock, Lease, Version, VersionReads
from refitd.errors import ConflictError, NotFoundError, ProtocolError, QuotaExceeded
from refitd.wire import (
    LeaseInfo,
    ManifestIn,
    VersionInfo,
    VersionState,
)

__all__ = [
    "DTYPE_SIZES",
    "KEEP_RETIRED",
    "PENDING_TTL_S",
    "Lease",
    "Registry",
    "check_manifest_bounds",
]

PENDING_TTL_S = 3600.0
"""Default seconds a version may stay pending (``limits.pending_ttl_s``)."""

KEEP_RETIRED = 8
"""Records of retired, unleased versions kept per model (number, state, the parts it
published), the last let go: a reader, a drain or a trainer asking after a version
just replaced is told it was retired. Older ones are forgotten (404), so a daemon
publishing a version per step keeps a bounded number of records whatever its uptime.
A leased version's record stays while the lease does; a model's newest READY number
is kept apart (versions only move forward)."""

#: one line per version state change: pending (first part), ready, retired
log = logging.getLogger("refitd.sources")


class Registry(VersionReads):
    """Manifests, versions and leases for every model this daemon serves.

    ``node_id``/``incarnation`` are stamped into merged manifests so readers know which
    daemon (and which incarnation of it) holds the regions.

    ``complete_elsewhere(model, version)``: whether a version this daemon holds only
    some parts of has all its parts published across the cluster (the cluster
    registry's answer, given at construction by the daemon that has one); such a
    PENDING version is leased like a READY one, for the parts held here, and does
    not expire. None: never (one host). A question the registry asks at the moment
    it decides (a lease, an expiry), not an event: the cluster's directory holds the
    answer, and a copy pushed here could be stale when asked.
    """

    def __init__(
        self,
        node_id: str,
        incarnation: int,
        clock: Clock = time.monotonic,
        *,
        pending_ttl_s: float = PENDING_TTL_S,
        complete_elsewhere: Callable[[str, int], bool] | None = None,
    ) -> None:
        self.node_id = node_id
        self.incarnation = incarnation
        self._clock = clock
        self._versions: dict[tuple[str, int], Version] = {}
        self._leases: dict[str, Lease] = {}
        #: (expiry, lease id) of every lease, soonest first; an entry whose lease was
        #: renewed (a later expiry) or released is skipped when it surfaces
        self._expiries: list[tuple[float, str]] = []
        #: how long a version may stay pending, s (``limits.pending_ttl_s``)
        self.pending_ttl_s = pending_ttl_s
        #: (deadline, model, version) of pending versions, oldest first (one TTL for all)
        self._pending: collections.deque[tuple[float, str, int]] = collections.deque()
        #: principal -> bytes of the manifests its parts make the registry hold
        self._manifest_bytes: collections.Counter[str] = collections.Counter()
        #: per model, the highest version number that ever became READY
        self._newest_ready: dict[str, int] = {}
        #: per model, its retired versions whose manifests were let go, in that order:
        #: past :data:`KEEP_RETIRED`, the oldest records are forgotten
        self._let_go: dict[str, collections.deque[int]] = {}
        self._seq = itertools.count(1)
        self._elsewhere = complete_elsewhere

    def complete_elsewhere(self, model: str, version: int) -> bool:
        """Whether ``model`` ``version`` has all its parts published across the
        cluster (see the class; False on one host)."""
        return self._elsewhere is not None and self._elsewhere(model, version)

    # ------------------------------------------------------------ publishing

    def publish(
        self, m: ManifestIn, owner: str = "", max_manifest_bytes: int | None = None
    ) -> VersionInfo:
        """Record one part's manifest; returns the version's state after it.

        Versions are immutable once READY and only move forward. Refused with
        :class:`ConflictError` (nothing recorded) if the version is READY or retired,
        if its number is not above the model's newest version that became READY
        (:meth:`latest_ready` of a model never goes down), if the part was already
        published with other content, or if the part disagrees with parts already
        published on ``expected_parts`` or on a tensor's shape or dtype;
        :class:`ProtocolError` if ``part`` is out of range. Publishing a pending
        part again with identical content is a no-op.

        A part is charged to ``owner`` (:func:`manifest_cost`, bytes) while the
        registry holds its manifest, pending, READY, or retired while leased;
        :class:`QuotaExceeded` (nothing recorded) when that would take ``owner`` past
        ``max_manifest_bytes`` (None: no cap). The charge ends when the version
        expires, or is retired and no live lease holds it.
        """
        key = (m.model, m.version)
        self.expire_pending()
        if m.part >= m.expected_parts:
            raise ProtocolError(
                f"part {m.part} is outside range({m.expected_parts}) of expected parts"
            )
        v = self._versions.get(key)
        if v is not None and v.state is not VersionState.PENDING:
            raise ConflictError(
                f"publishing part {m.part} of {m.model!r} version {m.version} refused: the "
                f"version is {v.state.value}, and a version never changes once ready; "
                "publish a new version number"
            )
        newest = self._newest_ready.get(m.model)
        if v is None and newest is not None and m.version <= newest:
            raise ConflictError(
                f"publishing {m.model!r} version {m.version} refused: version {newest} "
                "already became ready, and a model's versions only move forward; publish "
                f"a version above {newest}"
            )
        cost = manifest_cost(m)
        if (
            max_manifest_bytes is not None
            and not (v is not None and m.part in v.parts)
            and self._manifest_bytes[owner] + cost > max_manifest_bytes
        ):
            self._drop_expired()  # a retired version's leases may have run out since
            held = self._manifest_bytes[owner]
            if held + cost > max_manifest_bytes:
                raise QuotaExceeded(
                    f"publishing part {m.part} of {m.model!r} version {m.version} refused: "
                    f"{owner or 'this principal'}'s manifests hold {held} bytes of the "
                    f"daemon's memory, and this one's {cost} would pass its cap "
                    f"(limits.max_manifest_bytes_per_principal = {max_manifest_bytes}); "
                    "retire versions nobody reads (drain with retire=1), or complete "
                    "pending ones or wait for them to expire (limits.pending_ttl_s)"
                )
        created = v is None
        if v is None:
            v = Version(m.model, m.version, m.expected_parts)
            self._versions[key] = v
            self._pending.append((self._clock() + self.pending_ttl_s, m.model, m.version))
        elif m.part in v.parts:
            if v.parts[m.part] == m:
                return self._info(v)
            raise ConflictError(
                f"part {m.part} of {m.model!r} version {m.version} is already published "
                "with other content; a part is published once"
            )
        elif v.expected_parts != m.expected_parts:
            raise ConflictError(
                f"{m.model!r} version {m.version}: part {m.part} expects {m.expected_parts} "
                f"parts, earlier parts said {v.expected_parts}"
            )
        self._check_agreement(v, m)
        v.parts[m.part] = m
        v.merged = v.merged_bytes = v.scope = v.region_ids = None
        v.charged[owner] = v.charged.get(owner, 0) + cost
        self._manifest_bytes[owner] += cost
        if len(v.parts) == v.expected_parts:
            v.state = VersionState.READY
            self._newest_ready[m.model] = m.version
            log.info("%r version %d: ready (%d parts)", m.model, m.version, v.expected_parts)
            for (model, version), other in list(self._versions.items()):
                if model == m.model and version < m.version:
                    if other.state is not VersionState.RETIRED:
                        log.info(
                            "%r version %d: retired (version %d is ready)",
                            model,
                            version,
                            m.version,
                        )
                    other.state = VersionState.RETIRED
                    other.merged = other.merged_bytes = None
                    self._forget_retired(other)
        elif created:
            log.info(
                "%r version %d: pending (part %d of %d published)",
                m.model,
                m.version,
                m.part,
                v.expected_parts,
            )
        return self._info(v)

    def expire_pending(self) -> list[tuple[str, int]]:
        """Forget every version still pending ``pending_ttl_s`` after its first part
        (its manifests' memory goes with it; a lease on it was never possible). A
        version whose other parts are held by other daemons of the cluster stays.
        Returns the ``(model, version)`` expired. O(1) amortised: one queue, oldest
        first."""
        now = self._clock()
        out: list[tuple[str, int]] = []
        while self._pending and self._pending[0][0] <= now:
            _, model, version = self._pending.popleft()
            v = self._versions.get((model, version))
            if v is None or v.state is not VersionState.PENDING:
                continue
            if self.complete_elsewhere(model, version):
                continue
            del self._versions[(model, version)]
            self._uncharge(v)
            log.info(
                "%r version %d: expired (pending %gs with parts %s of %d published)",
                model,
                version,
                self.pending_ttl_s,
                sorted(v.parts),
                v.expected_parts,
            )
            out.append((model, version))
        return out

    def next_pending_s(self) -> float | None:
        """Seconds from now until the oldest pending version's TTL runs out (0 when it
        has), or None when none is pending: when :meth:`expire_pending` has work."""
        if not self._pending:
            return None
        return max(0.0, self._pending[0][0] - self._clock())

    def _forget_retired(self, v: Version) -> None:
        """Let go of the manifests of ``v`` once it is retired and no live lease holds
        it: nothing can read it again (leases are taken on READY versions only), and
        a daemon publishing a version per step must not grow without bound. Its
        record stays (number, state, the parts it published) among the model's last
        :data:`KEEP_RETIRED` let go."""
        if v.state is not VersionState.RETIRED or not v.parts:
            return
        if self.active_leases(v.model, v.version):
            return
        v.published = tuple(sorted(v.parts))
        v.parts = {}
        v.merged = v.merged_bytes = v.scope = v.region_ids = None
        self._uncharge(v)
        let_go = self._let_go.setdefault(v.model, collections.deque())
        let_go.append(v.version)
        while len(let_go) > KEEP_RETIRED:
            old = self._versions.get((v.model, let_go.popleft()))
            if old is not None and old.state is VersionState.RETIRED and not old.parts:
                del self._versions[(old.model, old.version)]

    def held_shards(self) -> int:
        """Shards listed by every manifest the registry holds (what its memory scales
        with)."""
        return sum(
            len(t.shards)
            for v in self._versions.values()
            for m in v.parts.values()
            for t in m.tensors
        )

    def manifest_bytes(self, owner: str) -> int:
        """Bytes of manifests ``owner``'s parts make the registry hold now (after
        letting go of what expired versions and leases held)."""
        self.expire_pending()
        self._drop_expired()
        return self._manifest_bytes[owner]

    def _uncharge(self, v: Version) -> None:
        """``v``'s manifests are let go: its publishers' charges for them end."""
        for owner, n in v.charged.items():
            self._manifest_bytes[owner] -= n
            if self._manifest_bytes[owner] <= 0:
                del self._manifest_bytes[owner]
        v.charged = {}
        v.charged.clear()

    @staticmethod
    def _check_agreement(v: Version, m: ManifestIn) -> None:
        known: dict[str, tuple[tuple[int, ...], str]] = {}
        for part, other in v.parts.items():
            if part == m.part:
                continue
            for t in other.tensors:
                known.setdefault(t.name, (t.shape, t.dtype))
        for t in m.tensors:
            seen = known.get(t.name)
            if seen is not None and seen != (t.shape, t.dtype):
                raise ConflictError(
                    f"tensor {t.name!r}: part {m.part} publishes shape {t.shape} {t.dtype}, "
                    f"other parts published {seen[0]} {seen[1]}"
                )

    def retire(self, model: str, version: int) -> VersionInfo:
        """Stop serving a version before its publisher mutates the memory behind it.

        New leases (and so new reads) are refused from now on; leases already held
        stay valid until released or expired, which is what a drain waits for.
        Without this a reader could lease the version between the drain and the
        rewrite and read torn bytes.
        """
        v = self._get(model, version)
        if v.state is not VersionState.RETIRED:
            log.info("%r version %d: retired (by its publisher, to rewrite it)", model, version)
        v.state = VersionState.RETIRED
        v.merged = v.merged_bytes = None
        self._forget_retired(v)  # its charge ends with its manifests
        return self._info(v)

    # ------------------------------------------------------------ leases

    def active_leases(self, model: str, version: int) -> list[Lease]:
        now = self._clock()
        return [
            lease
            for lease in self._leases.values()
            if lease.model == model and lease.version == version and lease.expires_at > now
        ]

    def next_expiry(self, model: str, version: int) -> float | None:
        """Seconds from now until the next live lease on the version expires, or ``None``."""
        live = self.active_leases(model, version)
        if not live:
            return None
        return max(0.0, min(lease.expires_at for lease in live) - self._clock())

    def acquire(
        self, model: str, version: int, ttl_s: float, label: str = "", owner: str = ""
    ) -> LeaseInfo:
        """Lease a READY version for ``ttl_s`` seconds, for principal ``owner``."""
        self._require_ready(model, version)
        self._drop_expired()
        lease_id = f"l{next(self._seq)}-{secrets.token_hex(6)}"
        lease = Lease(lease_id, model, version, self._clock() + ttl_s, label, owner)
        self._leases[lease_id] = lease
        heapq.heappush(self._expiries, (lease.expires_at, lease_id))
        return LeaseInfo(lease_id, model, version, ttl_s)

    def renew(self, lease_id: str, ttl_s: float) -> LeaseInfo:
        """Extend a live lease to ``ttl_s`` from now; an expired one cannot be revived."""
        lease = self._live(lease_id)
        lease.expires_at = self._clock() + ttl_s
        heapq.heappush(self._expiries, (lease.expires_at, lease_id))
        self._drop_expired()  # also bounds the heap a long run of renewals grows
        return LeaseInfo(lease_id, lease.model, lease.version, ttl_s)

    def release(self, lease_id: str) -> None:
        """Drop a lease, live or expired. :class:`NotFoundError` (404) for an id this
        daemon never granted or no longer holds (released, or swept after expiry)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise NotFoundError(
                f"releasing lease {lease_id!r} refused: no such lease (never granted, already "
                "released, or expired and dropped)"
            )
        self._lease_ended(lease)

    def check(self, lease_id: str, model: str, version: int) -> Lease:
        """The live lease ``lease_id`` on exactly ``(model, version)``, else ConflictError."""
        lease = self._live(lease_id)
        if (lease.model, lease.version) != (model, version):
            raise ConflictError(
                f"lease {lease_id!r} is on {lease.model!r} version {lease.version}, not "
                f"{model!r} version {version}"
            )
        return lease

    def is_live(self, lease_id: str) -> bool:
        """Whether ``lease_id`` is held and unexpired (any model and version)."""
        lease = self._leases.get(lease_id)
        return lease is not None and lease.expires_at > self._clock()

    def _live(self, lease_id: str) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise ConflictError(f"lease {lease_id!r} is unknown or was released")
        if lease.expires_at <= self._clock():
            raise ConflictError(f"lease {lease_id!r} on {lease.model!r} v{lease.version} expired")
        return lease

    def _lease_ended(self, lease: Lease) -> None:
        v = self._versions.get((lease.model, lease.version))
        if v is not None:
            self._forget_retired(v)

    def _drop_expired(self) -> None:
        """Drop the leases expired by now, soonest first from the expiry heap: no scan
        of every lease (acquire stays O(log n) as leases accumulate). An entry left
        by a renew or a release is dropped when it surfaces; the heap is rebuilt when
        such entries outnumber the leases, so it stays O(leases)."""
        now = self._clock()
        heap = self._expiries
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_at <= now:
                del self._leases[lease_id]
                self._lease_ended(lease)
        if len(heap) > 2 * len(self._leases) + 64:
            self._expiries = [(x.expires_at, k) for k, x in self._leases.items()]
            heapq.heapify(self._expiries)
