"""layer_loop.c: a small step's layer loop in one C call gives the Python loop's hidden
states and K/V bit for bit (the same kernels in the same order): decode rows, prompts' rows
with the last layer for the read positions only, over plain bf16 weights and over GGUF
blocks; and it takes only the steps it can run."""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch

from prelude.config import ModelConfig
from prelude.kernels.cpu import amx_gemm
from prelude.model.fast_paths import decode_routes
from prelude.kernels.cpu import f32_gemm
from prelude.kernels.cpu import layer_loop
from prelude.model.layers import linear
from prelude.model.attention import get_attention_backend
from prelude.model.attention.cpu_backend import load_cpu_attention
from prelude.kernels.cpu.amx_gemm import load_amx_gemm
from prelude.model.attention.metadata import AttentionMetadata, DecodeRows
from prelude.kernels.cpu.bf16_rows import TILE_MAX_ROWS, load_bf16_rows
from prelude.kernels.cpu.quant_gemm import load_kernel
from prelude.kernels.cpu.cpu_fused import load_cpu_kernels
from prelude.model.fast_paths.decode_routes import RouteChoice
from prelude.model.fast_paths.layer_loop import LayerLoop
from prelude.model.layers.decoder_segments import EAGER_SEGMENTS
from prelude.model.layers.fused_segments import fused_segments
from prelude.kernels.ggml_quants import GgmlQuants
from prelude.model.arch.llama import describe
from prelude.model.decoder import Decoder
from prelude.model.read_positions import ReadPositions
from tests.model.test_cpu_attention import Row, make_batch
from tests.kernels.test_f32_gemm import KERNEL as AVX2_F32_KERNEL  # built for an AVX2-only CPU, any host
from tests.kernels.test_f32_gemm import count_calls


def _tile_form_runs() -> bool:
    kernel = load_bf16_rows()
    return kernel is not None and kernel.tile_form_ready()


pytestmark = pytest.mark.skipif(load_cpu_attention() is None or load_cpu_kernels() is None,
                                reason="the C layer loop calls the C attention and the fused C kernels")
# bf16 steps' projections take bf16_rows.c's tile form past the blocks' bound (AMX-BF16), or
# without AMX amx_gemm.c's dot-product form (AVX512-BF16): the tests run whichever this CPU has
needs_tiles = pytest.mark.skipif(not _tile_form_runs() and load_amx_gemm() is None,
                                 reason="bf16 steps in C need AMX-BF16 (the tile form) or AVX512-BF16 (amx_gemm.c's "
                                        "dot-product form)")

LAYERS, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 3, 64, 160, 4, 2, 16, 101
CFG = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                  num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  head_dim=HEAD_DIM, max_position_embeddings=4096)
PROJECTIONS = (("self_attn.q_proj", (HEADS * HEAD_DIM, HIDDEN)), ("self_attn.k_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
               ("self_attn.v_proj", (KV_HEADS * HEAD_DIM, HIDDEN)), ("self_attn.o_proj", (HIDDEN, HEADS * HEAD_DIM)),
               ("mlp.gate_proj", (INTER, HIDDEN)), ("mlp.up_proj", (INTER, HIDDEN)), ("mlp.down_proj", (HIDDEN, INTER)))


def _weights(seed: int = 5, qwen: bool = False) -> dict[str, torch.Tensor]:
    """Random weights; `qwen`: with q/k/v biases (Qwen2) and per-head q/k norms (Qwen3) too."""
    g = torch.Generator().manual_seed(seed)
    weights = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g) * 0.5,
               "model.norm.weight": 1 + torch.randn(HIDDEN, generator=g) * 0.1}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name, shape in PROJECTIONS:
            weights[f"{p}{name}.weight"] = torch.randn(*shape, generator=g) * shape[1] ** -0.5
            if qwen and name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                weights[f"{p}{name}.bias"] = torch.randn(shape[0], generator=g) * 0.1
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"{p}{norm}.weight"] = 1 + torch.randn(HIDDEN, generator=g) * 0.1
        if qwen:
            for norm in ("self_attn.q_norm", "self_attn.k_norm"):
                weights[f"{p}{norm}.weight"] = 1 + torch.randn(HEAD_DIM, generator=g) * 0.1
    return weights


