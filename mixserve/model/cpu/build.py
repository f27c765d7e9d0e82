"""Builds the C++ CPU kernels (csrc/: paged attention, small layer ops) once per machine; loads them (ctypes).

The kernels have a plain C ABI and include no torch header, so g++ builds them in ~30 s with no
ninja and no torch build machinery; `pip install` stays compiler-free. The library is cached under
$MIXSERVE_CACHE (default ~/.cache/mixserve), keyed by the source, the flags, the compiler and the CPU's
flags: `-march=native` code built on one CPU never runs on another. A machine without a compiler gets
KernelBuildError, and the caller falls back to the reference backend with one warning.

$MIXSERVE_KERNEL_MARCH (default `native`) builds them for another -march instead, for a CPU that has it:
`haswell` runs the AVX2 code on an AVX-512 machine (the tests do, so the AVX2 path is checked everywhere;
its timings there show AVX2-only slowdowns, as the one that made AVX2's chunk attention 22x slower).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("mixserve")

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "paged_attention.cpp", CSRC / "layer_ops.cpp", CSRC / "few_row_linear.cpp",
           CSRC / "quant_linear.cpp", CSRC / "quant_panels.cpp", CSRC / "quant_int8_panels.cpp",
           CSRC / "decode_layers.cpp", CSRC / "moe_experts.cpp")
HEADERS = tuple(sorted(CSRC.glob("*.h")))  # every header keys the cache: an edit to any one rebuilds
# The parts of -ffast-math the kernel wants (reassociated sums vectorise; it uses no infinities), named
# one by one: -ffast-math itself links crtfastmath.o, whose start-up code turns on flush-to-zero and
# denormals-are-zero for the whole process once the library loads, changing everyone else's numerics.
# -fopenmp: the library shares torch's libgomp (same soname, already loaded), so torch's threads run it.
FLAGS = ("-O3", "-march=@", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
         "-fassociative-math", "-freciprocal-math", "-ffinite-math-only", "-fopenmp", "-std=c++17",
         "-shared", "-fPIC", "-Wno-psabi")  # -march=@: $MIXSERVE_KERNEL_MARCH, else native

_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# Every function takes a dtype code first (0 float32, 1 bfloat16) and returns 0 or an error code (the one
# query, mixserve_few_row_panel_width, takes nothing and returns a width).
SIGNATURES = {
    "mixserve_paged_attention": [_I] + [_P] * 7 + [_I64] * 10 + [_F, _I, _I64, _F],
    "mixserve_store_kv": [_I, _P, _P] + [_I64] * 4 + [_P, _P, _P] + [_I64] * 3,
    "mixserve_rms_norm": [_I, _P, _I64, _P, _P, _P, _I64, _I64, _F, _I],
    "mixserve_rotary": [_I, _P] + [_I64] * 5 + [_P, _P, _P, _I],
    "mixserve_silu_and_mul": [_I, _P, _P, _I64, _I64, _I],
    "mixserve_gelu_tanh_and_mul": [_I, _P, _P, _I64, _I64, _I],
    "mixserve_few_row_panel_width": [],
    "mixserve_few_row_max_rows": [_I, _I64],
    "mixserve_few_row_pack": [_I, _P, _I64, _I64, _P],
    "mixserve_few_row_linear": [_I, _P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I],
    "mixserve_quant_linear": [_I, _P, _I64, _I64, _P, _I64, _I64, _I64, _P, _P, _P, _I64, _I, _I],
    "mixserve_quant_decode_rows": [_I, _P, _I64, _I64, _P, _P, _I64, _I64, _P, _I64, _I],
    "mixserve_quant_panel_linear": [_I, _P, _I64, _I64, _P, _I64, _I64, _I64, _P, _P, _P, _I64, _I],
    "mixserve_quant_panel_linear_bf16": [_I, _P, _I64, _I64, _P, _I64, _I64, _I64, _P, _P, _P, _I64, _I],
    "mixserve_quant_int8_panel_linear": [_I, _P, _I64, _I64, _P, _I64, _I64, _I64, _P, _P, _P, _I64, _I],
    "mixserve_decode_layers": [_P, _P, _I64, _P, _P, _P, _P, _P, _P, _I],
    "mixserve_moe_experts": [_P, _P, _I64, _P, _I, _P, _P, _P, _P, _I64, _I64, _I, _P, _I],
    "mixserve_moe_dispatch": [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _I],
    "mixserve_moe_combine": [_I, _P, _P, _P, _I64, _I64, _I64, _P, _I],
    "mixserve_kernel_isa": [],
}
# mixserve_kernel_isa's bits: the extensions the library was compiled for (not the CPU's: see kernel_isa)
ISA_BITS = (("avx2", 1), ("avx512f", 2), ("avx512_bf16", 4), ("amx_bf16", 8))


class KernelBuildError(RuntimeError):
    """The CPU kernel could not be built or loaded here (no compiler, a failed build, a bad library)."""


def cache_dir() -> Path:
    """$MIXSERVE_CACHE, else $XDG_CACHE_HOME/mixserve, else ~/.cache/mixserve."""
    if os.environ.get("MIXSERVE_CACHE"):
        return Path(os.environ["MIXSERVE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mixserve"


def march() -> str:
    """The -march this process builds the kernels for: $MIXSERVE_KERNEL_MARCH, else native."""
    return os.environ.get("MIXSERVE_KERNEL_MARCH") or "native"


def flags() -> list[str]:
    """FLAGS with the -march this process builds for."""
    return [f.replace("@", march()) if f.startswith("-march=") else f for f in FLAGS]


def cpu_flags() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them ("" where there is no such file)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise KernelBuildError("no C++ compiler found (g++ or $CXX)")
    return cxx


def library_path() -> Path:
    """Where the built library for this source, compiler and CPU lives (built or not)."""
    cxx = _compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"C++ compiler {cxx} does not run: {e}") from None
    texts = [f.read_text() for f in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, " ".join(flags()), version, cpu_flags(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    return cache_dir() / f"cpu_kernels-{key}.so"


def _build(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the CPU kernels (once per machine): %s", target)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([_compiler(), *flags(), "-o", tmp, *map(str, SOURCES)], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no output"])[0]
            raise KernelBuildError(f"building the CPU kernels failed: {first}")
        os.replace(tmp, target)  # atomic: a concurrent builder never loads a half-written library
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"building the CPU kernels failed: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load_library() -> ctypes.CDLL:
    """The kernel library, built first if this machine has none yet; KernelBuildError if it cannot be."""
    target = library_path()
    if not target.exists():
        _build(target)
    try:
        lib = ctypes.CDLL(str(target))
        for name, argtypes in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
    except (OSError, AttributeError) as e:
        raise KernelBuildError(f"loading {target} failed: {e}") from None
    return lib


def reset() -> None:
    """Forget the loaded library, so the next call loads the build for the -march set now (tests of both
    builds in one process: the native one and $MIXSERVE_KERNEL_MARCH=haswell's AVX2 code)."""
    load_library.cache_clear()
    available.cache_clear()


def kernel_isa() -> frozenset[str]:
    """The ISA extensions the loaded library was compiled for (empty where it does not load): what decides
    which code runs is the build, which on an AVX-512 CPU may be the AVX2 one."""
    try:
        bits = int(load_library().mixserve_kernel_isa())
    except KernelBuildError:
        return frozenset()
    return frozenset(name for name, bit in ISA_BITS if bits & bit)


def describe() -> str:
    """One line for a bench's header: the -march and the extensions the kernels were built with."""
    why_not = available()
    if why_not is not None:
        return f"none ({why_not})"
    isa = kernel_isa()
    return f"-march={march()}: " + ("+".join(n for n, _ in ISA_BITS if n in isa) or "no AVX2")


@functools.cache
def available() -> str | None:
    """None when the kernels load here, else why not (one line); builds them on first call."""
    try:
        load_library()
    except KernelBuildError as e:
        return str(e)
    return None
