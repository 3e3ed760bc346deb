"""Gemma 3 against transformers (random weights, small configs): logits and greedy tokens
in float32 on the torch and C attention backends, bf16 within tolerance, prompts and cached
prefixes longer than the sliding window, the context not capped by the window, the text
model of a multimodal checkpoint, the classifier, and what is refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from prelude import LLM, SamplingParams
from prelude.config import ExecutorConfig
from prelude.executor.runner import ModelRunner
from prelude.forward_batch import BatchRow
from prelude.kv.kv_manager import KVCacheManager
from prelude.model.base import UnsupportedCheckpoint
from prelude.model.registry import config_for

from tests.engine.tiny import tiny_engine
from tests.model.test_decoder_numerics import _run as _logits  # the serving trunk's logits per row

transformers = pytest.importorskip("transformers")

WINDOW = 6
TEXT: dict[str, Any] = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                            max_position_embeddings=256, query_pre_attn_scalar=24,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                         "sliding_attention"],
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                             "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                                "factor": 4.0}})


def _perturb(model: Any) -> Any:
    with torch.no_grad():  # the init leaves (1 + w) norms at 1: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def hf_gemma(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.Gemma3TextConfig(**{**TEXT, **overrides})
    return _perturb(transformers.Gemma3ForCausalLM(cfg)).to(dtype).eval()


def _raw(hf: Any) -> dict[str, Any]:
    return {**hf.config.to_dict(), "architectures": [type(hf).__name__]}


def _runner(hf: Any, backend: str = "torch", dtype: str = "float32") -> tuple[ModelRunner, KVCacheManager]:
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    runner = ModelRunner.create(config_for(_raw(hf)), weights,
                                ExecutorConfig(device="cpu", dtype=dtype, attention_backend=backend), 4)
    runner.allocate_kv_cache(64)
    return runner, KVCacheManager(64, 4)


def _hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _hidden(runner: ModelRunner, row: BatchRow) -> torch.Tensor:
    """The final hidden states of one row's every position (what a classifier reads the last of)."""
    inputs = runner.inputs.paged((row,))
    return runner.model.forward(inputs.input_ids, inputs.positions, inputs.meta, runner.kv_caches)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_float32_prefill_and_decode_past_the_window_equal_transformers(backend: str, softcap: float | None) -> None:
    hf = hf_gemma(final_logit_softcapping=softcap)
    runner, kv = _runner(hf, backend)
    prompts = _prompts(1, (17, 3, 9, 25))  # longer and shorter than the window, batched
    rows = []
    for i, p in enumerate(prompts):
        assert kv.allocate(str(i), len(p))
        rows.append(BatchRow(str(i), p, 0, kv.block_table(str(i)), None))
    for p, got in zip(prompts, _logits(runner, rows)):
        assert (got - _hf_logits(hf, p)).abs().max().item() <= 1e-4
    seqs = [list(p) for p in prompts]
    for _ in range(5):  # decode, batched, every row past the window by the end
        rows = []
        for i, s in enumerate(seqs):
            s.append(int(_hf_logits(hf, s)[-1].argmax()))
            assert kv.allocate(str(i), len(s))
            rows.append(BatchRow(str(i), [s[-1]], len(s) - 1, kv.block_table(str(i)), None))
        for s, got in zip(seqs, _logits(runner, rows)):
            want = _hf_logits(hf, s)[-1]
            assert (got[-1] - want).abs().max().item() <= 1e-4
            assert int(got[-1].argmax()) == int(want.argmax())


def test_chunks_over_a_cached_part_longer_than_the_window_equal_transformers() -> None:
    hf = hf_gemma(seed=3)
    runner, kv = _runner(hf, "cpu")
    prompt = _prompts(2, (29,))[0]
    done = 0
    for chunk in (11, 9, 9):  # each chunk's keys: the window reaches back into the cached part
        assert kv.allocate("l", done + chunk)
        (got,) = _logits(runner, [BatchRow("l", prompt[done:done + chunk], done, kv.block_table("l"), None)])
        done += chunk
        assert (got - _hf_logits(hf, prompt[:done])[done - chunk:]).abs().max().item() <= 1e-4