def _blocks(weights: dict[str, torch.Tensor]) -> dict[str, GgmlQuants]:
    """Each projection quantized (Q4_1, and Q8_0 for the MLP's down), and its weight made the
    blocks' dequantization, as a converted GGUF holds both."""
    gguf = pytest.importorskip("gguf")
    blocks = {}
    for i in range(LAYERS):
        for name, _shape in PROJECTIONS:
            key = f"model.layers.{i}.{name}.weight"
            kind = "Q8_0" if name == "mlp.down_proj" else "Q4_1"
            w = weights[key].numpy()
            raw = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, kind))
            b = GgmlQuants.from_gguf(kind, raw, w.shape[0])
            assert b is not None
            blocks[key] = b
            weights[key] = b.dequantize()
    return blocks


def _model(dtype: torch.dtype = torch.bfloat16, with_blocks: bool = False, attention: str = "cpu",
           qwen: bool = False) -> Decoder:
    weights = _weights(qwen=qwen)
    blocks = _blocks(weights) if with_blocks else None
    # The blocks' row bound is the tests' to set (limit_blocks), not this CPU's measurement of
    # these tiny shapes (decode_routes.choose), which may drop the blocks altogether.
    with mock.patch.object(decode_routes, "choose", lambda pairs, kernel, dtype, copies: RouteChoice(8, {}, "pinned")):
        # Qwen's q/k/v biases and q/k norms together, so one model covers both C paths
        spec = describe(CFG, qkv_bias=qwen, qk_norm=qwen)
        return Decoder(CFG, spec, weights, dtype, attention=get_attention_backend(attention), prepack=True,
                       blocks=blocks)


def _projections(model: Decoder) -> list[linear.Projection]:
    return [p for layer in model.layers for p in layer.projections]


def _reads(rows: list[Row]) -> ReadPositions:
    """The last position of every row (a prompt's next token, a decode row's)."""
    ends = torch.tensor([r.new for r in rows]).cumsum(0) - 1
    prompts = [r for r in rows if not (r.new == 1 and r.own_in_cache and r.segments is None)]
    return ReadPositions(ends, torch.ones(len(prompts), dtype=torch.int64))


def _run(model: Decoder, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
         caches: list, with_loop: bool, reads: ReadPositions | None = None, segments=None) -> torch.Tensor:  # noqa: ANN001
    """One forward on the fused C kernels' segments (or `segments`), the C loop on or off."""
    loop = model.layer_loop
    model.layer_loop = loop if with_loop else None
    try:
        return model.forward(ids, positions, meta, caches,
                             segments=segments or fused_segments(load_cpu_kernels(), "cpu"), reads=reads)
    finally:
        model.layer_loop = loop


def _forward(model: Decoder, rows: list[Row], with_driver: bool, segments=None,  # noqa: ANN001, ANN202
             reads: ReadPositions | None = None, dtype: torch.dtype = torch.bfloat16):
    """Hidden states and the K/V pools after one forward of `rows` (seeded inputs)."""
    b = make_batch(rows, HEADS, KV_HEADS, HEAD_DIM, block_size=4, dtype=dtype, seed=len(rows))
    ids = torch.randint(0, VOCAB, (sum(r.new for r in rows),), generator=torch.Generator().manual_seed(6))
    positions = torch.cat([torch.arange(r.prefix, r.prefix + r.new) for r in rows])
    caches = [(b.k_cache.clone(), b.v_cache.clone()) for _ in range(LAYERS)]
    return _run(model, ids, positions, b.meta, caches, with_driver, reads, segments), caches


