"""The overlapped step loop (on by default with CUDA; forced on here, on the CPU): OneShot
steps launched while a step is in flight, the in-flight one post-processed afterwards."""

from __future__ import annotations

import torch

from prelude.params import PoolingParams, PoolingTask, SamplingParams
from tests.engine.tiny import hf_tiny_llama, tiny_engine


class _Recorder:
    """Wraps a runner's launch to record the order of launches vs waits."""

    def __init__(self, runner) -> None:  # noqa: ANN001
        self.events: list[str] = []
        self._launch = runner.launch
        runner.launch = self.launch

    def launch(self, batch, carried=None, on_heads=None):  # noqa: ANN001, ANN201
        step = self._launch(batch, carried, on_heads)
        n = len(self.events)
        self.events.append(f"launch{n}:{type(batch).__name__}" + (f":carried{len(carried.request_ids)}" if carried else ""))
        wait = step.wait

        def recorded_wait():  # noqa: ANN202
            self.events.append(f"wait{n}")
            return wait()

        step.wait = recorded_wait
        return step


def _workload(engine) -> dict[str, object]:  # noqa: ANN001
    gen = torch.Generator().manual_seed(3)
    for i in range(3):
        prompt = torch.randint(0, 250, (9 + i,), generator=gen).tolist()
        engine.add_request(f"d{i}", prompt, SamplingParams(max_tokens=6, temperature=0.8, seed=i, ignore_eos=True))
    for i in range(5):
        prompt = torch.randint(0, 250, (6 + i,), generator=gen).tolist()
        engine.add_request(f"o{i}", prompt, SamplingParams(max_tokens=0),
                           PoolingParams(PoolingTask.LABELS, label_token_ids=(1, 2, 3)))
        engine.add_request(f"g{i}", prompt, SamplingParams(max_tokens=1, temperature=0))
    got: dict[str, object] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.scores is not None:
                got[o.request_id] = o.scores
            else:
                got.setdefault(o.request_id, [])
                got[o.request_id] += list(o.new_token_ids)  # type: ignore[operator]
    engine.check_integrity()
    return got


def test_overlapped_loop_gives_the_same_answers_and_launches_before_it_waits() -> None:
    hf = hf_tiny_llama()
    plain = _workload(tiny_engine(hf, max_num_batched_tokens=16, overlap=False))
    engine = tiny_engine(hf, max_num_batched_tokens=16, overlap=True)
    rec = _Recorder(engine.runner)
    overlapped = _workload(engine)
    assert overlapped.keys() == plain.keys()
    for rid, value in plain.items():
        if rid.startswith("o"):
            torch.testing.assert_close(torch.tensor(overlapped[rid]), torch.tensor(value), atol=1e-5, rtol=0)
        else:
            assert overlapped[rid] == value, rid
    # Some step was launched while the previous one was still in flight (launch k+1 before wait k).
    order = rec.events
    launches = {int(e[6:].split(":")[0]): e for e in order if e.startswith("launch")}
    assert any(order.index(launches[k + 1]) < order.index(f"wait{k}")
               for k in launches if k + 1 in launches and f"wait{k}" in order)
    # Carried rows too: decode rows launched with their input tokens carried from the step in flight.
    assert any(":carried" in e for e in launches.values())
    assert engine.kv.pool.num_free_blocks + engine.kv.pool.num_evictable_blocks == engine.kv.pool.num_blocks


def test_abort_while_in_flight_releases_everything() -> None:
    engine = tiny_engine(hf_tiny_llama(), overlap=True)
    engine.add_request("a", list(range(10, 40)), SamplingParams(max_tokens=0),
                       PoolingParams(PoolingTask.LABELS, label_token_ids=(1, 2)))
    engine.add_request("b", list(range(50, 70)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()  # launches the OneShot step; it stays in flight
    assert engine._in_flight is not None
    assert engine.abort("a")
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["b"]
    engine.check_integrity()
    assert engine.kv.pool.num_free_blocks + engine.kv.pool.num_evictable_blocks == engine.kv.pool.num_blocks
