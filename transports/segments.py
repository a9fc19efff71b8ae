"""Shared-memory regions: POSIX segments under /dev/shm with owner-controlled lifetime.

A segment is created by its *owner* and attached by name from any process of the
same user. Names carry the owner's pid and process start time
(``refitd.<pid>.<start>.<label>``), so `cleanup_stale` can tell a segment whose
owner crashed from one whose owner is alive (a reused pid has another start time).

- Exact size: the segment is exactly ``size`` bytes (no page rounding visible).
- Permissions: created 0600; `attach` refuses a segment owned by another user or
  readable by group/others. A deployment whose daemon runs as its own user shares
  with one group instead (``$REFITD_SERVER_SHM_GROUP``, a name or gid; the daemon
  sets it from ``server.shm_group``): segments are then created 0660 with that
  group, and `attach` also takes a 0660 segment of that group from another user.
  Others never get access.
- Lifetime: only the owner unlinks; attachers just unmap. Closing while numpy or
  torch views are alive unlinks but leaves the mapping to the garbage collector, so
  a live view never points at unmapped memory.
- Huge pages: every mapping asks for transparent huge pages (``MADV_HUGEPAGE``).
  Whether it gets them is the host's choice: the tmpfs at /dev/shm must allow them
  (mount option ``huge=advise``, ``within_size`` or ``always``; most hosts mount it
  ``huge=never``, where the advice is a no-op). It matters for UCX's same-host path:
  ``process_vm_readv`` pins the source pages one by one: on this project's test
  machines ``refitd bench transport``'s ``cma`` row printed 10.4 GB/s from 4 KiB pages
  and 19.9 GB/s from 2 MiB pages, where memcpy ran at ~21. `huge_page_mode` reports the mount's setting; `huge_fraction` how much of
  a mapping huge pages back.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import mmap
import os
import secrets
import stat
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import numpy.typing as npt

from refitd.errors import ConflictError, NotFoundError, ProtocolError
from refitd.memory_kinds import MemoryKind

from .batch import within
from .memory import forget_host

if TYPE_CHECKING:
    import torch

__all__ = [
    "GROUP_ENV",
    "SHM_DIR",
    "SharedSegment",
    "cleanup_stale",
    "huge_fraction",
    "huge_page_mode",
    "owner_tag",
    "shared_group",
]

SHM_DIR = Path("/dev/shm")
#: madvise: fault every page of the range in for writing (Linux 5.14); a page the
#: filesystem cannot back is an error of the call, not a bus error later
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
PREFIX = "refitd."
#: The group segments are shared with, by name or gid; the same variable the daemon's
#: ``server.shm_group`` reads, and inherited by the processes it starts.
GROUP_ENV = "REFITD_SERVER_SHM_GROUP"


def _gid(group: int | str) -> int:
    if isinstance(group, int) or group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ProtocolError(f"shared-memory group {group!r} does not exist on this host") from None


def shared_group() -> int | None:
    """The gid segments are shared with (``$REFITD_SERVER_SHM_GROUP``), or None: 0600."""
    raw = os.environ.get(GROUP_ENV, "")
    return _gid(raw) if raw else None


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, or None if it is gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22; the command name (field 2) may hold spaces, so split after its ')'.
    return data.rsplit(")", 1)[1].split()[19]


def owner_tag(pid: int | None = None) -> str:
    """``<pid>.<start time>`` identifying a live process across pid reuse."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}.{_start_time(pid)}"