def _read_both_ways_equal(model: Decoder, rows: list[Row]) -> None:
    """The step with each row's last position read, then with every position read: the C
    loop's hidden states and K/V equal the Python loop's bit for bit."""
    tokens = sum(r.new for r in rows)
    for reads in (_reads(rows), None):
        got, got_kv = _forward(model, rows, with_driver=True, reads=reads)
        want, want_kv = _forward(model, rows, with_driver=False, reads=reads)
        assert got.shape == (tokens if reads is None else len(rows), HIDDEN)
        assert torch.equal(got, want)
        for (kg, vg), (kw, vw) in zip(got_kv, want_kv, strict=True):
            assert torch.equal(kg, kw) and torch.equal(vg, vw)


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts of the steps the C loop ran."""
    seen: list[int] = []
    real = LayerLoop.run

    def counted(self, h, cos, sin, meta, kv_caches, reads=None):  # noqa: ANN001, ANN202
        seen.append(h.shape[0])
        return real(self, h, cos, sin, meta, kv_caches, reads)

    monkeypatch.setattr(LayerLoop, "run", counted)
    return seen


@needs_tiles
@pytest.mark.parametrize("with_blocks", [False, True])
@pytest.mark.parametrize("count", [1, 2, 3, 17, TILE_MAX_ROWS])
def test_a_decode_step_equals_the_python_loop_bit_for_bit(runs: list[int], with_blocks: bool, count: int) -> None:
    """Decode rows over contexts across block boundaries; with blocks allowed up to 2 rows,
    1-2 rows read them and 3+ take the tile form, or amx_gemm.c without AMX (each projection
    as Projection routes it)."""
    if with_blocks and load_kernel() is None:
        pytest.skip("the GGUF blocks kernel cannot run here")
    model = _model(with_blocks=with_blocks)
    assert model.layer_loop is not None
    if with_blocks:
        assert all(p.blocks is not None for p in _projections(model))
        for p in _projections(model):
            p.limit_blocks(2)
    rows = [Row(3 + 5 * i, 1) for i in range(count)]
    got, got_kv = _forward(model, rows, with_driver=True)
    assert runs == [count]
    want, want_kv = _forward(model, rows, with_driver=False)
    assert runs == [count]
    assert got.dtype == torch.bfloat16 and got.shape == (count, HIDDEN)
    assert torch.equal(got, want)
    for (kg, vg), (kw, vw) in zip(got_kv, want_kv, strict=True):
        assert torch.equal(kg, kw) and torch.equal(vg, vw)


@needs_tiles
@pytest.mark.parametrize("with_blocks", [False, True])
@pytest.mark.parametrize("rows", [
    [Row(0, 5, own_in_cache=False)],  # a short prompt, OneShot (its K/V not kept)
    [Row(0, 7), Row(9, 3)],  # prompts whose K/V are kept: a fresh one and a chunk over a cached prefix
    [Row(0, 11), Row(4, 1), Row(13, 6), Row(20, 1)],  # prompts' rows beside decode rows
    [Row(2, 30), Row(7, 1), Row(1, 1)],  # 32 tokens
])
def test_prompt_rows_with_read_positions_equal_the_python_loop(runs: list[int], with_blocks: bool,
                                                              rows: list[Row]) -> None:
    """Steps with prompts' rows, the last layer computed for each row's last position only
    (the reads the runner passes), and every position read: bit for bit the Python loop's,
    K/V included; with blocks allowed up to 2 rows, the last layer's few read rows take them."""
    if with_blocks and load_kernel() is None:
        pytest.skip("the GGUF blocks kernel cannot run here")
    model = _model(with_blocks=with_blocks)
    if with_blocks:
        for p in _projections(model):
            p.limit_blocks(2)
    tokens = sum(r.new for r in rows)
    _read_both_ways_equal(model, rows)
    assert runs == [tokens, tokens]


