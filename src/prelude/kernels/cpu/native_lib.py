"""Build and load the model's small C libraries (quant_gemm.c, cpu_fused.c, ...).

Each C file is compiled with the system C compiler on first use (about a second) into the user's
cache dir, for the CPU it runs on (`-march=native`: the compiler vectorizes for the host's
widest ISA, and `#ifdef __AVX512F__`-style guards pick a C file's wider paths), keyed by
the source, the compiler, the flags and the CPU's ISA flags: a cache shared by two
machines holds one library per CPU kind, so none runs an instruction its CPU lacks. Later
processes load the cached library. `make install` builds them ahead. The libraries link the OpenMP runtime
torch has already loaded (same soname), so their parallel loops run on the calling
thread's team instead of starting a second pool; ctypes releases the GIL for a call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger("prelude.kernels.cpu.native_lib")

FLAGS = ("-O3", "-march=native", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
# The same C for any AVX2+FMA CPU, without the host's wider paths: what tests build to
# check the AVX2 code on a machine whose native build takes the AVX-512 ones.
AVX2_FLAGS = tuple(f for f in FLAGS if f != "-march=native")


# PRELUDE_CPU_ISA=avx2: run as on an AVX2-only CPU, to measure that CPU's paths on a wider one.
# Every choice that reads the ISA flags sees no AVX-512 or AMX (dtype auto, float32's padding,
# the greedy head's bf16 pass), and the C kernels build without the host's wider paths. torch's
# own kernels read ATEN_CPU_CAPABILITY=avx2 (before torch is imported) and oneDNN's
# ONEDNN_MAX_CPU_ISA=AVX2: set them with it (the start-up log says what they are).
ISA_CAP_ENV = "PRELUDE_CPU_ISA"


def isa_capped_to_avx2() -> bool:
    return os.environ.get(ISA_CAP_ENV, "").lower() == "avx2"


def cpu_isa_flags() -> frozenset[str]:
    """The CPU's vector/matrix ISA extensions, as torch's cpuinfo names them (avx2,
    avx512_f, avx512_bf16, amx_bf16, ...); without the AVX-512 and AMX ones under
    PRELUDE_CPU_ISA=avx2."""
    found = _detected_isa_flags()
    if isa_capped_to_avx2():
        return frozenset(f for f in found if not f.startswith(("avx512", "amx")))
    return found


def _detected_isa_flags() -> frozenset[str]:
    """cpuinfo's flags through torch, else /proc/cpuinfo's."""
    try:
        caps = torch._C._cpu._get_cpu_capability()  # cpuinfo's view; private but stable since 2.3
        return frozenset(k for k, v in caps.items() if v is True)
    except (AttributeError, RuntimeError):
        pass
    flags = cpuinfo_field("flags")
    # /proc/cpuinfo spells them avx512f, avx512_bf16, amx_bf16.
    return frozenset(f.replace("avx512f", "avx512_f") for f in (flags or "").split())


def cpuinfo_field(name: str) -> str | None:
    """The first value /proc/cpuinfo gives for `name` (its first CPU's), None without one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return None


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor string (GenuineIntel, AuthenticAMD, ...), "" where /proc/cpuinfo
    does not say: what MKL's dispatch reads to pick its code paths."""
    return cpuinfo_field("vendor_id") or ""


def _cache_dir() -> Path:
    from prelude.cache_dirs import cache_root

    return cache_root() / "kernels"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_flags(flags: tuple[str, ...]) -> tuple[str, ...]:
    """The compiler flags a build takes: `flags`, less -march=native under PRELUDE_CPU_ISA=avx2."""
    return tuple(f for f in flags if f != "-march=native") if isa_capped_to_avx2() else flags


def source_text(source: Path) -> str:
    """`source` with the text of the local headers it includes (`#include "x.h"`, beside it):
    what its library is built from."""
    text = source.read_text()
    headers = re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, flags=re.MULTILINE)
    return "\n".join([text, *((source.parent / h).read_text() for h in headers)])


@functools.cache
def compiler_version(cc: str) -> str:
    """`cc --version`, asked once a process: every library's cache key holds it, and a
    start-up loads several libraries (a process spawn each, otherwise)."""
    return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout


def library_path(source: Path, cc: str, flags: tuple[str, ...] = FLAGS) -> Path:
    version = compiler_version(cc)
    isa = ",".join(sorted(cpu_isa_flags()))
    h = hashlib.sha256("\n".join([source_text(source), version, " ".join(flags), isa]).encode()).hexdigest()[:16]
    return _cache_dir() / f"{source.stem}-{h}.so"


def build(source: Path, flags: tuple[str, ...] = FLAGS) -> Path:
    """Compile `source` into the cache (atomically) unless it is there; the library's path."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc, or $CC)")
    flags = build_flags(flags)
    target = library_path(source, cc, flags)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *flags, str(source), "-o", str(out)], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(out, target)
    return target


def cpu_has_avx2_fma() -> bool:
    # torch's AVX2 level requires FMA as well; every level above it includes both.
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512", "AVX512_BF16", "AMX")


def answer(lib: ctypes.CDLL, name: str) -> int:
    """What the library's no-argument int function `name` answers (its probes: whether this
    build has the instructions a form needs, which form runs)."""
    fn = getattr(lib, name)
    fn.restype = ctypes.c_int
    return int(fn())


def address(fn: object) -> int:
    """A loaded library function's address, for C code that calls it (layer_loop.c)."""
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def load(source: Path, switch: str, what: str, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL | None:
    """`source`'s library, built on first use on this machine; None (with a log line naming
    `what` is off) when the environment variable `switch` is "0", without AVX2+FMA, or when
    it cannot be built or loaded. Loading an already built library is a dlopen."""
    if os.environ.get(switch, "1") == "0":
        return None
    if not cpu_has_avx2_fma():
        logger.info("%s off: this CPU has no AVX2+FMA", what)
        return None
    try:
        return ctypes.CDLL(str(build(source, flags)))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        logger.warning("%s off: %s", what, exc)
        return None