class SharedSegment:
    """A mapped shared-memory segment. Use `create` or `attach`, not the constructor."""

    def __init__(self, name: str, size: int, fd: int, owner: bool) -> None:
        self._name = name
        self._size = size
        self.owner = owner
        try:
            st = os.fstat(fd)
            #: ``(st_dev, st_ino)`` of the file mapped: the memory's identity, whatever
            #: name (or hard link) it was opened by
            self.file_identity: tuple[int, int] = (st.st_dev, st.st_ino)
            self.file_uid: int = st.st_uid  #: the uid that owns the file mapped
            #: bytes of the file backed by memory when it was mapped (``st_blocks``):
            #: less than ``size`` for a sparse file, whose holes a write would back
            self.backed_at_map: int = st.st_blocks * 512
            self._mmap: mmap.mmap | None = mmap.mmap(
                fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)
        # Huge pages where the host's tmpfs allows them (see the module docstring).
        # Advice, not a demand: a kernel or mount without them ignores it or refuses
        # it, and the mapping works the same either way.
        with contextlib.suppress(OSError, AttributeError):
            self._mmap.madvise(mmap.MADV_HUGEPAGE)
        self._base: npt.NDArray[np.uint8] | None = np.frombuffer(self._mmap, dtype=np.uint8)
        self._address = int(self._base.ctypes.data)

    # -- construction

    @classmethod
    def create(
        cls, size: int, label: str = "", *, name: str | None = None, reserve: bool = True
    ) -> SharedSegment:
        """Create a new segment of exactly ``size`` bytes (≥ 1), zero-filled, mode 0600,
        or 0660 owned by the `shared_group` when one is set.

        ``reserve`` (default) backs every byte now (see :meth:`_reserve`): a tmpfs file
        is otherwise sparse, admitted past what the filesystem has free, and the first
        write into a page it cannot back kills the writer with a bus error. A full
        filesystem then fails here, ``OSError`` with ``errno.ENOSPC``, before any
        byte moves, and nothing is left behind."""
        if size < 1:
            raise ProtocolError(f"shared segment refused: size {size} bytes; need at least 1")
        if name is None:
            safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in label)[:40]
            name = f"{PREFIX}{owner_tag()}.{safe or 'seg'}-{secrets.token_hex(4)}"
        _check_name(name)
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError as exc:
            raise ConflictError(
                f"shared segment {name!r} refused: a segment of that name exists"
            ) from exc
        try:
            gid = shared_group()
            if gid is not None:
                os.fchown(fd, -1, gid)  # the creator must be a member of the group
            # The umask may only narrow the mode, so it is set explicitly.
            os.fchmod(fd, 0o600 if gid is None else 0o660)
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(SHM_DIR / name)
            raise
        seg = cls(name, size, fd, owner=True)
        if reserve:
            try:
                seg._reserve()
            except BaseException:
                seg.close()
                raise
        return seg

    def _reserve(self) -> None:
        """Back every byte of this (new) segment now, through the mapping, so the
        huge-page advice applies to the pages made (``fallocate`` would make them
        small on a ``huge=advise`` mount). ``OSError(ENOSPC)`` when the filesystem
        cannot: populating reports it as an error, where a write would fault."""
        if self.populate():
            return
        fd = os.open(SHM_DIR / self._name, os.O_RDWR | os.O_NOFOLLOW)
        try:
            os.posix_fallocate(fd, 0, self._size)
        finally:
            os.close(fd)

    def backed_bytes(self) -> int | None:
        """Bytes of this segment's file backed by memory now (``st_blocks``), or None
        when its name no longer names the file mapped (unlinked or replaced)."""
        try:
            st = os.stat(SHM_DIR / self._name, follow_symlinks=False)
        except OSError:
            return None
        if (st.st_dev, st.st_ino) != self.file_identity:
            return None
        return int(st.st_blocks) * 512

    def populate(self) -> bool:
        """Map every page of the segment into this process now, for writing, backing
        any the file does not have yet: the first copy into it then takes no page
        fault (one a page otherwise, in the process that maps it, even when its
        creator wrote every page). ``OSError(ENOSPC)`` when the filesystem cannot back
        a page; False on a kernel before 5.14 (nothing done: pages fault in on first
        touch)."""
        assert self._mmap is not None
        try:
            self._mmap.madvise(MADV_POPULATE_WRITE)
        except OSError as exc:
            if exc.errno in (errno.EFAULT, errno.ENOMEM, errno.ENOSPC):
                raise OSError(
                    errno.ENOSPC, f"{SHM_DIR} cannot back the {self._size} bytes of {self._name}"
                ) from None
            if exc.errno != errno.EINVAL:  # EINVAL: a kernel before 5.14
                raise
            return False
        return True

    @classmethod
    def attach(cls, name: str, size: int | None = None) -> SharedSegment:
        """Map an existing segment by name; ``size`` (bytes), when given, must match."""
        _check_name(name)
        try:
            # O_NONBLOCK: a FIFO planted under the name must not hold the open.
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError as exc:
            raise NotFoundError(f"shared segment {name!r} not found") from exc
        except PermissionError:
            raise ProtocolError(
                f"attaching shared segment {name!r} refused: this user may not open it "
                f"(set {GROUP_ENV} / server.shm_group to a group both sides belong to)"
            ) from None
        except OSError as exc:  # a symlink (ELOOP), a directory, a socket (ENXIO), ...
            raise ProtocolError(
                f"attaching shared segment {name!r} refused: it is not a regular file "
                f"({os.strerror(exc.errno or 0)})"
            ) from None
        st = os.fstat(fd)
        why = None
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise ProtocolError(
                f"attaching shared segment {name!r} refused: it is not a regular file "
                f"({stat.filemode(st.st_mode)})"
            )
        gid = shared_group()
        group_ok = gid is not None and st.st_gid == gid  # our chosen group may be let in
        if st.st_uid != os.getuid() and not group_ok:
            why = f"it belongs to uid {st.st_uid}, not ours ({os.getuid()})"
        elif st.st_mode & (0o007 if group_ok else 0o077):
            why = f"its mode {stat.filemode(st.st_mode)} lets other users in"
        elif size is not None and st.st_size != size:
            why = f"it holds {st.st_size} bytes, expected {size}"
        elif st.st_size < 1:
            why = "it is empty"
        if why:
            os.close(fd)
            raise ProtocolError(f"attaching shared segment {name!r} refused: {why}")
        return cls(name, st.st_size, fd, owner=False)

    # -- properties (the memory kind's, `transports.memory`)

    #: host memory: copied by a transport's own guarded memcpy, no device engine
    kind = MemoryKind.HOST
    engine = None

    @property
    def identity(self) -> tuple[str | int, ...]:
        """``("host", st_dev, st_ino)``: the file mapped, whatever name opened it."""
        return (MemoryKind.HOST, *self.file_identity)

    @property
    def owner_uid(self) -> int | None:
        """The uid owning the file mapped: the kernel's proof of whose memory it is."""
        return self.file_uid

    @property
    def name(self) -> str:
        return self._name

    @property
    def size(self) -> int:
        """Exact size in bytes."""
        return self._size

    @property
    def address(self) -> int:
        """Base virtual address of the mapping in this process."""
        if self._base is None:
            raise ConflictError(f"shared segment {self._name!r} is closed")
        return self._address

    @property
    def closed(self) -> bool:
        return self._base is None

    # -- views

    def numpy(
        self, dtype: npt.DTypeLike = np.uint8, offset: int = 0, count: int = -1
    ) -> npt.NDArray[Any]:
        """A writable view of ``count`` elements (all that fit if -1) at byte ``offset``."""
        if self._base is None:
            raise ConflictError(f"shared segment {self._name!r} is closed")
        dt = np.dtype(dtype)
        if not within(offset, 0, self._size):
            raise ProtocolError(
                f"view of {self._name!r} refused: byte offset {offset} outside [0, {self._size}]"
            )
        if count < 0:
            count = (self._size - offset) // dt.itemsize
        if not within(offset, count * dt.itemsize, self._size):
            raise ProtocolError(
                f"view of {self._name!r} refused: {count} x {dt.itemsize} bytes at offset {offset} "
                f"end past its {self._size} bytes"
            )
        return self._base[offset : offset + count * dt.itemsize].view(dt)

    def torch(self, dtype: torch.dtype, offset: int = 0, count: int = -1) -> torch.Tensor:
        """A writable torch tensor of ``count`` elements at byte ``offset`` (shares memory)."""
        import torch

        itemsize = torch.empty((), dtype=dtype).element_size()
        arr = self.numpy(np.uint8, offset, count * itemsize if count >= 0 else -1)
        usable = len(arr) - len(arr) % itemsize
        return torch.frombuffer(memoryview(arr[:usable]), dtype=dtype)  # type: ignore[arg-type]

    # -- lifetime

    def close(self) -> None:
        """Unmap (and, for the owner, unlink). Idempotent."""
        if self._base is None:
            return
        self._base = None
        # Before the unmap: a driver registration that outlived it would leave the
        # pages locked and the range translated to them (transports.pins).
        forget_host(self._address)
        if self.owner:
            self.unlink()
        assert self._mmap is not None
        # Views still alive keep the mapping; it goes when the last one does.
        with contextlib.suppress(BufferError):
            self._mmap.close()
        self._mmap = None

    def unlink(self) -> None:
        """Remove the name (owner only); mappings stay valid until closed."""
        if not self.owner:
            raise ConflictError(f"unlinking {self._name!r} refused: only its owner may")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR / self._name)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._base is None else f"{self._size} bytes"
        return f"SharedSegment({self._name!r}, {state}, owner={self.owner})"


