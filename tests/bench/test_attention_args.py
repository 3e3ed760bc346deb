"""`python -m benchmarks.attention --judge`: several shapes a run, and a clear usage error (not a
traceback) for a spec it cannot read."""

from __future__ import annotations

import pytest

from benchmarks import attention as attention_bench
from benchmarks.attention import judge_shape


def test_judge_shape_reads_rows_prefix_and_new() -> None:
    assert judge_shape("16x1024+64") == (16, 1024, 64)
    assert judge_shape("1x0+128") == (1, 0, 128)


@pytest.mark.parametrize("spec", ["16x1024", "1x0+128,4x0+512", "x1+2", "0x10+5", "2x10+0", "ax1+2", "2x-1+3"])
def test_judge_shape_refuses_what_it_cannot_read(spec: str) -> None:
    assert judge_shape(spec) is None


@pytest.mark.parametrize("argv,message", [
    (["--judge", "1x0+128x2", "--decode", ""], "expected ROWSxPREFIX+NEW"),
    (["--judge", "", "--decode", "4,x"], "must be positive integers"),
    (["--judge", "", "--decode", "0"], "must be positive integers"),
])
def test_a_bad_case_is_a_usage_error(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        attention_bench.main([*argv, "--rounds", "1"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
