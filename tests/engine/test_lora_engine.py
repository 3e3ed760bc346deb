"""LoRA adapters through the engine: each request's adapter reaches its rows in every
step kind, the prefix cache never shares K/V across adapters, slots are LRU and reload
from disk, and the offline LLM takes an adapter per request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prelude.config import LoraConfig
from prelude.engine.engine import LLMEngine
from prelude.engine.request import LoraRequest, PoolingParams, PoolingTask, SamplingParams
from prelude.entrypoints.llm import LLM
from tests.engine.tiny import hf_tiny_llama, tiny_engine

peft = pytest.importorskip("peft")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def save_adapter(path: Path, seed: int, r: int = 8) -> object:
    """A random all-projection adapter on hf_tiny_llama(); returns PEFT's merged model."""
    base = hf_tiny_llama()
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, init_lora_weights=False,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(str(path))
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[LoraRequest, object]]:
    root = tmp_path_factory.mktemp("adapters")
    return [(LoraRequest(f"a{i}", str(root / f"a{i}"), i + 1), save_adapter(root / f"a{i}", seed=20 + i))
            for i in range(3)]


def run(engine: LLMEngine, work: list[tuple[list[int], LoraRequest | None]],
        params: SamplingParams = GREEDY, pooling: PoolingParams | None = None) -> list[list[int] | tuple]:
    outs: dict[str, list[int]] = {}
    results: dict[str, object] = {}
    for i, (prompt, lora) in enumerate(work):
        engine.add_request(str(i), prompt, params, pooling, lora=lora)
        outs[str(i)] = []
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].extend(out.new_token_ids)
            if out.embedding is not None:
                results[out.request_id] = out.embedding
    engine.check_integrity()
    return [results.get(str(i), outs[str(i)]) for i in range(len(work))]  # type: ignore[misc]


PROMPTS = [list(b"hello there, adapter"), list(b"a shared system prompt. question one"), list(b"xyz"),
           list(b"a shared system prompt. question two")]


def test_mixed_steps_of_adapters_and_base_equal_each_alone(adapters) -> None:
    lora_engine = tiny_engine(hf_tiny_llama(), lora=LoraConfig(max_loras=3, max_lora_rank=8))
    work = [(PROMPTS[0], adapters[0][0]), (PROMPTS[1], None), (PROMPTS[2], adapters[1][0]),
            (PROMPTS[3], adapters[2][0])]
    together = run(lora_engine, work)  # prefill, mixed and decode steps with 3 adapters + base
    for (prompt, lora), got in zip(work, together):
        reference = hf_tiny_llama() if lora is None else next(m for a, m in adapters if a is lora)
        (want,) = run(tiny_engine(reference), [(prompt, None)])
        assert got == want, lora
    assert lora_engine.runner.adapters is not None and lora_engine.runner.adapters.num_loads == 3


def test_oneshot_rows_take_their_adapter(adapters) -> None:
    engine = tiny_engine(hf_tiny_llama(), lora=LoraConfig(max_loras=2, max_lora_rank=8))
    pooling = PoolingParams(task=PoolingTask.EMBED, pooling="last", normalize=False)
    got = run(engine, [(PROMPTS[0], adapters[0][0]), (PROMPTS[0], None)], pooling=pooling)
    want_adapter = run(tiny_engine(adapters[0][1]), [(PROMPTS[0], None)], pooling=pooling)
    want_base = run(tiny_engine(hf_tiny_llama()), [(PROMPTS[0], None)], pooling=pooling)
    close = lambda a, b: torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)  # noqa: E731 - merged vs delta
    assert close(got[0], want_adapter[0]) and close(got[1], want_base[0]) and not close(got[0], got[1])


def test_prefix_cache_is_not_shared_across_adapters(adapters) -> None:
    engine = tiny_engine(hf_tiny_llama(), lora=LoraConfig(max_loras=2, max_lora_rank=8))
    prompt = list(b"the same long prompt under two adapters, long enough for blocks")
    (base_out,) = run(engine, [(prompt, None)])
    reused = engine.kv.stats.reused_tokens
    (lora_out,) = run(engine, [(prompt, adapters[0][0])])
    assert engine.kv.stats.reused_tokens == reused  # nothing of the base's K/V reused
    (want,) = run(tiny_engine(adapters[0][1]), [(prompt, None)])
    assert lora_out == want and lora_out != base_out
    (again,) = run(engine, [(prompt, adapters[0][0])])  # ...but the same adapter does reuse its own
    assert engine.kv.stats.reused_tokens > reused and again == want


