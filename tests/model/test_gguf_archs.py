"""GGUF checkpoints of llama.cpp's `qwen3moe`, `gemma3` and `qwen35` architectures served
through the registry: random-weight transformers models written as GGUF the way llama.cpp's
converter writes them (tests/model/gguf_writer.py), loaded with load_model_files, and run
against transformers: float32 files give transformers' greedy tokens and logits within
float tolerance; quantized files the logits of transformers over the dequantized weights.
The tokenizer and config rebuilt from the file's metadata are checked too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from prelude.config import ExecutorConfig
from prelude.executor.runner import ModelRunner
from prelude.kv.kv_manager import KVCacheManager
from prelude.model.loading.files import LoadedModel, load_model_files

from tests.model.gguf_writer import dequantized_like_file, write_gguf

transformers = pytest.importorskip("transformers")

F32, F16, BF16, Q8_0, Q4_0 = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                              gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.Q8_0,
                              gguf.GGMLQuantizationType.Q4_0)


def _load(model: Any, arch: str, qtype: gguf.GGMLQuantizationType, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> LoadedModel:
    monkeypatch.setenv("PRELUDE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(model, arch, tmp_path / f"{arch}-{qtype.name}.gguf", qtype)
    return load_model_files(str(path))


def _runner(loaded: LoadedModel, dtype: str = "float32") -> tuple[ModelRunner, KVCacheManager]:
    runner = ModelRunner.create(loaded.config, loaded.weights, ExecutorConfig(device="cpu", dtype=dtype), 4,
                                blocks=loaded.blocks)
    runner.allocate_kv_cache(64)
    return runner, KVCacheManager(64, 4)


# --- qwen3moe --------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [F32, F16, Q8_0, Q4_0], ids=lambda q: q.name)
def test_qwen3moe_gguf_equals_transformers(qtype: gguf.GGMLQuantizationType, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.model.test_qwen3_moe import _prefill_then_decode, hf_moe

    # llama.cpp's qwen3moe: every layer a mixture, top-k weights renormalized
    hf = hf_moe(norm_topk_prob=True, mlp_only_layers=[])
    loaded = _load(hf, "qwen3moe", qtype, tmp_path, monkeypatch)
    assert loaded.config.architecture == "Qwen3MoeForCausalLM"
    assert loaded.config.moe.num_experts == 8 and loaded.config.moe.top_k == 2 and loaded.config.moe.norm_topk_prob
    if qtype in (Q8_0, Q4_0):  # experts and projections kept in their blocks for decode
        assert loaded.blocks["model.layers.0.mlp.experts.gate_up_proj"].kind == qtype.name.lower()
        assert loaded.blocks["model.layers.0.mlp.experts.down_proj"].out_features == 8 * 64
        for name in ("gate_up_proj", "down_proj"):
            w = loaded.weights[f"model.layers.0.mlp.experts.{name}"]
            assert torch.equal(loaded.blocks[f"model.layers.0.mlp.experts.{name}"].dequantize(),
                               w.reshape(-1, w.shape[-1]))
    dequantized_like_file(hf, "qwen3moe", qtype)
    runner, kv = _runner(loaded)
    read: list[int] = []
    moe = runner.model.layers[0].moe
    if qtype in (Q8_0, Q4_0) and moe.expert_blocks is not None:  # None: no block kernel on this CPU
        experts = {b.qs.data_ptr() for pair in moe.expert_blocks.experts for b in pair}
        kernel = type(moe.expert_blocks.kernel)
        linear = kernel.linear
        monkeypatch.setattr(kernel, "linear", lambda self, x, blocks, bias=None: (
            read.append(blocks.qs.data_ptr() in experts), linear(self, x, blocks, bias))[1])
    _prefill_then_decode(hf, runner, kv, tol=1e-4 if qtype == F32 else 2e-4)
    if qtype in (Q8_0, Q4_0) and moe.expert_blocks is not None:
        assert any(read)  # decode's few rows an expert read the experts' blocks


# --- gemma3 ----------------------------------------------------------------------------

GEMMA_WINDOW = 6


def _hf_gemma3(seed: int = 0) -> Any:
    from tests.model.test_gemma3 import TEXT, _perturb

    torch.manual_seed(seed)
    # llama.cpp's gemma3: one global layer every 6, the sliding ones at RoPE base 10 000, the
    # attention scale head_dim ** -0.5
    cfg = transformers.Gemma3TextConfig(**{
        **TEXT, "vocab_size": 300, "num_hidden_layers": 6, "sliding_window": GEMMA_WINDOW, "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"]})
    return _perturb(transformers.Gemma3ForCausalLM(cfg)).eval()


def _greedy_and_logits(hf: Any, runner: ModelRunner, kv: KVCacheManager, prompt: list[int], steps: int,
                       tol: float) -> None:
    """Prefill then greedy decode one row: each step's logits within `tol` of transformers'
    on the same tokens, and the greedy tokens transformers'."""
    from prelude.forward_batch import BatchRow
    from tests.model.test_decoder_numerics import _run

    seq = list(prompt)
    start = 0
    for _ in range(steps):
        assert kv.allocate("r", len(seq))
        (got,) = _run(runner, [BatchRow("r", seq[start:], start, kv.block_table("r"), None)])
        with torch.no_grad():
            want = hf(torch.tensor([seq])).logits[0, start:].float()
        assert (got - want).abs().max().item() <= tol
        assert int(got[-1].argmax()) == int(want[-1].argmax())
        start = len(seq)
        seq.append(int(want[-1].argmax()))