def test_bf16_logits_within_tolerance_of_transformers() -> None:
    hf = hf_gemma(seed=4, dtype=torch.bfloat16)
    for backend in ("torch", "cpu"):
        runner, kv = _runner(hf, backend, "bfloat16")
        for n, p in enumerate(_prompts(5, (15, 4))):
            assert kv.allocate(str(n), len(p))
            (got,) = _logits(runner, [BatchRow(str(n), p, 0, kv.block_table(str(n)), None)])
            want = _hf_logits(hf, p)
            assert (got.float() - want).abs().max().item() <= 0.05 * want.abs().max().item()


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_engine_greedy_with_a_cached_prefix_longer_than_the_window(backend: str) -> None:
    hf = hf_gemma(seed=5)
    engine = tiny_engine(hf, attention_backend=backend, max_num_batched_tokens=16)
    assert engine.max_model_len > WINDOW * 4  # the window caps no request's context
    assert engine.kv.windows is not None  # the sliding layers keep their window in a pool of their own
    llm = LLM(engine=engine)
    shared = _prompts(6, (22,))[0]  # 5 full blocks of 4: over three windows
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    (first,) = llm.generate([shared + [7, 8]], params)
    assert first.outputs[0].token_ids == _hf_greedy(hf, shared + [7, 8], 10)
    reused = engine.metrics()["prefix_reused_tokens_total"]
    (second,) = llm.generate([shared + [9, 10, 11]], params)
    assert engine.metrics()["prefix_reused_tokens_total"] - reused >= 20  # the prefix hit, past the window
    assert second.outputs[0].token_ids == _hf_greedy(hf, shared + [9, 10, 11], 10)


def _window_runner(hf: Any, backend: str, dtype: str) -> tuple[ModelRunner, KVCacheManager]:
    """A runner whose sliding layers keep their K/V in a pool of their own (16 blocks beside
    64 for the global layers), and the manager of both."""
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    runner = ModelRunner.create(config_for(_raw(hf)), weights,
                                ExecutorConfig(device="cpu", dtype=dtype, attention_backend=backend), 4)
    runner.allocate_kv_cache(64, window_blocks=16)
    return runner, KVCacheManager(64, 4, window=WINDOW, num_window_blocks=16)