def huge_page_mode(mounts: str | None = None) -> str:
    """The ``huge=`` setting of the tmpfs holding segments (`SHM_DIR`): ``never``
    (the kernel's default), ``advise``, ``within_size``, ``always``, or ``unknown``
    when `SHM_DIR` is not a mount point of its own. ``mounts`` is the text of
    /proc/self/mounts (read when None)."""
    if mounts is None:
        try:
            mounts = Path("/proc/self/mounts").read_text()
        except OSError:
            return "unknown"
    mode = "unknown"
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[1] == str(SHM_DIR) and fields[2] == "tmpfs":
            opts = dict(o.partition("=")[::2] for o in fields[3].split(","))
            mode = opts.get("huge", "never")  # the last mount on a point wins
    return mode


def huge_fraction(pid: int, address: int, size: int) -> float:
    """Share of ``[address, address + size)`` in process ``pid`` that 2 MiB pages map
    (0.0 to 1.0), from /proc/<pid>/smaps: 0.0 where the host gives shared memory no
    huge pages or the pages are not touched yet. Raises `NotFoundError` when no
    mapping of that process starts at ``address``."""
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError as exc:
        raise NotFoundError(f"mappings of pid {pid} unreadable: {exc}") from None
    inside = False
    for line in text.splitlines():
        head = line.split(None, 1)[0]
        if "-" in head and not head.endswith(":"):
            start = int(head.split("-", 1)[0], 16)
            inside = start == address
        elif inside and head in ("ShmemPmdMapped:", "FilePmdMapped:"):
            kib = int(line.split()[1])
            if kib:
                return min(1.0, kib * 1024 / size)
        elif inside and head == "VmFlags:":
            return 0.0
    if inside:
        return 0.0
    raise NotFoundError(f"pid {pid} has no mapping starting at {address:#x}")


