"""What an operator reads: the daemon's log of version state changes and of its own
end, and the command tables when piped into an 80-column log or pager."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from support.daemons import FakeClock, served
from support.docs import python_blocks
from support.ops import refitd

from refitd.client.http import RefitClient
from refitd.client.spawn import serve_command
from refitd.daemon.state.registry import Registry
from refitd.wire import ManifestIn, ShardEntry, TensorEntry
from transports.segments import SharedSegment


def manifest(version: int, part: int, parts: int) -> ManifestIn:
    w = TensorEntry("w", (2, 3), "float32", [ShardEntry((0, 0), (2, 3), 1, 0)])
    return ManifestIn("toy", version, part, parts, [w])


def test_each_version_state_change_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    r = Registry("node", 1, FakeClock(100.0))
    with caplog.at_level(logging.INFO, logger="refitd.sources"):
        r.publish(manifest(1, 0, 2))
        r.publish(manifest(1, 0, 2))  # the same part again: no change, no line
        r.publish(manifest(1, 1, 2))
        r.publish(manifest(2, 0, 1))
        r.retire("toy", 2)
        r.retire("toy", 2)
    assert [rec.getMessage() for rec in caplog.records] == [
        "'toy' version 1: pending (part 0 of 2 published)",
        "'toy' version 1: ready (2 parts)",
        "'toy' version 2: ready (1 parts)",
        "'toy' version 1: retired (version 2 is ready)",
        "'toy' version 2: retired (by its publisher, to rewrite it)",
    ]


def test_a_daemon_stopped_with_sigterm_logs_stopped_as_its_last_line(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        serve_command("--port", "0", "--transport", "shm"),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline())["event"] == "ready"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = err.strip().splitlines()
    assert lines[-1].endswith("INFO refitd: stopped")
    assert any("INFO refitd: stopping: draining" in ln for ln in lines[:-1])


async def piped(*argv: str) -> str:
    """A command's stdout as a pager or log file gets it: piped, 80 columns."""
    code, out, err = await refitd(*argv, columns=80)
    assert code == 0, err
    return out


async def test_every_table_fits_80_columns_with_its_headers_and_values_whole() -> None:
    async with served() as s:
        base, c = s.url, s.client
        src = await c.create_region(1 << 16, label="trainer-rank-0-weights")
        seg = SharedSegment.attach(src.handle, src.nbytes)
        seg.numpy()[:] = np.arange(1 << 16) % 256
        seg.close()
        shard = ShardEntry((0,), (1 << 16,), src.region_id, 0)
        await c.publish(ManifestIn("m", 1, 0, 1, [TensorEntry("w", (1 << 16,), "uint8", [shard])]))
        await c.create_pool("moe-layer-pool", layers=2, experts=4, slots=4, row_bytes=[1024, 512])
        await c.ensure("moe-layer-pool", 0, [0, 1, 2])
        tables = {
            "experts": ["stale dropped", "regions host/slots", "prefetch used", "moe-layer-pool"],
            "regions": ["trainer-rank-0-weights", src.handle],
            "sources": ["m"],
            "pulls": [],
        }
        for command, whole in tables.items():
            out = await piped(command, "--url", base)
            lines = out.splitlines()
            assert max(map(len, lines)) <= 80, f"refitd {command}:\n{out}"
            for text in whole:  # not folded over two lines
                assert any(text in ln for ln in lines), f"refitd {command}: {text!r}\n{out}"


async def test_the_documented_expert_pool_example_runs_within_a_default_64_mib_dev_shm() -> None:
    (block,) = [
        b
        for b in python_blocks("## Expert pools in the daemon", "docs/experts.md")
        if "c.create_pool(" in b
    ]
    async with served() as s:
        base = s.url
        code = block.replace("http://127.0.0.1:7450", base)
        body = "\n".join("    " + ln for ln in code.splitlines())
        scope: dict[str, object] = {"RefitClient": RefitClient}
        exec(f"async def example():\n{body}\n    return pool, step", scope)
        pool, step = await scope["example"]()  # type: ignore[operator]
    regions = pool.layers * pool.experts * sum(pool.row_bytes) + pool.slots * sum(pool.row_bytes)
    assert regions <= 64 << 20
    assert len(step.slots) == 8