def _step_rows(kv: KVCacheManager, steps: list[tuple[str, list[int], int]]) -> list[BatchRow]:
    rows = []
    for rid, tokens, start in steps:
        assert kv.allocate(rid, start + len(tokens))
        table = kv.window_table(rid)
        assert table is not None
        rows.append(BatchRow(rid, tokens, start, kv.block_table(rid), None, window_table=tuple(table)))
    return rows


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_window_pool_of_their_own_gives_transformers_logits(backend: str, dtype: str) -> None:
    # Chunks of a prompt four windows long, then decodes, batched with a short prompt: the
    # sliding layers read their window from a pool whose entries behind it were released
    hf = hf_gemma(seed=8, dtype=torch.float32 if dtype == "float32" else torch.bfloat16)
    runner, kv = _window_runner(hf, backend, dtype)
    assert kv.windows is not None
    long, short = _prompts(9, (4 * WINDOW + 1, 5))
    tol = 1e-4 if dtype == "float32" else None

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        if tol is not None:
            assert (got - want).abs().max().item() <= tol
        else:
            assert (got.float() - want).abs().max().item() <= 0.05 * want.abs().max().item()

    done = 0
    for chunk in (7, 9, 9):  # each chunk's window reaches back into the cached part
        steps = [("l", long[done:done + chunk], done)] + ([("s", short, 0)] if done == 0 else [])
        got = _logits(runner, _step_rows(kv, steps))
        done += chunk
        close(got[0], _hf_logits(hf, long[:done])[done - chunk:])
        for rid, n in (("l", done), ("s", len(short))):
            kv.advance(rid, n)
        assert sum(b >= 0 for b in kv.window_table("l") or []) <= kv.windows.max_blocks_per_request
    seqs = {"l": long[:done], "s": list(short)}
    for _ in range(4):  # decodes past the window
        for s in seqs.values():
            s.append(int(_hf_logits(hf, s)[-1].argmax()))
        got = _logits(runner, _step_rows(kv, [(rid, [s[-1]], len(s) - 1) for rid, s in seqs.items()]))
        for (rid, s), g in zip(seqs.items(), got):
            close(g[-1], _hf_logits(hf, s)[-1])
            kv.advance(rid, len(s))
            assert sum(b >= 0 for b in kv.window_table(rid) or []) <= kv.windows.max_blocks_per_request
    kv.check_integrity()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_the_engine_holds_a_window_of_kv_on_sliding_layers_through_a_long_prompt(backend: str) -> None:
    # A prompt four windows long in chunks, then its decode: the sliding layers' pool holds at
    # most the window and a block of the request's K/V after every step; the global layers
    # keep the whole context; the text is transformers'; everything returns to the pools.
    hf = hf_gemma(seed=7)
    engine = tiny_engine(hf, attention_backend=backend, max_num_batched_tokens=8)
    windows = engine.kv.windows
    assert windows is not None and windows.max_blocks_per_request == WINDOW // 4 + 1 + (WINDOW % 4 > 1)
    prompt = _prompts(8, (4 * WINDOW + 1,))[0]
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    held, tokens = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
        engine.check_integrity()
        table = windows.table("long")
        if table:
            held.append(sum(b >= 0 for b in table))
            assert len(engine.kv.block_table("long")) == len(table)  # the global layers keep every block
    assert len(held) >= 4 * WINDOW // 8 + 12 - 1 and max(held) <= windows.max_blocks_per_request
    assert tokens == _hf_greedy(hf, prompt, 12)
    metrics = engine.metrics()
    assert metrics["kv_window_blocks_held"] == 0 and metrics["kv_window_blocks_total"] == windows.pool.num_blocks
    assert metrics["kv_window_blocks_free"] + metrics["kv_window_blocks_cached_evictable"] == windows.pool.num_blocks


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_oneshot_rows_hit_a_cached_prefix_longer_than_the_window(backend: str) -> None:
    # OneShot requests (one token with logprobs) over a shared prefix three windows long: the
    # first publishes its blocks with their window blocks beside; later ones, alone and two
    # in one step, read the prefix's last window from there. Logprobs are transformers'.
    hf = hf_gemma(seed=11)
    engine = tiny_engine(hf, attention_backend=backend, max_num_batched_tokens=64)
    assert engine.kv.windows is not None
    shared = _prompts(12, (3 * WINDOW + 5,))[0]
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3)
    waves = [[shared + [1, 2]], [shared + [3]], [shared + [4, 5, 6], shared + [7, 8]]]
    reused = engine.metrics()["prefix_reused_tokens_total"]
    for w, wave in enumerate(waves):
        outs = {}
        for i, p in enumerate(wave):
            engine.add_request(f"{w}.{i}", p, one)
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] = out
            engine.check_integrity()
        for i, p in enumerate(wave):
            out = outs[f"{w}.{i}"]
            want = torch.log_softmax(_hf_logits(hf, p)[-1], -1)
            assert out.new_token_ids == (int(want.argmax()),)
            assert abs(out.logprobs[0].logprob - want.max().item()) <= 1e-4
            for tok, lp in out.logprobs[0].top:
                assert abs(lp - want[tok].item()) <= 1e-4
            if w:
                assert out.num_cached_tokens >= 3 * WINDOW  # the hit reaches past the window
    assert engine.metrics()["prefix_reused_tokens_total"] - reused >= 3 * 3 * WINDOW
    assert engine.metrics()["kv_window_blocks_held"] == 0


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_replayed_decode_buckets_read_the_window_pool_as_eager_steps_do(backend: str) -> None:
    # Decode steps replayed from static buckets (CUDA graphs, emulated here): the window pool's
    # tables and slots are static inputs beside the global ones; padding rows write to its
    # scratch block. The tokens equal the eager engine's and transformers'.
    from prelude.executor.graphs import Capture, GraphConfig

    hf = hf_gemma(seed=13)
    prompts = _prompts(14, (4 * WINDOW + 1, 5, 11))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def generate(capture: bool) -> tuple[dict[str, list[int]], int]:
        engine = tiny_engine(hf, attention_backend=backend)
        replays = 0
        if capture:
            engine.runner.capture_graphs(engine.max_model_len, Capture.EMULATE,
                                         GraphConfig(decode_batch_sizes=(1, 2, 4), capture_prefill=False))
            graphs = engine.runner.graphs
            assert graphs is not None
            run = graphs.run

            def counting(*args: Any) -> Any:
                nonlocal replays
                hidden = run(*args)
                replays += hidden is not None
                return hidden

            graphs.run = counting  # type: ignore[method-assign]
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        out: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            engine.check_integrity()
        return out, replays

    eager, _ = generate(False)
    replayed, replays = generate(True)
    assert replayed == eager and replays >= 5
    assert eager["0"] == _hf_greedy(hf, prompts[0], 8)


