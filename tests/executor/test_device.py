import pytest
import torch

from prelude.executor.device import auto_dtype, cpu_has_native_bf16, cpu_isa_flags, resolve_dtype


def test_auto_dtype_follows_the_cpus_bf16_support() -> None:
    cpu = torch.device("cpu")
    assert auto_dtype(cpu, frozenset({"avx2", "fma3"})) is torch.float32
    assert auto_dtype(cpu, frozenset({"avx2", "avx512_f"})) is torch.float32  # AVX-512 without BF16
    assert auto_dtype(cpu, frozenset({"avx2", "avx512_f", "avx512_bf16"})) is torch.bfloat16
    assert auto_dtype(cpu, frozenset({"amx_bf16"})) is torch.bfloat16
    assert auto_dtype(torch.device("meta"), frozenset()) is torch.bfloat16  # any accelerator


def test_resolve_auto_matches_this_machine() -> None:
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) is expected
    assert resolve_dtype("bf16", torch.device("cpu")) is torch.bfloat16
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":  # an x86 CPU with vector units
        assert cpu_isa_flags(), "the CPU flags could not be read"


def test_fused_segments_are_picked_for_cuda_decoders_only() -> None:
    from types import SimpleNamespace

    pytest.importorskip("triton")
    from prelude.config import ExecutorConfig
    from prelude.executor.runner import fused_segments_for
    from prelude.model.fused_segments import FUSED_SEGMENTS

    def model(device: str, encoder: bool = False, head_dim: int = 64) -> SimpleNamespace:
        return SimpleNamespace(device=torch.device(device), is_encoder=encoder, config=SimpleNamespace(head_dim=head_dim))

    assert fused_segments_for(model("cuda"), ExecutorConfig()) is FUSED_SEGMENTS  # type: ignore[arg-type]
    assert fused_segments_for(model("cuda:1"), ExecutorConfig()) is FUSED_SEGMENTS  # type: ignore[arg-type]
    assert fused_segments_for(model("cuda"), ExecutorConfig(fused_kernels=False)) is None  # type: ignore[arg-type]
    assert fused_segments_for(model("cuda", encoder=True), ExecutorConfig()) is None  # type: ignore[arg-type]
    assert fused_segments_for(model("cpu"), ExecutorConfig()) is None  # type: ignore[arg-type]
    assert fused_segments_for(model("cuda", head_dim=80), ExecutorConfig()) is None  # type: ignore[arg-type]


def test_auto_attention_backend_is_triton_on_cuda_only() -> None:
    from prelude.executor.device import resolve_attention_backend

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_attention_backend("auto", cuda, has_triton=True) == "triton"
    assert resolve_attention_backend("auto", cuda, has_triton=False) == "torch"
    assert resolve_attention_backend("auto", cpu, has_triton=True) == "torch"
    assert resolve_attention_backend("torch", cuda, has_triton=True) == "torch"  # an explicit name stays
    assert resolve_attention_backend("triton", cpu) == "triton"  # refused later by the registry, with its reason