@pytest.mark.parametrize("qtype", [F32, BF16, Q8_0], ids=lambda q: q.name)
def test_gemma3_gguf_equals_transformers(qtype: gguf.GGMLQuantizationType, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    hf = _hf_gemma3()
    loaded = _load(hf, "gemma3", qtype, tmp_path, monkeypatch)
    c = loaded.config
    assert c.architecture == "Gemma3ForCausalLM"
    assert c.layer_kinds == ("sliding",) * 5 + ("full",) and c.window == GEMMA_WINDOW
    assert (c.rope_theta, c.local_rope_theta, dict(c.rope_scaling or ())["factor"]) == (1_000_000.0, 10_000.0, 4.0)
    if qtype == Q8_0:
        assert loaded.blocks["model.layers.0.self_attn.q_proj.weight"].kind == "q8_0"
    dequantized_like_file(hf, "gemma3", qtype)
    runner, kv = _runner(loaded)
    prompt = torch.randint(0, 256, (3 * GEMMA_WINDOW,), generator=torch.Generator().manual_seed(1)).tolist()
    _greedy_and_logits(hf, runner, kv, prompt, steps=4, tol=1e-4 if qtype == F32 else 2e-4)


def test_gemma3_gguf_tokenizer_equals_transformers_gguf_tokenizer(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The sentencepiece vocabulary rebuilt from the file splits text as transformers' own
    GGUF tokenizer does (merges in Gemma's file order, spaces as U+2581, byte fallback)."""
    hf = _hf_gemma3()
    loaded = _load(hf, "gemma3", F32, tmp_path, monkeypatch)
    path = tmp_path / "gemma3-F32.gguf"
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["the and is", "  then there is", "théâtre\n\tand", "<eos> in the", "a  b   c"]:
        assert loaded.tokenizer.encode(text) == ref.encode(text), text
        assert loaded.tokenizer.decode(ref.encode(text), skip_special_tokens=True) == \
            ref.decode(ref.encode(text), skip_special_tokens=True)
    assert loaded.tokenizer.encode("the")[0] == 2  # <bos> first, as the file's add_bos_token says


# --- qwen35 ----------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [F32, Q8_0], ids=lambda q: q.name)
def test_qwen35_gguf_equals_transformers(qtype: gguf.GGMLQuantizationType, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Two value heads a key head, so the value-head order llama.cpp tiles is undone on
    every DeltaNet tensor; the 4th layer is a gated full-attention layer."""
    pytest.importorskip("transformers.models.qwen3_5")
    from prelude.model import registry
    from tests.model.test_qwen3_5 import hf_model, oneshot_hidden

    hf = hf_model(5)
    loaded = _load(hf, "qwen35", qtype, tmp_path, monkeypatch)
    c = loaded.config
    assert c.architecture == "Qwen3_5ForCausalLM" and loaded.blocks == {}  # hybrids read the float32 copy
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            c.rotary_dim) == (2, 4, 24, 20, 8)
    for name, tensor in hf.state_dict().items():
        if qtype == F32 and name in loaded.weights:  # the checkpoint's own values back (up to float32 rounding)
            assert torch.allclose(loaded.weights[name], tensor.float(), rtol=1e-6, atol=1e-6), name
    dequantized_like_file(hf, "qwen35", qtype)
    model = registry.build_model(c, loaded.weights, torch.float32, torch.device("cpu"), None)
    prompts = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 3)]
    for prompt, hidden in zip(prompts, oneshot_hidden(model, prompts)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        logits = model.compute_logits(hidden)
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))
        assert (logits.log_softmax(-1) - ref.log_softmax(-1)).abs().max() < 1e-3


def test_qwen35_gguf_tokenizer_and_metadata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The byte-level vocabulary with Qwen3.5's split pattern, its control tokens whole,
    the chat template and end-of-turn token from the file's metadata."""
    pytest.importorskip("transformers.models.qwen3_5")
    from tests.model.test_qwen3_5 import hf_model

    loaded = _load(hf_model(6), "qwen35", F32, tmp_path, monkeypatch)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="qwen35-F32.gguf")
    for text in ["the and then", "in 2024 there is<|im_end|>", "théâtre\n\n  and"]:
        assert loaded.tokenizer.encode(text) == ref.encode(text), text
    assert 299 in loaded.tokenizer.eos_token_ids and loaded.config.eos_token_ids == (299,)


# --- qwen3next -------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [F32, Q8_0], ids=lambda q: q.name)
def test_qwen3next_gguf_equals_transformers(qtype: gguf.GGMLQuantizationType, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """in_proj_qkvz regrouped from llama.cpp's q, k, v blocks and z; experts with the
    sigmoid-gated shared expert on every layer (llama.cpp's qwen3next)."""
    from prelude.model import registry
    from tests.model.test_qwen3_5 import hf_next, oneshot_hidden

    hf = hf_next(7, mlp_only_layers=[])
    loaded = _load(hf, "qwen3next", qtype, tmp_path, monkeypatch)
    c = loaded.config
    assert c.architecture == "Qwen3NextForCausalLM" and loaded.blocks == {}
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size,
            c.mlp_only_layers, c.norm_topk_prob) == (6, 2, 40, 48, (), True)
    if qtype == F32:
        for name, tensor in hf.state_dict().items():
            assert torch.allclose(loaded.weights[name], tensor.float(), rtol=1e-6, atol=1e-6), name
    dequantized_like_file(hf, "qwen3next", qtype)
    model = registry.build_model(c, loaded.weights, torch.float32, torch.device("cpu"), None)
    prompts = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (33, 2)]
    for prompt, hidden in zip(prompts, oneshot_hidden(model, prompts)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        logits = model.compute_logits(hidden)
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))
        assert (logits.log_softmax(-1) - ref.log_softmax(-1)).abs().max() < 1e-3


# --- what is refused -------------------------------------------------------------------


def test_a_gguf_tensor_no_architecture_reads_is_refused_at_start_in_one_line(tmp_path: Path) -> None:
    """A fused ffn_gate_up_exps (a layout not verified here) is refused from the header, before
    any conversion, in one line naming the tensor."""
    from prelude.startup import StartupError, check_model

    path = tmp_path / "fused.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_tensor("token_embd.weight", torch.zeros(300, 64).numpy())
    w.add_tensor("blk.0.ffn_gate_up_exps.weight", torch.zeros(8, 64, 64).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(StartupError) as info:
        check_model(str(path), None)
    message = str(info.value)
    assert "\n" not in message and "blk.0.ffn_gate_up_exps.weight is not supported" in message


# --- the whole engine, and the writer against transformers' own GGUF loader ------------


def _hf_greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", ["qwen3moe", "gemma3", "qwen35"])
def test_llm_serves_the_gguf_file_as_transformers_generates(arch: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`LLM(model=<file>.gguf)`: converted once, tokenized with the file's vocabulary, and the
    greedy continuation of a text prompt is transformers' on the same ids (float32, Q8_0
    projections and experts kept in their blocks for decode)."""
    from prelude import LLM, SamplingParams

    if arch == "qwen35":
        pytest.importorskip("transformers.models.qwen3_5")
        from tests.model.test_qwen3_5 import hf_model

        hf = hf_model(8)
    elif arch == "gemma3":
        hf = _hf_gemma3(3)
    else:
        from tests.model.test_qwen3_moe import hf_moe

        hf = hf_moe(3, norm_topk_prob=True, mlp_only_layers=[])
    monkeypatch.setenv("PRELUDE_CACHE_DIR", str(tmp_path / "cache"))
    qtype = F32 if arch == "qwen35" else Q8_0
    path = write_gguf(hf, arch, tmp_path / f"{arch}.gguf", qtype)
    dequantized_like_file(hf, arch, qtype)
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=64, block_size=4)
    text = "the and then there is"
    ids = llm.tokenizer.encode(text, add_special_tokens=True)
    (out,) = llm.generate([text], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == _hf_greedy(hf, ids, 6)


def test_transformers_reads_the_written_gemma3_gguf_as_the_original_model(tmp_path: Path) -> None:
    """The test writer's conventions agree with transformers' GGUF loader (which undoes
    llama.cpp's (1 + w) norms itself): the weights it reads back are the original ones."""
    hf = _hf_gemma3(4)
    write_gguf(hf, "gemma3", tmp_path / "m.gguf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
    assert ref.config.layer_types == list(hf.config.layer_types) and ref.config.sliding_window == GEMMA_WINDOW
    got = ref.state_dict()
    for name, tensor in hf.state_dict().items():
        assert torch.allclose(got[name], tensor, atol=1e-6), name


def test_qwen3moe_q8_gguf_in_bf16_stays_close_to_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16: the experts' blocks read with bf16 activations where the CPU has AVX512-BF16,
    the bf16 copy elsewhere; logits within bf16 tolerance of transformers' float32."""
    from prelude.forward_batch import BatchRow
    from tests.model.test_decoder_numerics import _run
    from tests.model.test_qwen3_moe import hf_moe

    hf = hf_moe(9, norm_topk_prob=True, mlp_only_layers=[])
    loaded = _load(hf, "qwen3moe", Q8_0, tmp_path, monkeypatch)
    dequantized_like_file(hf, "qwen3moe", Q8_0)
    runner, kv = _runner(loaded, "bfloat16")
    seq = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(9)).tolist()
    start = 0
    for _ in range(4):  # the prompt, then decode steps of one row (the blocks' calls)
        assert kv.allocate("r", len(seq))
        (got,) = _run(runner, [BatchRow("r", seq[start:], start, kv.block_table("r"), None)])
        with torch.no_grad():
            want = hf(torch.tensor([seq])).logits[0, start:].float()
        assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()
        start = len(seq)
        seq.append(int(want[-1].argmax()))


def test_qwen35_multi_token_prediction_blocks_are_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """The trailing `nextn_predict_layers` blocks (a draft model no answer reads) are not
    layers of the served model, and the log says they were left out."""
    pytest.importorskip("transformers.models.qwen3_5")
    import numpy as np

    from tests.model.test_qwen3_5 import hf_model

    hf = hf_model(10)
    extra = {"blk.4.attn_norm.weight": np.ones(64, np.float32),
             "blk.4.nextn.eh_proj.weight": np.zeros((64, 128), np.float32)}
    monkeypatch.setenv("PRELUDE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(hf, "qwen35", tmp_path / "mtp.gguf", extra=extra, mtp_layers=1)
    with caplog.at_level("INFO"):
        loaded = load_model_files(str(path))
    assert loaded.config.num_hidden_layers == 4 and not any("layers.4." in n for n in loaded.weights)
    assert "multi-token-prediction head (2 tensors) left out" in caplog.text
