"""Host memory page-locked for device copies: one table per process, each registration owned by its mapping.

A device driver registers host memory for the whole process (CUDA's
``cuMemHostRegister`` with the portable flag: every context sees it), so what is
registered is one table per process (:data:`PINS`), shared by every engine of every
device. A registration belongs to the mapping it was made for:

- it is made on a batch's first use of that host memory, while the bytes locked
  stay under the table's cap (:meth:`PinTable.limit`);
- each batch in flight that copies through it holds it (a reference count);
- it is dropped when its mapping goes (:func:`transports.memory.forget_host`, which
  `SharedSegment.close` calls before it unmaps, as a transport does when it
  deregisters the memory): at once, or when the last batch holding it ends.

Why so strict: a registration that outlives its mapping keeps the old pages locked,
and the driver goes on translating that address range to them. A copy to or from a
new mapping at the same address then moves the old pages' bytes, silently. So the
driver's "already registered" (CUDA's 712) for a range this table does not hold is
refused, never taken as success: that memory is copied through a bounce buffer
(`transports.devcopy`), and the driver is asked again at the next batch. An entry
whose mapping is gone (its owner collected without a close) is dropped and made
again. Memory the driver will not register (over the cap, a file shorter than its
mapping: the driver faults its pages in) is never handed to the driver either.

Pure bookkeeping plus two driver calls through a :class:`Registrar`; the calls that
take time (registering a multi-GB mapping) run outside the table's lock.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "ALREADY_REGISTERED",
    "PINS",
    "PinTable",
    "Registrar",
    "default_cap",
    "page_span",
]

ALREADY_REGISTERED = 712
"""The driver's answer when part of a range is registered already
(``CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED``)."""

_PAGE = os.sysconf("SC_PAGE_SIZE")


def page_span(nbytes: int) -> int:
    """Bytes of whole pages covering ``nbytes`` (a mapping is page-granular)."""
    return -(-nbytes // _PAGE) * _PAGE


def default_cap() -> int:
    """Bytes of host memory the table locks at most unless configured: a quarter of
    this host's physical memory (locked pages cannot be swapped or reclaimed)."""
    return os.sysconf("SC_PHYS_PAGES") * _PAGE // 4


class Registrar(Protocol):
    """A driver's two calls for host memory (return codes: 0 is success)."""

    def register(self, address: int, nbytes: int) -> int: ...
    def unregister(self, address: int) -> int: ...
    def describe(self, rc: int) -> str: ...


@dataclass
class _Pin:
    registrar: Registrar
    nbytes: int
    owner: weakref.ref[object] | None
    users: int = 0  # batches in flight copying through it
    doomed: bool = False  # its mapping is going: dropped when the last user ends


@dataclass
class _Counts:
    """What the table refused, by reason (the daemon's status and the tests read it)."""

    over_cap: int = 0
    foreign: int = 0  # the driver said "already registered" for a range not ours
    failed: int = 0  # the driver refused the registration
    stale: int = 0  # an entry whose mapping was gone without a close, dropped
    unregister_failed: int = 0


@dataclass
class _State:
    pins: dict[int, _Pin] = field(default_factory=dict)
    making: dict[int, int] = field(default_factory=dict)  # registrations under way
    refused: dict[int, str] = field(default_factory=dict)  # address -> why, until forgotten


