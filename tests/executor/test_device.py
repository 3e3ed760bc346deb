from pathlib import Path

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


def test_fused_segments_are_picked_for_decoders_on_cuda_and_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    pytest.importorskip("triton")
    from prelude.config import ExecutorConfig
    from prelude.executor.runner import fused_segments_for
    from prelude.kernels.cpu.cpu_fused import load_cpu_kernels

    def model(device: str, encoder: bool = False, head_dim: int = 64,
              dtype: torch.dtype = torch.float32) -> SimpleNamespace:
        return SimpleNamespace(device=torch.device(device), is_encoder=encoder, dtype=dtype,
                               config=SimpleNamespace(head_dim=head_dim))

    def label(m: SimpleNamespace, config: ExecutorConfig | None = None) -> str | None:
        segments = fused_segments_for(m, config or ExecutorConfig())  # type: ignore[arg-type]
        return None if segments is None else segments.label

    assert label(model("cuda", dtype=torch.bfloat16)) == "triton"
    assert label(model("cuda:1", dtype=torch.bfloat16)) == "triton"
    assert label(model("cuda"), ExecutorConfig(fused_kernels=False)) is None
    assert label(model("cuda", encoder=True)) is None
    assert label(model("cuda", head_dim=80)) is None  # the Triton rotary tiles power-of-two halves
    cpu_kernels = load_cpu_kernels() is not None
    assert label(model("cpu")) == ("cpu" if cpu_kernels else None)
    assert label(model("cpu", head_dim=80)) == ("cpu" if cpu_kernels else None)  # any even head_dim
    assert label(model("cpu", head_dim=63)) is None
    assert label(model("cpu", dtype=torch.bfloat16)) == ("cpu" if cpu_kernels else None)  # float32 and bf16
    assert label(model("cpu", dtype=torch.float16)) is None
    assert label(model("cpu"), ExecutorConfig(fused_kernels=False)) is None
    assert label(model("cpu", encoder=True)) is None
    monkeypatch.setenv("PRELUDE_CPU_FUSED", "0")
    assert label(model("cpu")) is None


def test_auto_attention_backend_is_triton_on_cuda_only() -> None:
    from prelude.executor.device import resolve_attention_backend

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_attention_backend("auto", cuda, has_triton=True) == "triton"
    assert resolve_attention_backend("auto", cuda, has_triton=False) == "torch"
    assert resolve_attention_backend("auto", cpu, has_triton=True) == "cpu"  # the C kernel (SDPA if it cannot build)
    assert resolve_attention_backend("torch", cuda, has_triton=True) == "torch"  # an explicit name stays
    assert resolve_attention_backend("triton", cpu) == "triton"  # refused later by the registry, with its reason


def test_dtype_reason_names_the_flags_behind_auto() -> None:
    from prelude.executor.device import dtype_reason

    cpu = torch.device("cpu")
    assert "avx512_bf16" in dtype_reason("auto", cpu, frozenset({"avx2", "avx512_bf16"}))
    assert "no AVX512-BF16" in dtype_reason("auto", cpu, frozenset({"avx2", "fma"}))
    assert dtype_reason("float32", cpu) == "asked for"


def test_the_avx2_cap_hides_the_wider_flags_from_every_isa_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """PRELUDE_CPU_ISA=avx2 runs a wider CPU as an AVX2-only one: no AVX-512 or AMX flag
    reaches a choice (bf16 auto then picks float32), and builds drop -march=native."""
    from prelude.kernels.cpu import native_lib

    wide = frozenset({"avx2", "fma3", "avx512_f", "avx512_bf16", "amx_bf16", "amx_tile"})
    monkeypatch.setattr(native_lib, "_detected_isa_flags", lambda: wide)
    monkeypatch.delenv(native_lib.ISA_CAP_ENV, raising=False)
    assert native_lib.cpu_isa_flags() == wide
    assert auto_dtype(torch.device("cpu"), native_lib.cpu_isa_flags()) is torch.bfloat16
    assert native_lib.build_flags(native_lib.FLAGS) == native_lib.FLAGS
    monkeypatch.setenv(native_lib.ISA_CAP_ENV, "AVX2")
    assert native_lib.cpu_isa_flags() == {"avx2", "fma3"}
    assert auto_dtype(torch.device("cpu"), native_lib.cpu_isa_flags()) is torch.float32
    assert native_lib.build_flags(native_lib.FLAGS) == native_lib.AVX2_FLAGS


@pytest.mark.skipif("avx512_bf16" not in cpu_isa_flags(), reason="the cap changes nothing on a CPU without AVX512-BF16")
def test_the_avx2_cap_builds_the_kernels_without_the_wider_paths(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """On an AVX512-BF16 CPU the native attention build has the bf16 dot-product forms; under
    the cap the same source builds (into its own cache entry) without them."""
    import ctypes

    from prelude.kernels.cpu import native_lib
    from prelude.kernels.cpu import cpu_attention

    monkeypatch.setenv("PRELUDE_CACHE_DIR", str(tmp_path))
    native = ctypes.CDLL(str(native_lib.build(cpu_attention._SOURCE, cpu_attention.FLAGS)))
    monkeypatch.setenv(native_lib.ISA_CAP_ENV, "avx2")
    capped = ctypes.CDLL(str(native_lib.build(cpu_attention._SOURCE, cpu_attention.FLAGS)))
    assert native.prelude_attention_bf16_forms() == 1
    assert capped.prelude_attention_bf16_forms() == 0


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="needs Linux's /proc/cpuinfo")
def test_cpuinfo_fields_back_the_flags_and_the_vendor(monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc/cpuinfo's flags (what serves when torch's cpuinfo cannot) agree with torch's on
    the flags the choices read, and its vendor is what MKL's dispatch sees."""
    from prelude.kernels.cpu import native_lib

    torch_flags = native_lib._detected_isa_flags()

    def no_cpuinfo() -> dict[str, bool]:
        raise RuntimeError("cpuinfo unavailable")

    monkeypatch.setattr(torch._C._cpu, "_get_cpu_capability", no_cpuinfo)
    proc_flags = native_lib._detected_isa_flags()
    for flag in ("avx2", "avx512_f", "avx512_bf16", "amx_bf16"):
        assert (flag in proc_flags) == (flag in torch_flags), flag
    assert native_lib.cpu_vendor() == (native_lib.cpuinfo_field("vendor_id") or "")
    assert native_lib.cpuinfo_field("no such field") is None