@needs_tiles
@pytest.mark.skipif(load_amx_gemm() is None, reason="steps past the tile form's rows run in C through amx_gemm.c (AMX)")
@pytest.mark.parametrize("rows", [
    [Row(0, TILE_MAX_ROWS + 1)],  # one past the tile form: the first amx_gemm.c step
    [Row(0, 70, own_in_cache=False), Row(5, 1)],  # a OneShot prompt beside a decode row
    [Row(3, 60), Row(0, 50), Row(9, 1), Row(2, 1), Row(4, 16)],  # chunks over cached prefixes, decode rows
    [Row(0, 128)],  # a 128-token prompt
])
def test_steps_past_the_tile_form_equal_the_python_loop(runs: list[int], rows: list[Row]) -> None:
    """33..128 tokens and more: the step's projections through amx_gemm.c, the last layer's
    read rows (a few) through the tile form, as Projection routes each call; bit for bit the
    Python loop's, K/V included, with and without read positions."""
    model = _model()
    tokens = sum(r.new for r in rows)
    assert model.layer_loop is not None and model.layer_loop.max_rows == load_amx_gemm().max_rows  # type: ignore[union-attr]
    _read_both_ways_equal(model, rows)
    assert runs == [tokens, tokens]


@needs_tiles
def test_biases_and_qk_norms_equal_the_python_loop(runs: list[int]) -> None:
    """q/k/v biases (Qwen2) and per-head q/k norms (Qwen3) ride along: a decode step and a
    prompt's step bit for bit."""
    model = _model(qwen=True)
    assert model.layers[0].qkv.bias is not None and model.layers[0].q_norm is not None
    for rows, reads in (([Row(3, 1), Row(8, 1), Row(12, 1)], None), ([Row(0, 9)], _reads([Row(0, 9)]))):
        got, got_kv = _forward(model, rows, with_driver=True, reads=reads)
        want, want_kv = _forward(model, rows, with_driver=False, reads=reads)
        assert torch.equal(got, want)
        for (kg, vg), (kw, vw) in zip(got_kv, want_kv, strict=True):
            assert torch.equal(kg, kw) and torch.equal(vg, vw)
    assert runs == [3, 9]


def test_float32_steps_the_blocks_take_equal_the_python_loop(monkeypatch: pytest.MonkeyPatch,
                                                             runs: list[int]) -> None:
    """float32 without f32_gemm.c (a CPU with AVX-512): the blocks are the only C route of a
    few-row call, so the loop takes steps of up to their bound (here 3 rows): decode rows and
    a short prompt bit for bit; a step past the bound runs the Python loop (oneDNN's calls)."""
    if load_kernel() is None:
        pytest.skip("the GGUF blocks kernel cannot run here")
    monkeypatch.setattr(linear, "load_f32_gemm", lambda: None)
    model = _model(dtype=torch.float32, with_blocks=True)
    assert model.layer_loop is not None
    for p in _projections(model):
        p.limit_blocks(3)
    assert model.layer_loop.max_rows == 3
    cases = (([Row(4, 1)], None), ([Row(3, 1), Row(8, 1), Row(12, 1)], None), ([Row(0, 3)], _reads([Row(0, 3)])),
             ([Row(5, 1)] * 4, None))
    for rows, reads in cases:
        got, got_kv = _forward(model, rows, with_driver=True, reads=reads, dtype=torch.float32)
        want, want_kv = _forward(model, rows, with_driver=False, reads=reads, dtype=torch.float32)
        assert got.dtype == torch.float32 and torch.equal(got, want)
        for (kg, vg), (kw, vw) in zip(got_kv, want_kv, strict=True):
            assert torch.equal(kg, kw) and torch.equal(vg, vw)
    assert runs == [1, 3, 3]


