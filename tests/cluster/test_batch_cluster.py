"""A batch job over two Ray replicas (prefix-affinity routing): one replica is killed
mid-job, and still every line is answered, once, with a 200."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ray = pytest.importorskip("ray")

from prelude.cluster.launch import ClusterConfig, start_client  # noqa: E402
from prelude.cluster.router import RouterConfig  # noqa: E402
from prelude.entrypoints.batch.job import JobOptions, run_job  # noqa: E402

from tests.batch.conftest import read_output, write_lines  # noqa: E402
from tests.cluster.tiny_replica import tiny_factory  # noqa: E402

pytestmark = pytest.mark.slow  # two replicas start, one is killed and restarted (~1 min)
LINES = 60


def _judge(cid: str, rubric: str, item: str) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": rubric + item, "max_tokens": 6, "temperature": 0, "ignore_eos": True}}


def test_killed_replica_loses_no_batch_line(ray_local: None, tmp_path: Path) -> None:
    client = start_client(tiny_factory(tmp_path), ClusterConfig(
        num_replicas=2, replica_threads=1, router=RouterConfig(policy="prefix", block_size=4)))
    try:
        rubrics = ["rubric one: grade it. " * 3, "rubric two: judge it. " * 3]
        inp = write_lines(tmp_path / "in.jsonl", [_judge(f"l{i}", rubrics[i % 2], f"item {i}") for i in range(LINES)])
        out = tmp_path / "out.jsonl"
        victim = client._replicas[0]

        async def job_and_kill() -> int:
            job = asyncio.create_task(run_job(client, inp, out, JobOptions(max_inflight=8)))
            while not out.exists() or out.read_bytes().count(b"\n") < 10:
                assert not job.done(), "the job ended before the kill"
                await asyncio.sleep(0.01)
            ray.kill(victim, no_restart=False)  # Ray restarts it
            summary = await job
            return summary.ran

        ran = asyncio.run(job_and_kill())
        lines = read_output(out)
        assert ran == LINES and len(lines) == LINES
        assert sorted(x["custom_id"] for x in lines) == sorted(f"l{i}" for i in range(LINES))
        assert all(x["response"]["status_code"] == 200 for x in lines), [
            x["response"]["body"] for x in lines if x["response"]["status_code"] != 200][:3]
        m = client.metrics()  # the kill hit lines in flight: moved by the client, or run again by the job
        assert m["cluster_retried_total"] + m["cluster_failed_mid_stream_total"] >= 1
    finally:
        client.shutdown()