def test_a_hand_off_request_is_refused_with_a_window_pool() -> None:
    # The KV hand-off carries the global pool's blocks only: refused by name (a 400), and the
    # engine serves on
    from dataclasses import replace

    from prelude.engine.client import InvalidRequestError

    engine = tiny_engine(hf_gemma(seed=2))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="sliding-window layers' pool"):
        engine.enqueue(replace(engine.prepare("h", [5, 6, 7], params), hand_off=True))
    assert not engine.has_unfinished()
    engine.add_request("after", [5, 6, 7], params)
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()


def test_the_text_model_of_a_multimodal_checkpoint_is_served_without_its_vision_tower(tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(7)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = transformers.Gemma3Config(text_config=TEXT, vision_config=vision, mm_tokens_per_image=4)
    hf = _perturb(transformers.Gemma3ForConditionalGeneration(cfg)).float().eval()
    raw = _raw(hf)
    assert "text_config" in raw
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    assert any("vision_tower" in k for k in weights)
    runner = ModelRunner.create(config_for(raw), weights, ExecutorConfig(device="cpu", dtype="float32"), 4)
    runner.allocate_kv_cache(16)
    kv = KVCacheManager(16, 4)
    p = _prompts(8, (12,))[0]
    assert kv.allocate("a", len(p))
    (got,) = _logits(runner, [BatchRow("a", p, 0, kv.block_table("a"), None)])
    assert (got - _hf_logits(hf, p)).abs().max().item() <= 1e-4
    # the saved checkpoint names its tensors language_model.model.*: the same model
    from safetensors.torch import load_file

    hf.save_pretrained(str(tmp_path))
    saved = ModelRunner.create(config_for(raw), load_file(str(tmp_path / "model.safetensors")),
                               ExecutorConfig(device="cpu", dtype="float32"), 4)
    saved.allocate_kv_cache(16)
    (again,) = _logits(saved, [BatchRow("b", p, 0, kv.block_table("a"), None)])
    assert torch.equal(again, got)


def test_the_classifier_scores_equal_transformers() -> None:
    torch.manual_seed(9)
    cfg = transformers.Gemma3TextConfig(**TEXT, num_labels=3)
    hf = _perturb(transformers.Gemma3TextForSequenceClassification(cfg)).float().eval()
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    runner = ModelRunner.create(config_for(_raw(hf)), weights, ExecutorConfig(device="cpu", dtype="float32"), 4)
    runner.allocate_kv_cache(16)
    kv = KVCacheManager(16, 4)
    p = _prompts(10, (13,))[0]
    assert kv.allocate("a", len(p))
    hidden = _hidden(runner, BatchRow("a", p, 0, kv.block_table("a"), None))
    with torch.no_grad():
        want = hf(torch.tensor([p])).logits[0]
    assert (runner.model.classify(hidden) - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize(("overrides", "field"), [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
])
def test_what_the_forward_does_not_compute_is_refused_by_name(overrides: dict[str, Any], field: str) -> None:
    raw = {**transformers.Gemma3TextConfig(**TEXT).to_dict(), "architectures": ["Gemma3ForCausalLM"], **overrides}
    with pytest.raises(UnsupportedCheckpoint, match=field):
        config_for(raw)


def test_layer_kinds_follow_the_older_sliding_window_pattern() -> None:
    text = {k: v for k, v in TEXT.items() if k != "layer_types"}
    raw = {**transformers.Gemma3TextConfig(**{**text, "num_hidden_layers": 7}).to_dict(),
           "architectures": ["Gemma3ForCausalLM"], "sliding_window_pattern": 3}
    del raw["layer_types"]
    assert config_for(raw).layer_kinds == ("sliding", "sliding", "full", "sliding", "sliding", "full", "sliding")


def test_a_lora_adapter_on_every_projection_equals_peft_merged(tmp_path) -> None:  # noqa: ANN001
    from prelude.model.lora.adapters import LoraBatch, LoraSlots, LoraStep, read_adapter

    peft = pytest.importorskip("peft")
    torch.manual_seed(11)
    model = peft.get_peft_model(hf_gemma(seed=11), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.save_pretrained(str(tmp_path / "a"))
    merged = model.merge_and_unload().eval()
    runner, kv = _runner(hf_gemma(seed=11), "cpu")
    config = runner.model.config
    slots = LoraSlots(config, num_slots=2, max_rank=8, dtype=torch.float32, device="cpu")
    slots.load(1, read_adapter("a", tmp_path / "a", config, max_rank=8))
    p = _prompts(12, (14,))[0]
    assert kv.allocate("a", len(p))
    inputs = runner.inputs.paged((BatchRow("a", p, 0, kv.block_table("a"), None),))
    step = LoraStep(slots, LoraBatch.build([1], [len(p)], "cpu", 0))
    hidden = runner.model.forward(inputs.input_ids, inputs.positions, inputs.meta, runner.kv_caches, lora=step)
    got = runner.model.compute_logits(hidden)
    assert (got - _hf_logits(merged, p)).abs().max().item() <= 1e-4
    assert (got - _hf_logits(hf_gemma(seed=11), p)).abs().max().item() > 1e-2  # the adapter does change them


def test_the_multimodal_classifier_scores_equal_transformers() -> None:
    torch.manual_seed(13)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = transformers.Gemma3Config(text_config=TEXT, vision_config=vision, mm_tokens_per_image=4, num_labels=2)
    hf = _perturb(transformers.Gemma3ForSequenceClassification(cfg)).float().eval()
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    config = config_for(_raw(hf))
    assert len(config.id2label) == 2
    runner = ModelRunner.create(config, weights, ExecutorConfig(device="cpu", dtype="float32"), 4)
    runner.allocate_kv_cache(16)
    kv = KVCacheManager(16, 4)
    p = _prompts(14, (9,))[0]
    assert kv.allocate("a", len(p))
    hidden = _hidden(runner, BatchRow("a", p, 0, kv.block_table("a"), None))
    with torch.no_grad():
        want = hf(torch.tensor([p])).logits[0]
    assert (runner.model.classify(hidden) - want).abs().max().item() <= 1e-4
