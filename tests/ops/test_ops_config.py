"""Configuration loading: defaults, the documented file, precedence, refusals."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import msgspec
import pytest

from refitd.config import Config, env_name, load_config, parse_overrides
from refitd.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "config" / "refitd.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "refitd.toml"
    path.write_text(text)
    return path


def test_the_shipped_file_loads_to_exactly_the_declared_defaults() -> None:
    assert load_config(SHIPPED, env={}) == Config()


def test_every_key_is_documented_in_the_shipped_file_with_its_default() -> None:
    text = SHIPPED.read_text()
    defaults = msgspec.to_builtins(Config())
    for section, table in defaults.items():
        assert f"[{section}]" in text, section
        body = text.split(f"[{section}]", 1)[1].split("\n[", 1)[0]
        for key, value in table.items():
            # Present, possibly commented out when the default is "unset".
            line = re.search(rf"^#? ?{key} = (.*)$", body, re.M)
            assert line is not None, f"{section}.{key} is not documented"
            if value is not None:
                shown = msgspec.toml.decode(f"v = {line.group(1)}".encode())["v"]
                if isinstance(value, (list, tuple)):
                    shown, value = list(shown), list(value)
                assert shown == value, f"{section}.{key}"


def test_no_file_and_no_environment_gives_loopback_defaults() -> None:
    config = load_config(env={})
    assert config.server.host == "127.0.0.1"
    assert config.server.port == 7450
    assert config.server.token_file is None


def test_the_environment_beats_the_file_and_the_command_line_beats_both(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nport = 1001\n[pulls]\nshutdown_grace_s = 2\n")
    env = {"REFITD_SERVER_PORT": "1002", "REFITD_PULLS_SHUTDOWN_GRACE_S": "3"}
    config = load_config(path, env=env, overrides={"server.port": "1003"})
    assert config.server.port == 1003
    assert config.pulls.shutdown_grace_s == 3.0
    assert load_config(path, env={}).server.port == 1001


def test_refitd_config_names_the_file_when_no_path_is_given(tmp_path: Path) -> None:
    path = write(tmp_path, "[logging]\nlevel = 'debug'\n")
    assert load_config(env={"REFITD_CONFIG": str(path)}).logging.level == "debug"


def test_text_overrides_are_converted_to_each_keys_type() -> None:
    env = {
        "REFITD_SERVER_ALLOWED_UIDS": "1000, 1001",
        "REFITD_LOGGING_JSON": "true",
        "REFITD_PULLS_SHUTDOWN_GRACE_S": "2.5",
        "REFITD_SERVER_UNIX_SOCKET": "",
    }
    config = load_config(env=env)
    assert config.server.allowed_uids == (1000, 1001)
    assert config.logging.json is True
    assert config.pulls.shutdown_grace_s == 2.5
    assert config.server.unix_socket is None


def test_an_unknown_key_in_the_file_is_refused_naming_the_key_and_the_known_ones(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"server\.prot: unknown key .*port"):
        load_config(write(tmp_path, "[server]\nprot = 7071\n"), env={})


def test_an_unknown_section_is_refused_naming_the_sections(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"servr: unknown key .*\[server\]"):
        load_config(write(tmp_path, "[servr]\nport = 7071\n"), env={})


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("[server]\nport = 'x'\n", r"server\.port: .*expected a TCP port, 0\.\.65535"),
        ("[server]\nport = 70000\n", r"server\.port: .*<= 65535"),
        ("[data_plane]\ntransport = 'UCX!'\n", r"data_plane\.transport: .*transport scheme"),
        ("[server]\nallowed_uids = [1, -2]\n", r"server\.allowed_uids: .*numeric user ids"),
        ("[pulls]\nshutdown_grace_s = -1\n", r"pulls\.shutdown_grace_s: .*>= 0"),
        ("server = 3\n", r"server: .*expected a table \[server\]"),
    ],
)
def test_an_invalid_value_is_refused_naming_the_key_and_the_expected_form(
    tmp_path: Path, text: str, pattern: str
) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(write(tmp_path, text), env={})


def test_an_invalid_environment_value_names_the_variable() -> None:
    with pytest.raises(
        ConfigError, match=r"server\.port = 'abc' \(from environment REFITD_SERVER_PORT\)"
    ):
        load_config(env={"REFITD_SERVER_PORT": "abc"})


def test_a_misspelt_environment_variable_for_a_section_is_refused() -> None:
    with pytest.raises(ConfigError, match="REFITD_SERVER_PROT names no configuration key"):
        load_config(env={"REFITD_SERVER_PROT": "1"})


def test_other_refitd_variables_are_not_configuration() -> None:
    assert load_config(env={"REFITD_SOMETHING_ELSE": "1"}) == Config()


def test_a_command_line_override_of_an_unknown_key_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"pulls\.grace: unknown key \(from command line\)"):
        load_config(env={}, overrides=parse_overrides(["pulls.grace=3"]))


def test_a_malformed_set_item_is_refused_with_the_expected_form() -> None:
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        parse_overrides(["port"])


def test_a_non_loopback_host_without_a_token_file_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"server\.token_file is unset"):
        load_config(env={}, overrides={"server.host": "0.0.0.0"})
    config = load_config(env={}, overrides={"server.host": "0.0.0.0", "server.token_file": "t"})
    assert config.server.host == "0.0.0.0"


def test_a_missing_or_malformed_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[server\n"), env={})


def test_every_key_has_an_environment_variable_name() -> None:
    names = {
        env_name(s.name, f.name)
        for s in msgspec.structs.fields(Config)
        for f in msgspec.structs.fields(typing.get_type_hints(Config)[s.name])
    }
    assert "REFITD_DATA_PLANE_TRANSPORT" in names
    assert len(names) == sum(
        len(msgspec.structs.fields(typing.get_type_hints(Config)[s.name]))
        for s in msgspec.structs.fields(Config)
    )
