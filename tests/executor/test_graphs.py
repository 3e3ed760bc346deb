"""Bucketed static-shape replay (CUDA graphs on a GPU), emulated on the CPU: the padding
of rows, tables and slots into a bucket's static buffers must not change any answer."""

from __future__ import annotations

import pytest
import torch

from prelude.executor.graphs import Capture, GraphConfig
from prelude.params import SamplingParams
from tests.engine.tiny import hf_tiny_llama, tiny_engine


def _generate(engine, prompts: list[list[int]], max_tokens: int = 7) -> dict[str, list[int]]:  # noqa: ANN001
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    engine.check_integrity()
    return out


def test_decode_replay_at_padded_buckets_equals_eager() -> None:
    hf = hf_tiny_llama()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (5, 11, 3)]
    eager = _generate(tiny_engine(hf), prompts)
    engine = tiny_engine(hf)
    engine.runner.capture_graphs(engine.max_model_len, Capture.EMULATE,
                                 GraphConfig(decode_batch_sizes=(2, 4), capture_prefill=False))
    replays = 0
    run = engine.runner.graphs.run

    def counting_run(*args):  # noqa: ANN002, ANN202
        nonlocal replays
        hidden = run(*args)
        replays += hidden is not None
        return hidden

    engine.runner.graphs.run = counting_run
    assert _generate(engine, prompts) == eager
    assert replays >= 5  # the decode steps (3 rows -> bucket 4, then fewer) were replayed
    # padding rows wrote only into the scratch block, which no request owns
    assert engine.runner._scratch_slot == engine.kv.pool.num_blocks * engine.runner.block_size


def test_decode_replay_of_one_row_masks_the_bucket_padding() -> None:
    """A bucket of one row: its static buffers span the model's whole length, so the row's
    context is shorter than the gathered keys and must still be masked (torch SDPA skips
    the mask only for an unpadded single row). Unmasked, the last block's empty slots and
    block 0 entered the softmax: wrong tokens on CUDA with --attention-backend torch."""
    hf = hf_tiny_llama()
    prompts = [torch.randint(0, 250, (9,), generator=torch.Generator().manual_seed(3)).tolist()]
    eager = _generate(tiny_engine(hf), prompts, max_tokens=10)
    engine = tiny_engine(hf)
    engine.runner.capture_graphs(engine.max_model_len, Capture.EMULATE,
                                 GraphConfig(decode_batch_sizes=(1, 2), capture_prefill=False))
    assert _generate(engine, prompts, max_tokens=10) == eager


def test_prefill_graphs_need_a_backend_that_reads_row_tensors() -> None:
    engine = tiny_engine(hf_tiny_llama())
    with pytest.raises(ValueError, match="PrefillTensors"):
        engine.runner.capture_graphs(engine.max_model_len, Capture.EMULATE, GraphConfig(capture_prefill=True))


def test_no_graphs_on_the_cpu_by_default() -> None:
    engine = tiny_engine(hf_tiny_llama())
    assert engine.runner.graphs is None


def test_packed_step_inputs_start_16_byte_aligned() -> None:
    """Triton specializes on pointer alignment: every device view of a step's packed inputs
    starts on a 16-byte boundary, as the graphs' static buffers do (else an eager step would
    compile another kernel variant mid-request)."""
    from prelude.executor.inputs import copy_int64
    from prelude.forward_batch import BatchRow, OneShotRow

    views = copy_int64(torch.device("cpu"), [1], [2, 3, 4], [], [5], [6, 7])
    assert [v.tolist() for v in views] == [[1], [2, 3, 4], [], [5], [6, 7]]
    assert all(v.data_ptr() % 16 == 0 for v in views)

    engine = tiny_engine(hf_tiny_llama(), attention_backend="torch")
    runner = engine.runner
    runner.allocate_kv_cache(8)
    bs = runner.block_size
    decode = BatchRow("d", [5], start_pos=bs + 1, block_table=[1, 2], sample=None, head=None)
    prefill = BatchRow("p", [1, 2, 3], start_pos=0, block_table=[3], sample=None, head=None)
    oneshot = OneShotRow("o", [4, 5, 6, 7, 8], None, None)
    inputs = runner.inputs.fused([decode, prefill], [oneshot])
    meta = inputs.meta
    assert meta.decodes is not None and meta.prefill_tensors is not None
    t = meta.prefill_tensors
    tensors = [inputs.input_ids, inputs.positions, meta.slot_mapping, meta.kept_tokens, meta.decodes.query_index,
               meta.decodes.block_tables, meta.decodes.context_lens, t.query_start, t.query_lens, t.context_lens,
               t.own_kv_in_cache, t.block_tables]
    assert all(x is not None and x.data_ptr() % 16 == 0 for x in tensors)
    assert t.query_lens.tolist() == [3, 5] and t.context_lens.tolist() == [3, 5]
    assert meta.decodes.context_lens.tolist() == [bs + 2]
