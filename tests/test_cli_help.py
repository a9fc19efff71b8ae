"""Every ``refitd`` subcommand and benchmark answers ``--help`` with examples."""

from __future__ import annotations

import pytest

from refitd.cli import BENCHES, COMMANDS, main


@pytest.mark.parametrize(
    "argv",
    [[name] for name in COMMANDS] + [["bench"]] + [["bench", name] for name in BENCHES],
    ids=lambda argv: " ".join(argv),
)
def test_every_subcommand_help_shows_examples(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "example" in out.lower(), f"refitd {' '.join(argv)} --help shows no example"
