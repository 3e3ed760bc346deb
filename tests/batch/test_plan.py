"""The planner: shared prefixes grouped, longest first within a group, lazily scanned."""

from __future__ import annotations

from pathlib import Path

from prelude.entrypoints.batch.lines import id_hash
from prelude.entrypoints.batch.plan import plan_job

from tests.batch.conftest import write_lines


def _chat(cid: str, system: str, user: str) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}}


def test_lines_sharing_a_rubric_run_together_longest_first(tmp_path: Path) -> None:
    rubric_a, rubric_b = "judge A " * 600, "judge B " * 600  # longer than every prefix cut
    lines = []
    for i in range(20):
        rubric, name = (rubric_a, "a") if i % 2 == 0 else (rubric_b, "b")
        lines.append(_chat(f"{name}{i}", rubric, "item " * (i + 1)))
    path = write_lines(tmp_path / "in.jsonl", lines)
    plan = plan_job(path)
    order = [lines[n - 1]["custom_id"] for n in plan.numbers.tolist()]
    groups = [cid[0] for cid in order]
    assert groups in (["a"] * 10 + ["b"] * 10, ["b"] * 10 + ["a"] * 10)  # one run of each rubric
    for name in "ab":
        items = [int(cid[1:]) for cid in order if cid[0] == name]
        assert items == sorted(items, reverse=True)  # longest item first
    assert plan.total_lines == 20 and plan.to_run == 20


def test_answered_ids_are_left_out_and_blank_lines_ignored(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "in.jsonl", [_chat("x", "s", "u"), "", _chat("y", "s", "v"), "{bad"])
    plan = plan_job(path, done={id_hash("x")}, done_without_id=1)
    assert plan.total_lines == 3 and plan.already_done == 2
    assert plan.numbers.tolist() == [3] and len(plan.malformed) == 0
