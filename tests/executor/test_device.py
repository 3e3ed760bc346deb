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