@pytest.mark.parametrize("with_blocks,qwen", [(False, False), (True, False), (False, True)])
def test_float32_steps_past_the_blocks_take_f32_gemm(monkeypatch: pytest.MonkeyPatch, runs: list[int],
                                                     with_blocks: bool, qwen: bool) -> None:
    """float32 where f32_gemm.c serves (a CPU with AVX2 and no AVX-512; here its AVX2 build
    whatever this CPU has): every call past the blocks' rows has a C route, so the loop takes
    prompts and mixed steps of up to its max_rows, bit for bit the Python loop (which routes
    the calls alike: the blocks up to their bound, f32_gemm.c past it); with q/k/v biases and
    q/k norms too (`qwen`)."""
    kernel = AVX2_F32_KERNEL
    if kernel is None or (with_blocks and load_kernel() is None):
        pytest.skip("no C compiler, no AVX2+FMA, or (with blocks) no GGUF blocks kernel here")
    monkeypatch.setattr(linear, "load_f32_gemm", lambda: kernel)
    model = _model(dtype=torch.float32, with_blocks=with_blocks, qwen=qwen)
    assert model.layer_loop is not None
    if with_blocks:
        for p in _projections(model):
            p.limit_blocks(3)
    assert model.layer_loop.max_rows == f32_gemm.MAX_ROWS
    calls = count_calls(monkeypatch)
    # decode rows, a short prompt, prompts past the blocks with decode rows beside them, and
    # seeded mixes: cached prefixes across block edges, OneShot rows (own K/V not in the pool)
    rng = random.Random(11)
    mixes = [[Row(rng.randrange(0, 40), rng.choice((1, rng.randrange(2, 90))), own_in_cache=rng.random() < 0.7)
              for _ in range(rng.randrange(1, 5))] for _ in range(4)]
    cases = ([Row(4, 1)], [Row(0, 3)], [Row(0, 130), Row(6, 1)], [Row(9, 1)] * 5, [Row(0, 300), Row(2, 7)], *mixes)
    for rows in cases:
        for reads in (_reads(rows), None):
            got, got_kv = _forward(model, rows, with_driver=True, reads=reads, dtype=torch.float32)
            want, want_kv = _forward(model, rows, with_driver=False, reads=reads, dtype=torch.float32)
            assert got.dtype == torch.float32 and torch.equal(got, want)
            for (kg, vg), (kw, vw) in zip(got_kv, want_kv, strict=True):
                assert torch.equal(kg, kw) and torch.equal(vg, vw)
    assert runs == [sum(r.new for r in rows) for rows in cases for _ in range(2)]
    assert calls and (not with_blocks or min(calls) > 3)  # the Python loop's calls past the blocks took it
    bound = model.layer_loop.max_rows
    _forward(model, [Row(0, bound + 1)], with_driver=True, dtype=torch.float32)  # past every C route
    assert len(runs) == 2 * len(cases)


