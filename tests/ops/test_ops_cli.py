"""The operator CLI against a real daemon app on loopback, run as a real subprocess."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support.daemons import served
from support.ops import ROOT, refitd

from refitd.cli import COMMANDS, _build_parser
from refitd.client.spawn import serve_command
from refitd.wire import ManifestIn, ShardEntry, TensorEntry

OPS = ("status", "regions", "sources", "pulls", "experts", "config")


@pytest.fixture
async def daemon() -> AsyncIterator[str]:
    """A daemon holding one region and one READY version of model ``m``."""
    async with served() as s:
        base, c = s.url, s.client
        region = await c.create_region(4096, label="weights", owner="trainer-0")
        shard = ShardEntry((0,), (1024,), region.region_id, 0)
        await c.publish(ManifestIn("m", 3, 0, 1, [TensorEntry("w", (1024,), "float32", [shard])]))
        yield base


def test_every_ops_subcommand_is_registered_with_examples_in_its_help() -> None:
    parser = _build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in OPS:
        assert name in COMMANDS
        help_text = sub.choices[name].format_help()  # type: ignore[attr-defined]
        assert "examples:" in help_text, name
        assert f"refitd {name}" in help_text, name


async def test_status_reports_a_ready_daemon_and_what_it_holds(daemon: str) -> None:
    code, out, _ = await refitd("status", "--url", daemon, "--json")
    assert code == 0
    info = json.loads(out)
    assert info["ready"] is True
    assert info["regions"] == 1 and info["region_bytes"] == 4096
    assert info["versions"] == {"ready": 1}
    code, out, _ = await refitd("status", "--url", daemon)
    assert code == 0
    assert "ready" in out and "4.0 KiB" in out


async def test_regions_lists_each_region_as_a_table_and_as_json(daemon: str) -> None:
    code, out, _ = await refitd("regions", "--url", daemon, "--json")
    assert code == 0
    (region,) = json.loads(out)
    assert region["nbytes"] == 4096 and region["label"] == "weights"
    code, out, _ = await refitd("regions", "--url", daemon)
    assert code == 0
    assert "weights" in out and "trainer-0" in out and "4096" in out


async def test_sources_lists_versions_with_state_and_parts(daemon: str) -> None:
    code, out, _ = await refitd("sources", "--url", daemon, "--json")
    assert code == 0
    (version,) = json.loads(out)
    assert (version["model"], version["version"], version["state"]) == ("m", 3, "ready")
    code, out, _ = await refitd("sources", "--url", daemon, "--model", "m")
    assert code == 0
    assert "ready" in out and "1/1" in out


async def test_pulls_and_experts_say_none_when_there_are_none(daemon: str) -> None:
    code, out, _ = await refitd("pulls", "--url", daemon)
    assert (code, out.strip()) == (0, "pulls: none")
    code, out, _ = await refitd("pulls", "--url", daemon, "--json")
    assert (code, json.loads(out)) == (0, [])
    code, out, _ = await refitd("experts", "--url", daemon)
    assert code == 0 and "hosts no expert pools" in out


async def test_following_an_unknown_pull_is_refused_naming_it(daemon: str) -> None:
    code, _, err = await refitd("pulls", "--url", daemon, "--follow", "p-nope")
    assert code == 1
    assert "NotFoundError" in err and "p-nope" in err


async def test_the_daemon_address_comes_from_the_environment_or_the_config(
    daemon: str, tmp_path: Path
) -> None:
    code, out, _ = await refitd("regions", "--json", env={"REFITD_URL": daemon})
    assert code == 0 and len(json.loads(out)) == 1
    port = daemon.rsplit(":", 1)[1]
    config = tmp_path / "refitd.toml"
    config.write_text(f"[server]\nport = {port}\n")
    code, out, _ = await refitd("regions", "--json", "--config", str(config))
    assert code == 0 and len(json.loads(out)) == 1


async def test_an_unreachable_daemon_exits_2_saying_so() -> None:
    code, _, err = await refitd("status", "--url", "http://127.0.0.1:9")
    assert code == 2
    assert "cannot reach the daemon" in err


async def test_config_check_accepts_the_shipped_file() -> None:
    code, out, err = await refitd("config", "check", "config/refitd.toml", "--no-env")
    assert code == 0, err
    assert out.startswith("config/refitd.toml: OK")


async def test_config_check_names_the_bad_key_and_exits_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nprot = 1\n")
    code, _, err = await refitd("config", "check", str(bad))
    assert code == 1
    assert "server.prot: unknown key" in err


async def test_config_check_applies_set_and_the_environment(tmp_path: Path) -> None:
    code, _, err = await refitd(
        "config", "check", "config/refitd.toml", "--set", "server.host=0.0.0.0"
    )
    assert code == 1 and "server.token_file is unset" in err
    code, out, _ = await refitd(
        "config", "check", "config/refitd.toml", "--json", env={"REFITD_SERVER_PORT": "7451"}
    )
    assert code == 0 and json.loads(out)["server"]["port"] == 7451


async def test_status_over_the_unix_socket_of_a_served_daemon(tmp_path: Path) -> None:
    import signal
    import stat

    sock = str(tmp_path / "refitd.sock")
    proc = await asyncio.create_subprocess_exec(
        *serve_command("--port", "0", "--unix", sock),
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    try:
        record = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
        assert record["unix"] == sock
        # Connecting is open to all; the uid check is what admits or refuses.
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o666
        code, out, err = await refitd("status", "--unix", sock, "--json")
        assert code == 0, err
        assert json.loads(out)["ready"] is True
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 60)