def _check_name(name: str) -> None:
    try:
        name.encode()
    except UnicodeEncodeError:
        raise ProtocolError(
            f"shared segment name {name!r} refused: not valid UTF-8 (a lone surrogate)"
        ) from None
    if not name or "/" in name or "\0" in name or name in (".", "..") or len(name) > 200:
        raise ProtocolError(f"shared segment name {name!r} refused: must be a plain file name")


def creator_tag(name: str, prefix: str = PREFIX) -> str | None:
    """The ``<pid>.<start>`` tag of the process that created segment ``name``."""
    parts = name[len(prefix) :].split(".") if name.startswith(prefix) else []
    if len(parts) < 3 or not parts[0].isdigit():
        return None
    return f"{parts[0]}.{parts[1]}"


def is_stale(name: str, prefix: str = PREFIX) -> bool:
    """Whether segment ``name`` is one of our user's whose creator process is gone: its
    name's ``<pid>.<start>`` no longer matches a live process (the pid is gone, or was
    reused by a process started later)."""
    if not name.startswith(prefix):
        return False
    parts = name[len(prefix) :].split(".")
    if len(parts) < 3 or not parts[0].isdigit():
        return False
    try:
        if (SHM_DIR / name).lstat().st_uid != os.getuid():
            return False
    except FileNotFoundError:
        return False
    return _start_time(int(parts[0])) != parts[1]


def stale_segments(prefix: str = PREFIX) -> list[str]:
    """Names of our user's segments whose creator process is gone (nothing unlinked)."""
    return sorted(p.name for p in SHM_DIR.glob(prefix + "*") if is_stale(p.name, prefix))


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Unlink our user's segments whose creator process is gone; return their names."""
    removed = []
    for name in stale_segments(prefix):
        try:
            (SHM_DIR / name).unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed
