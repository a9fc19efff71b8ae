"""Shared-memory segments: exact size, views, permissions, lifetime, crash cleanup."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

from refitd.errors import ConflictError, NotFoundError, ProtocolError
from transports.segments import SHM_DIR, SharedSegment, cleanup_stale


def test_a_created_segment_has_exactly_the_requested_size_and_is_zeroed() -> None:
    with SharedSegment.create(4097, "exact") as seg:
        assert seg.size == 4097
        assert os.stat(SHM_DIR / seg.name).st_size == 4097
        assert len(seg.numpy()) == 4097
        assert not seg.numpy().any()


def test_only_the_owning_user_may_open_a_segment() -> None:
    with SharedSegment.create(64) as seg:
        mode = stat.S_IMODE(os.stat(SHM_DIR / seg.name).st_mode)
        assert mode == 0o600


def test_an_attached_segment_sees_the_owners_writes_and_the_owner_sees_its_writes() -> None:
    with (
        SharedSegment.create(1 << 16, "share") as owner,
        SharedSegment.attach(owner.name, 1 << 16) as other,
    ):
        owner.numpy()[100:200] = 7
        assert (other.numpy()[100:200] == 7).all()
        other.numpy()[0] = 9
        assert owner.numpy()[0] == 9
        assert not other.owner


def test_numpy_and_torch_views_start_at_the_given_byte_offset() -> None:
    with SharedSegment.create(1024) as seg:
        f = seg.numpy(np.float32, offset=8, count=4)
        f[:] = [1.0, 2.0, 3.0, 4.0]
        t = seg.torch(torch.float32, offset=12, count=2)
        assert t.tolist() == [2.0, 3.0]
        t[1] = 5.0
        assert seg.numpy(np.float32, offset=8, count=4).tolist() == [1.0, 2.0, 5.0, 4.0]
        assert seg.numpy(np.uint8, offset=1024).size == 0


def test_a_view_past_the_end_of_the_segment_is_refused() -> None:
    with (
        SharedSegment.create(100) as seg,
        pytest.raises(ProtocolError, match="end past its 100 bytes"),
    ):
        seg.numpy(np.float64, offset=96, count=1)


def test_attaching_with_the_wrong_size_is_refused() -> None:
    with (
        SharedSegment.create(100) as seg,
        pytest.raises(ProtocolError, match="holds 100 bytes, expected 99"),
    ):
        SharedSegment.attach(seg.name, 99)


def test_attaching_a_segment_other_users_can_open_is_refused() -> None:
    with SharedSegment.create(100) as seg:
        os.chmod(SHM_DIR / seg.name, 0o644)
        with pytest.raises(ProtocolError, match="lets other users in"):
            SharedSegment.attach(seg.name)


def test_attaching_a_missing_segment_names_it() -> None:
    with pytest.raises(NotFoundError, match=r"refitd\.nope"):
        SharedSegment.attach("refitd.nope")


def test_a_name_with_a_path_in_it_is_refused() -> None:
    with pytest.raises(ProtocolError, match="plain file name"):
        SharedSegment.attach("../etc/passwd")


def test_closing_the_owner_removes_the_name_but_an_attacher_may_not() -> None:
    seg = SharedSegment.create(100)
    other = SharedSegment.attach(seg.name)
    with pytest.raises(ConflictError, match="only its owner"):
        other.unlink()
    other.close()
    assert (SHM_DIR / seg.name).exists()
    seg.close()
    assert not (SHM_DIR / seg.name).exists()
    seg.close()  # idempotent


def test_closing_while_a_view_is_alive_keeps_that_view_valid() -> None:
    seg = SharedSegment.create(4096)
    view = seg.numpy()
    view[:] = 3
    seg.close()
    assert seg.closed
    assert (view == 3).all()
    with pytest.raises(ConflictError, match="closed"):
        seg.numpy()


def test_cleanup_removes_segments_of_a_crashed_owner_and_keeps_live_ones() -> None:
    code = "from transports.segments import SharedSegment; s = SharedSegment.create(64, 'crash'); print(s.name, flush=True); import os; os._exit(0)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    crashed = out.stdout.strip()
    assert (SHM_DIR / crashed).exists(), "the crashed owner left no segment to clean"
    with SharedSegment.create(64, "alive") as mine:
        removed = cleanup_stale()
        assert crashed in removed
        assert not (SHM_DIR / crashed).exists()
        assert (SHM_DIR / mine.name).exists()


# -- huge pages ---------------------------------------------------------------------


def test_huge_page_mode_reads_the_huge_option_of_the_mount_holding_segments() -> None:
    from transports.segments import huge_page_mode

    line = "tmpfs {} tmpfs rw,nosuid,nodev{} 0 0"
    assert huge_page_mode(line.format(SHM_DIR, "")) == "never"  # the kernel's default
    assert huge_page_mode(line.format(SHM_DIR, ",huge=within_size")) == "within_size"
    remounted = "\n".join([line.format(SHM_DIR, ""), line.format(SHM_DIR, ",huge=advise")])
    assert huge_page_mode(remounted) == "advise"  # the last mount on the point wins
    assert huge_page_mode(line.format("/run/other", ",huge=always")) == "unknown"


def test_huge_fraction_names_a_mapping_that_does_not_exist() -> None:
    from transports.segments import huge_fraction

    with SharedSegment.create(1 << 16, "frac") as seg:
        got = huge_fraction(os.getpid(), seg.address, seg.size)
        assert 0.0 <= got <= 1.0
        with pytest.raises(NotFoundError, match="no mapping starting at"):
            huge_fraction(os.getpid(), seg.address + 4096, seg.size)


@pytest.fixture
def huge_tmpfs(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A private tmpfs mounted ``huge=advise`` as the segment directory (needs root and
    a kernel with shmem THP; skipped otherwise)."""
    where = tmp_path_factory.mktemp("hugeshm")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m,huge=advise", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a huge-page tmpfs here: {made.stderr.strip()}")
    monkeypatch.setattr("transports.segments.SHM_DIR", where)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_segments_on_a_tmpfs_allowing_huge_pages_are_backed_by_them(huge_tmpfs) -> None:  # type: ignore[no-untyped-def]
    """A mount with ``huge=advise`` gives huge pages only to mappings that ask: the
    segment asks, so every page of an aligned 8 MiB segment is a 2 MiB one, in the
    creator and in a process that attaches it."""
    from transports.segments import huge_fraction, huge_page_mode

    assert huge_page_mode() == "advise"
    with SharedSegment.create(8 << 20, "huge") as seg:
        seg.numpy()[:] = 1
        assert huge_fraction(os.getpid(), seg.address, seg.size) == 1.0
        with SharedSegment.attach(seg.name, seg.size) as other:
            assert (other.numpy()[:: 1 << 20] == 1).all()
            assert huge_fraction(os.getpid(), other.address, other.size) == 1.0


def test_a_segment_tail_shorter_than_a_huge_page_is_not_rounded_up_to_one(huge_tmpfs) -> None:  # type: ignore[no-untyped-def]
    """2 MiB + 4 KiB: the first 2 MiB in one huge page, the tail in 4 KiB pages (a huge
    page must fit inside the mapping), so the segment costs its size in memory, not
    two huge pages."""
    from transports.segments import huge_fraction

    huge_page = 2 << 20
    size = huge_page + 4096
    with SharedSegment.create(size, "tail") as seg:
        seg.numpy()[:] = 1
        assert huge_fraction(os.getpid(), seg.address, size) == huge_page / size
        assert os.stat(huge_tmpfs / seg.name).st_blocks * 512 == size
