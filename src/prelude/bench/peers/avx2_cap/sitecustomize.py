"""Put on a benchmark peer's PYTHONPATH under the AVX2 cap (PRELUDE_CPU_ISA=avx2): torch's
probes for AVX-512 and AMX answer False in that process and its children, so vLLM's CPU
build loads the kernels it ships for AVX2-only CPUs (vllm._C_AVX2) instead of its AVX-512
ones, as it would on such a CPU. ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA cap torch's own
kernels; they do not change these probes."""

import torch.cpu as _cpu

for _probe in ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
               "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(_cpu, _probe):
        setattr(_cpu, _probe, lambda: False)
