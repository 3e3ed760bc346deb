"""`prelude bench <name> --help` shows that benchmark's own flags, not the dispatcher's."""

from __future__ import annotations

import pytest

from prelude.cli import main


def test_a_benchmarks_help_lists_its_own_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["bench", "profile", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "usage: prelude bench profile" in out and "--prompt-tokens" in out


def test_bench_help_lists_the_benchmarks_and_a_bare_bench_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--help"]) == 0
    assert "profile" in capsys.readouterr().out
    assert main(["bench"]) == 2
    with pytest.raises(SystemExit) as stop:
        main(["bench", "nosuch"])
    assert stop.value.code == 2
