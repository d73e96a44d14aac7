"""Builds the C++ CPU kernels at first use (``torch.utils.cpp_extension.load``) and caches the binary.

Built at first use rather than at install so one source tree serves every machine with the flags of the
machine it runs on (``-march=native``): the cache directory is keyed by the CPU's architecture and
feature flags, so a home directory shared between an AVX-512 host and an older one never loads a binary
with instructions the CPU lacks. torch rebuilds on its own when a source file or flag changes. If the
build cannot run (no compiler, no ninja, no headers) the kernels report unavailable once, in one log
line, and the dispatcher falls back to the torch reference.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path
from types import ModuleType

log = logging.getLogger("trtkv")

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("bindings.cpp", "paged_attention.cpp", "kv_write.cpp", "kmeans_select.cpp", "buffer_attention.cpp",
           "rotary.cpp", "residual_append.cpp")
# -fno-trapping-math: without it gcc leaves the softmax's exp (codecs.h exp_neg, with its clamp and
# select) scalar on AVX2 ("control flow in loop"); with it the same operations vectorize, giving the same
# bits (no reassociation, no change of rounding) 8 lanes at a time. trtkv never reads the FP status flags.
CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-DNDEBUG"]  # torch adds -std and ABI flags


def _cpu_key() -> str:
    """Architecture plus a hash of the CPU feature flags (what ``-march=native`` compiles for)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()}_{hashlib.sha1(flags.encode()).hexdigest()[:10]}"


def build_dir() -> Path:
    root = Path(os.environ.get("TRTKV_KERNEL_CACHE", Path.home() / ".cache" / "trtkv" / "cpu_kernels"))
    return root / _cpu_key()


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled module, or None (logged once, one line) when it cannot be built on this machine."""
    try:
        return _build()
    except Exception as e:  # noqa: BLE001 - any build failure means: use the reference
        text = " ".join(str(e).split()) or type(e).__name__
        reason = text if len(text) <= 160 else text[:157] + "..."
        log.warning("trtkv: CPU kernels could not be built (%s); using the slower torch reference kernels", reason)
        return None


def _build() -> ModuleType:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler {cxx!r} on PATH; install g++ or set CXX")
    import ninja  # noqa: F401  (torch drives the build with the ninja binary)
    from torch.utils.cpp_extension import load

    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and shutil.which("ninja") is None:
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    torch_log = logging.getLogger("torch.utils.cpp_extension")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)  # its compiler-ABI banners are not ours to print
    try:
        return load(name="trtkv_cpu_kernels", sources=[str(CSRC / s) for s in SOURCES], extra_cflags=CFLAGS,
                    extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)], build_directory=str(out),
                    verbose=False)
    finally:
        torch_log.setLevel(level)


def cpu_kernels_available() -> bool:
    return cpu_kernels() is not None