@needs_tiles
def test_greedy_tokens_over_steps_equal_the_python_loop(runs: list[int]) -> None:
    """Six decode steps of two rows, each writing the K/V the next reads: the same greedy
    tokens and pools."""
    model = _model()
    steps, starts = 6, (6, 9)
    b = make_batch([Row(s + steps, 1) for s in starts], HEADS, KV_HEADS, HEAD_DIM, block_size=4, dtype=torch.bfloat16)
    assert b.meta.decodes is not None
    tables = b.meta.decodes.block_tables
    results = []
    for with_driver in (True, False):
        caches = [(b.k_cache.clone(), b.v_cache.clone()) for _ in range(LAYERS)]
        ids, out = torch.tensor([3, 7]), []
        for step in range(steps):
            positions = torch.tensor([s + step for s in starts])
            slots = torch.stack([tables[r, p // 4] * 4 + p % 4 for r, p in enumerate(positions.tolist())])
            meta = AttentionMetadata(slots, (), DecodeRows(torch.arange(2), tables, positions + 1,
                                                           int(positions.max()) + 1), 4)
            ids = model.compute_logits(_run(model, ids, positions, meta, caches, with_driver)).argmax(-1)
            out.append(ids.tolist())
        results.append((out, caches))
    assert runs == [2] * steps
    assert results[0][0] == results[1][0]
    for (kg, vg), (kw, vw) in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(kg, kw) and torch.equal(vg, vw)


@needs_tiles
def test_steps_it_cannot_run_take_the_python_loop(runs: list[int]) -> None:
    model = _model()
    driver = model.layer_loop
    assert driver is not None
    bound = driver.max_rows  # the tile form's, or amx_gemm.c's where it serves past it
    gemm = load_amx_gemm()
    assert bound == (gemm.max_rows if gemm is not None else TILE_MAX_ROWS)
    _forward(model, [Row(4, 1)] * (bound + 1), with_driver=True)  # more rows than the C routes take
    _forward(model, [Row(0, bound + 1)], with_driver=True)  # a prompt of as many tokens
    _forward(model, [Row(4, 1)], with_driver=True, segments=EAGER_SEGMENTS)  # not the fused C kernels
    _forward(model, [Row(0, 6, segments=(0, 0, 1, 1, 2, 2))], with_driver=True)  # multi-item segments
    nothing_read = ReadPositions(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    hidden, _ = _forward(model, [Row(0, 4)], with_driver=True, reads=nothing_read)
    assert hidden.shape == (0, HIDDEN)
    assert runs == []
    b = make_batch([Row(0, 3)], HEADS, KV_HEADS, HEAD_DIM, block_size=4, dtype=torch.bfloat16)
    h = torch.zeros(3, HIDDEN, dtype=torch.bfloat16)
    cos = sin = torch.zeros(3, HEAD_DIM, dtype=torch.bfloat16)
    for index, tails in (([3], [1]), ([-1], [1]), ([2], [1, 1])):  # past the step, negative, a tail too many
        with pytest.raises(ValueError, match="read positions"):
            driver.run(h, cos, sin, b.meta, [(b.k_cache, b.v_cache)] * LAYERS,
                       ReadPositions(torch.tensor(index), torch.tensor(tails)))
    with pytest.raises(RuntimeError, match="layer_loop.c"):
        b = make_batch([Row(4, 1)], HEADS, KV_HEADS, HEAD_DIM, block_size=4, dtype=torch.bfloat16)
        empty = torch.empty(0, HIDDEN, dtype=torch.bfloat16)
        driver.run(empty, empty, empty, b.meta, [(b.k_cache, b.v_cache)] * LAYERS)


@needs_tiles
def test_built_only_where_every_kernel_has_a_c_route(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _model().layer_loop is not None
    monkeypatch.setattr(linear, "load_f32_gemm", lambda: None)  # float32 without blocks: oneDNN's calls
    assert _model(dtype=torch.float32).layer_loop is None
    assert _model(attention="torch").layer_loop is None
    monkeypatch.setenv(layer_loop.SWITCH, "0")
    assert _model().layer_loop is None
    monkeypatch.delenv(layer_loop.SWITCH)
    monkeypatch.setattr(linear, "amx_gemm_kernel", lambda weight: None)  # steps past the tile form: oneDNN's
    if _tile_form_runs():
        assert _model().layer_loop.max_rows == TILE_MAX_ROWS
    else:  # no AMX: without amx_gemm.c every call past the blocks goes to oneDNN
        assert _model().layer_loop is None
    monkeypatch.setattr(linear, "tile_rows_kernel", lambda weight: None)  # no AMX: few rows go to oneDNN
    assert _model().layer_loop is None


@pytest.mark.skipif(_tile_form_runs() or load_amx_gemm() is None,
                    reason="the dot-product form's steps: a CPU with AVX512-BF16 and no AMX")
def test_without_amx_the_dot_product_form_takes_every_row_count(runs: list[int]) -> None:
    """No tile form: decode rows and prompts of up to the dot-product form's max_rows tokens
    run in C, every call past the blocks' rows through amx_gemm.c's dot-product form, bit for
    bit the Python loop (which routes them alike), past 128 rows too."""
    model = _model()
    assert model.layer_loop is not None and model.layer_loop.max_rows == amx_gemm.MAX_ROWS["dot-product"]
    assert all(p.tile_form is None and p.amx_gemm is not None and p.amx_gemm.form == "dot-product"
               for p in _projections(model))
    _read_both_ways_equal(model, [Row(3, 1)])
    _read_both_ways_equal(model, [Row(0, 127), Row(6, 1)])
    _read_both_ways_equal(model, [Row(0, 300), Row(9, 1)])
    assert runs == [1, 1, 128, 128, 301, 301]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_steps_run_in_c_on_the_one_route(monkeypatch: pytest.MonkeyPatch, runs: list[int],
                                                         dtype: torch.dtype) -> None:
    """Batch invariance where every one route is a GEMM of our own (amx_gemm.c's dot-product
    form in bf16 without AMX; f32_gemm.c's AVX2 build in float32, whatever this CPU has):
    the rebuilt loop calls that GEMM at every row count, blocks dropped, and the attention
    with every row wide, bit for bit the Python loop on the one routes, decode rows (which
    the narrow form sums otherwise) and prompts beside them included."""
    if dtype == torch.float32:
        if AVX2_F32_KERNEL is None or load_kernel() is None:
            pytest.skip("no C compiler, no AVX2+FMA, or no GGUF blocks kernel here")
        monkeypatch.setattr(linear, "load_f32_gemm", lambda: AVX2_F32_KERNEL)
    elif _tile_form_runs() or load_amx_gemm() is None:
        pytest.skip("bf16's one route is amx_gemm.c's dot-product form only on AVX512-BF16 without AMX")
    model = _model(dtype=dtype, with_blocks=True)
    for p in _projections(model):
        p.limit_blocks(3)
    calls = count_calls(monkeypatch) if dtype == torch.float32 else None
    assert model.make_batch_invariant() == len(_projections(model)) + 1  # the LM head too
    assert model.attention.all_wide and model.layer_loop is not None
    assert all(p.blocks is None and p.own_gemm is not None for p in _projections(model))
    cases = ([Row(9, 1)], [Row(4, 1), Row(13, 1), Row(6, 1)], [Row(0, 40), Row(7, 1)], [Row(3, 2), Row(0, 130)])
    for rows in cases:
        for reads in (_reads(rows), None):
            got, got_kv = _forward(model, rows, with_driver=True, reads=reads, dtype=dtype)
            want, want_kv = _forward(model, rows, with_driver=False, reads=reads, dtype=dtype)
            assert torch.equal(got, want)
            for (kg, vg), (kw, vw) in zip(got_kv, want_kv, strict=True):
                assert torch.equal(kg, kw) and torch.equal(vg, vw)
    assert runs == [sum(r.new for r in rows) for rows in cases for _ in range(2)]
    if calls is not None:  # the Python loop's one-row calls took f32_gemm.c as well, not the blocks
        assert min(calls) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_blocks", [False, True])
def test_the_loops_routes_are_the_projections_own_answers(dtype: torch.dtype, with_blocks: bool) -> None:
    """The C loop is handed each projection's route for every row count it takes
    (Projection.c_routes from Projection.route, the one place a GEMM is chosen), and the
    first row count past them is a route the loop does not call."""
    model = _model(dtype, with_blocks=with_blocks)
    for p in _projections(model):
        routes = p.c_routes(dtype)
        low = 0
        for upto, route in routes:
            assert route in linear.C_ROUTES
            assert all(p.route(n, dtype) is route for n in range(low + 1, upto + 1)), (low, upto, route)
            low = upto
        if low < 4096:
            assert p.route(low + 1, dtype) not in linear.C_ROUTES
    if model.layer_loop is not None:
        assert model.layer_loop.max_rows == min(p.c_routes(dtype)[-1][0] for p in _projections(model))
