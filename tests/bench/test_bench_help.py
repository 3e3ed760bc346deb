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


@pytest.mark.parametrize("lab", ["attention", "lora"])
def test_kernel_micro_benchmarks_are_not_user_commands(lab: str) -> None:
    """They moved to benchmarks/ at the repository's root (`python -m benchmarks.<name>`)."""
    with pytest.raises(SystemExit) as stop:
        main(["bench", lab])
    assert stop.value.code == 2


@pytest.mark.parametrize("lab", ["attention", "lora", "api_servers"])
def test_a_lab_instrument_runs_from_the_repository_root(lab: str) -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{lab}", "--help"], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"usage: python -m benchmarks.{lab}" in done.stdout