def test_slots_are_lru_and_reload_from_disk(adapters) -> None:
    engine = tiny_engine(hf_tiny_llama(), lora=LoraConfig(max_loras=1, max_lora_rank=8))
    slots = engine.runner.adapters
    assert slots is not None
    wants = [run(tiny_engine(m), [(PROMPTS[2], None)])[0] for _, m in adapters[:2]]
    # two adapters with one slot: they never share a step
    got = run(engine, [(PROMPTS[2], adapters[0][0]), (PROMPTS[2], adapters[1][0]), (PROMPTS[2], adapters[0][0])])
    assert got == [wants[0], wants[1], wants[0]]
    assert slots.num_loads == 2 and slots.resident() == [adapters[1][0].id]
    # the evicted adapter comes back from disk
    assert run(engine, [(PROMPTS[2], adapters[0][0])]) == [wants[0]]
    assert slots.num_loads == 3 and slots.resident() == [adapters[0][0].id]


def test_lora_slots_come_out_of_the_kv_budget() -> None:
    from prelude.config import CacheConfig, EngineConfig
    from prelude.engine.engine import LLMEngine as Engine

    plain = tiny_engine(hf_tiny_llama())
    with_lora = tiny_engine(hf_tiny_llama(), lora=LoraConfig(max_loras=4, max_lora_rank=16))
    budget = 4 * with_lora.runner.adapters.nbytes  # type: ignore[union-attr]
    gib = budget / 2**30
    config = EngineConfig(cache=CacheConfig(block_size=4, kv_cache_memory_gib=gib), lora=LoraConfig(4, 16))
    engine = Engine(with_lora.runner, with_lora.tokenizer, config, "tiny")
    per_block = plain.info.kv_bytes_per_block
    assert engine.kv.pool.num_blocks == (int(gib * 2**30) - budget // 4) // per_block


def test_offline_llm_takes_an_adapter_per_prompt(adapters) -> None:
    llm = LLM(engine=tiny_engine(hf_tiny_llama(), lora=LoraConfig(max_loras=2, max_lora_rank=8)))
    lora = llm.lora("a0", adapters[0][0].path)
    outs = llm.generate([PROMPTS[0], PROMPTS[0]], GREEDY, lora=[lora, None])
    (want,) = run(tiny_engine(adapters[0][1]), [(PROMPTS[0], None)])
    (base,) = run(tiny_engine(hf_tiny_llama()), [(PROMPTS[0], None)])
    assert outs[0].outputs[0].token_ids == want and outs[1].outputs[0].token_ids == base


def test_adapter_requests_on_an_engine_without_lora_are_refused(adapters) -> None:
    from prelude.engine.client import InvalidRequestError

    engine = tiny_engine(hf_tiny_llama())
    with pytest.raises(InvalidRequestError, match="without LoRA"):
        engine.add_request("x", PROMPTS[0], GREEDY, lora=adapters[0][0])


def test_graph_replay_takes_the_adapter_index_as_an_input(adapters) -> None:
    """Emulated capture (tests/executor/test_graphs.py): the decode buckets hold a static
    per-token adapter index; replayed steps mixing adapters and the base answer as eager ones."""
    from prelude.executor.graphs import Capture, GraphConfig

    work = [(PROMPTS[0], adapters[0][0]), (PROMPTS[1], None), (PROMPTS[2], adapters[1][0])]
    eager = run(tiny_engine(hf_tiny_llama(), lora=LoraConfig(max_loras=2, max_lora_rank=8)), work)
    engine = tiny_engine(hf_tiny_llama(), lora=LoraConfig(max_loras=2, max_lora_rank=8))
    if engine.runner.adapters is None or engine.runner.adapters.slots.kernel is None:
        pytest.skip("emulated adapter graphs run the C kernel, which needs a compiler and AVX2+FMA")
    engine.runner.capture_graphs(engine.max_model_len, Capture.EMULATE,
                                 GraphConfig(decode_batch_sizes=(2, 4), capture_prefill=False))
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.adapter_index
    replayed_with_adapters = 0
    replay = graphs.run

    def counting(ids, positions, meta, adapter_slots=None):  # noqa: ANN001, ANN202
        nonlocal replayed_with_adapters
        hidden = replay(ids, positions, meta, adapter_slots)
        replayed_with_adapters += hidden is not None and adapter_slots is not None
        return hidden

    graphs.run = counting
    assert run(engine, work) == eager
    assert replayed_with_adapters >= 4  # the decode steps (3 rows -> bucket 4) were replays