class PinTable:
    """The host memory of this process registered with a device driver (see the
    module docstring). Thread-safe: engines call it from their copy threads, and
    mappings are closed from any thread."""

    def __init__(self, cap: int | None = None) -> None:
        self._cond = threading.Condition()
        self._s = _State()
        self._cap = default_cap() if cap is None else cap
        self.counts = _Counts()

    # -- the cap

    @property
    def cap(self) -> int:
        """Bytes this table locks at most (registrations already made stay)."""
        return self._cap

    def limit(self, nbytes: int | None) -> None:
        """Set the cap (None: :func:`default_cap`)."""
        with self._cond:
            self._cap = default_cap() if nbytes is None else nbytes

    @property
    def pinned_bytes(self) -> int:
        with self._cond:
            return sum(p.nbytes for p in self._s.pins.values())

    def pinned(self) -> dict[int, int]:
        """Registered now: base address -> bytes."""
        with self._cond:
            return {a: p.nbytes for a, p in self._s.pins.items()}

    def why_not(self, address: int) -> str | None:
        """Why the memory at ``address`` was refused registration (None: it was not)."""
        with self._cond:
            return self._s.refused.get(address)

    # -- batches

    def acquire(
        self, registrar: Registrar, address: int, nbytes: int, owner: object | None = None
    ) -> bool:
        """Hold the registration of the ``nbytes`` (whole pages) of host memory at
        ``address`` for one batch, registering it first where it is not yet. True:
        copies may hand this memory to the driver until :meth:`release`. False: they
        must not (over the cap, refused by the driver, or a range registered by
        something else); nothing is held. ``owner`` is the mapping the memory is:
        an entry made for another mapping at this address, since collected without
        a close, is dropped first."""
        stale: _Pin | None = None
        with self._cond:
            while address in self._s.making:
                self._cond.wait()
            pin = self._s.pins.get(address)
            if (
                pin is not None
                and pin.owner is not None
                and owner is not None
                and pin.owner() is not owner
            ):
                if pin.users == 0:  # its mapping went without a close: the entry lies
                    stale = self._s.pins.pop(address)
                    self.counts.stale += 1
                    pin = None
                else:
                    return False
            if pin is not None:
                if pin.doomed or pin.nbytes < nbytes:
                    return False
                pin.users += 1
                return True
            if address in self._s.refused:
                return False
            locked = sum(p.nbytes for p in self._s.pins.values()) + sum(self._s.making.values())
            if locked + nbytes > self._cap:
                self.counts.over_cap += 1
                return False
            self._s.making[address] = nbytes
        try:
            if stale is not None:
                stale.registrar.unregister(address)
            rc = registrar.register(address, nbytes)  # seconds for GBs: outside the lock
        except BaseException:
            with self._cond:
                del self._s.making[address]
                self._cond.notify_all()
            raise
        with self._cond:
            del self._s.making[address]
            self._cond.notify_all()
            if rc == 0:
                ref = _weak(owner)
                self._s.pins[address] = _Pin(registrar, nbytes, ref, users=1)
                return True
            if rc == ALREADY_REGISTERED:
                # Not ours (or one that outlived its mapping): never trust it; ask again
                # at the next batch, by when its holder may have let it go.
                self.counts.foreign += 1
            else:
                self.counts.failed += 1
                self._s.refused[address] = registrar.describe(rc)
            return False

    def release(self, address: int) -> None:
        """A batch that acquired the memory at ``address`` ended (its copies landed)."""
        drop: _Pin | None = None
        with self._cond:
            pin = self._s.pins.get(address)
            if pin is None:
                return
            pin.users -= 1
            if pin.users <= 0 and pin.doomed:
                drop = self._s.pins.pop(address)
        if drop is not None:
            self._unregister(drop, address)

    # -- mappings

    def forget(self, address: int) -> None:
        """The mapping at ``address`` goes: drop its registration (now, or when the
        last batch holding it ends) and any refusal remembered for it."""
        with self._cond:
            while address in self._s.making:
                self._cond.wait()
            self._s.refused.pop(address, None)
            pin = self._s.pins.get(address)
            if pin is None:
                return
            if pin.users > 0:
                pin.doomed = True
                return
            del self._s.pins[address]
        self._unregister(pin, address)

    def _unregister(self, pin: _Pin, address: int) -> None:
        if pin.registrar.unregister(address) != 0:
            with self._cond:
                self.counts.unregister_failed += 1


def _weak(owner: object | None) -> weakref.ref[object] | None:
    if owner is None:
        return None
    try:
        return weakref.ref(owner)
    except TypeError:  # an object without weak references: trust the forget calls
        return None


PINS = PinTable()
"""This process's table (what every engine and every mapping's close goes through)."""
