"""`python -m benchmarks.lora` (a lab instrument at the repository root) still runs end to end
on a tiny random-weight Llama: every variant is timed and written to its JSON."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import lora
from prelude.testing.random_model import tiny_llama_dir


def test_the_lora_instrument_times_every_variant_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "lora"
    assert lora.main(["--model", str(tiny_llama_dir()), "--dtypes", "float32", "--trials", "2",
                      "--prefill-trials", "1", "--rows", "2", "--context", "32", "--prompt-tokens", "16",
                      "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [r["dtype"] for r in result] == ["float32"]
    for step in ("decode", "prefill"):
        assert set(result[0]["median_ms"][step]) == {"base", "lora", "plain"}
        assert all(ms > 0 for ms in result[0]["median_ms"][step].values())
