"""Which compiled variants of the CPU kernels exist, which one fits this CPU (pure Python, no torch).

Shared by ``setup.py`` (loaded by path at build time, so no import of ``plugins`` or torch here) and
``build.py`` (at import). A variant is one build of the same sources with one set of ``-march`` flags:

- ``native``: ``-march=native``, what ``make setup`` / ``pip install -e .`` / ``pip install .`` build by
  default - the machine that installs is the machine that runs, and the per-CPU golden tokens of the
  2-/4-bit formats are recorded against exactly these flags;
- ``x86-64-v4-vbmi``, ``x86-64-v4``, ``x86-64-v3``: portable builds for a wheel that other machines install
  (``TRTKV_CPU_ARCH=portable``). The csrc picks its paths by preprocessor macros: AVX-512 F+BW (+VBMI for
  attention on the 4-/2-bit codes), else AVX2+FMA+F16C, else portable scalar code; these three give every
  combination of those paths. ``generic`` (no ``-march``) is the portable build off x86-64.

What a variant needs from the CPU is derived at build time from the compiler itself: the instruction-set
macros it defines under the variant's flags (``c++ -dM -E``), mapped to the Linux ``/proc/cpuinfo`` flag
names. At import the first variant (best first) whose needs are a subset of this CPU's flags, built against
this torch and from these sources, is loaded - so a wheel never executes an instruction the CPU lacks.
"""
from __future__ import annotations

import hashlib
import platform
import subprocess
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
BUILD_INFO = "_C_build.json"  # beside the compiled modules: [{name, module, cflags, requires, torch, sources, ...}]
# -fno-trapping-math: without it gcc leaves the softmax's exp (codecs.h exp_neg, with its clamp and
# select) scalar on AVX2 ("control flow in loop"); with it the same operations vectorize, giving the same
# bits (no reassociation, no change of rounding) 8 lanes at a time. trtkv never reads the FP status flags.
# torch (JIT) / BuildExtension add -std=c++20 -fPIC and the defines; setup.py drops Python's own CFLAGS
# (-g -fwrapv -Wall ...), so the compiler sees the same flags either way.
BASE_CFLAGS = ["-O3", "-fno-trapping-math", "-fopenmp", "-DNDEBUG"]
LDFLAGS = ["-fopenmp"]
SOURCES = ("bindings.cpp", "paged_attention.cpp", "kv_write.cpp", "kmeans_select.cpp", "lowest_victim.cpp",
           "table_victims.cpp",
           "scatter_add_rows.cpp", "gather_rows.cpp", "mri_track.cpp", "head_sums.cpp", "table_positions.cpp",
           "held_columns.cpp", "compact_slots.cpp", "buffer_attention.cpp", "rotary.cpp", "residual_append.cpp",
           "int8_linear.cpp", "int4_linear.cpp", "rms_norm.cpp", "gather_keys.cpp", "registrations.cpp")
MARCH = {
    "native": ["-march=native"],
    "x86-64-v4-vbmi": ["-march=x86-64-v4", "-mavx512vbmi"],
    "x86-64-v4": ["-march=x86-64-v4"],
    "x86-64-v3": ["-march=x86-64-v3"],
    "x86-64-v2": ["-march=x86-64-v2"],  # the scalar paths; opt-in (not in "portable")
    "generic": [],
}
PORTABLE = {"x86_64": ["x86-64-v4-vbmi", "x86-64-v4", "x86-64-v3"]}  # best first; other machines: generic

# gcc's instruction-set macros -> Linux /proc/cpuinfo flag names (x86-64). A macro left out here is not
# checked at import: tests/test_cpu_kernel_build.py asserts every portable variant's macros are mapped. SHSTK
# is left out on purpose: gcc never emits shadow-stack instructions unasked, and Zen 3/4 VMs report the CPU's
# CET without the kernel's ``user_shstk`` (a native build there would otherwise never load).
ISA_MACROS = {
    "MMX": "mmx", "FXSR": "fxsr", "SSE": "sse", "SSE2": "sse2", "SSE3": "pni", "SSSE3": "ssse3",
    "SSE4_1": "sse4_1", "SSE4_2": "sse4_2", "CRC32": "sse4_2", "POPCNT": "popcnt", "LAHF_SAHF": "lahf_lm",
    "SSE4A": "sse4a", "AVX": "avx", "AVX2": "avx2", "FMA": "fma", "FMA4": "fma4", "XOP": "xop", "F16C": "f16c",
    "BMI": "bmi1", "BMI2": "bmi2", "LZCNT": "abm", "ABM": "abm", "MOVBE": "movbe", "TBM": "tbm",
    "XSAVE": "xsave", "XSAVEOPT": "xsaveopt", "XSAVEC": "xsavec", "XSAVES": "xsaves",
    "AVX512F": "avx512f", "AVX512BW": "avx512bw", "AVX512CD": "avx512cd", "AVX512DQ": "avx512dq",
    "AVX512VL": "avx512vl", "AVX512VBMI": "avx512vbmi", "AVX512VBMI2": "avx512_vbmi2",
    "AVX512IFMA": "avx512ifma", "AVX512VNNI": "avx512_vnni", "AVX512BITALG": "avx512_bitalg",
    "AVX512VPOPCNTDQ": "avx512_vpopcntdq", "AVX512BF16": "avx512_bf16", "AVX512FP16": "avx512_fp16",
    "AVX512VP2INTERSECT": "avx512_vp2intersect", "AVX512ER": "avx512er", "AVX512PF": "avx512pf",
    "AVX5124FMAPS": "avx512_4fmaps", "AVX5124VNNIW": "avx512_4vnniw",
    "AVXVNNI": "avx_vnni", "AVXIFMA": "avx_ifma", "AVXVNNIINT8": "avx_vnni_int8", "AVXNECONVERT": "avx_ne_convert",
    "AMX_TILE": "amx_tile", "AMX_INT8": "amx_int8", "AMX_BF16": "amx_bf16", "AMX_FP16": "amx_fp16",
    "GFNI": "gfni", "VAES": "vaes", "VPCLMULQDQ": "vpclmulqdq", "PCLMUL": "pclmulqdq", "AES": "aes",
    "SHA": "sha_ni", "ADX": "adx", "RDRND": "rdrand", "RDSEED": "rdseed", "RDPID": "rdpid",
    "PRFCHW": "3dnowprefetch", "CLFLUSHOPT": "clflushopt", "CLWB": "clwb", "MOVDIRI": "movdiri",
    "MOVDIR64B": "movdir64b", "CLDEMOTE": "cldemote", "SERIALIZE": "serialize", "TSXLDTRK": "tsxldtrk",
    "RTM": "rtm", "HLE": "hle", "FSGSBASE": "fsgsbase", "WAITPKG": "waitpkg", "CLZERO": "clzero",
    "MWAITX": "mwaitx", "PKU": "pku", "ENQCMD": "enqcmd", "WBNOINVD": "wbnoinvd",
    "PTWRITE": "ptwrite", "PCONFIG": "pconfig", "UINTR": "uintr", "HRESET": "hreset", "SGX": "sgx",
    "GCC_HAVE_SYNC_COMPARE_AND_SWAP_16": "cx16", "FP_FAST_FMA": "fma", "FP_FAST_FMAF": "fma",
    "FP_FAST_FMAF32": "fma", "FP_FAST_FMAF64": "fma", "FP_FAST_FMAF32x": "fma",
}


def cflags(variant: str) -> list[str]:
    """The compiler flags of a variant, in the order the first-use build has always used."""
    return [BASE_CFLAGS[0], *MARCH[variant], *BASE_CFLAGS[1:]]


def cpuinfo_line() -> str:
    """The ``flags`` (x86) / ``Features`` (arm) line of /proc/cpuinfo, or the processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_flags(line: str | None = None) -> frozenset[str]:
    line = cpuinfo_line() if line is None else line
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def cpu_key(line: str | None = None) -> str:
    """Architecture plus a hash of the CPU feature flags (what ``-march=native`` compiles for)."""
    line = cpuinfo_line() if line is None else line
    return f"{platform.machine()}_{hashlib.sha1(line.encode()).hexdigest()[:10]}"


def source_hash(csrc: Path = CSRC) -> str:
    """Hash of every C++ source and header (and the base flags): what a build is "fresh" against."""
    h = hashlib.sha256(" ".join(BASE_CFLAGS + LDFLAGS).encode())
    for p in sorted(csrc.glob("*")):
        if p.suffix in (".cpp", ".h"):
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def sources_present(csrc: Path = CSRC) -> bool:
    return any(csrc.glob("*.cpp"))


def module_name(variant: str) -> str:
    return "_C_" + variant.replace("-", "_")


def expand(spec: str, machine: str | None = None) -> list[str]:
    """``TRTKV_CPU_ARCH`` -> variant names: ``native`` (default), ``portable``, ``none``, or a comma list."""
    machine = machine or platform.machine()
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        names = PORTABLE.get(machine, ["generic"]) if part == "portable" else [] if part in ("none", "") else [part]
        for n in names:
            if n not in MARCH:
                raise ValueError(f"TRTKV_CPU_ARCH: unknown variant {n!r}; one of native, portable, none, "
                                 f"{', '.join(k for k in MARCH if k != 'native')}")
            if n.startswith("x86-64") and machine != "x86_64":
                raise ValueError(f"TRTKV_CPU_ARCH: {n} is an x86-64 variant and this machine is {machine}")
            if n not in out:
                out.append(n)
    return out


def compiler_macros(cxx: str, march: list[str]) -> set[str]:
    """The compiler's predefined ``__NAME__`` macros under ``march``, without the underscores."""
    r = subprocess.run([cxx, *march, "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True, text=True,
                       check=True)
    return {ln.split()[1].strip("_") for ln in r.stdout.splitlines() if ln.startswith("#define __")}


def compiler_isa_flags(cxx: str, march: list[str]) -> list[str]:
    """The cpuinfo flags a build with ``march`` may use: the compiler's ISA macros, mapped."""
    return sorted({ISA_MACROS[m] for m in compiler_macros(cxx, march) if m in ISA_MACROS})


def select(variants: list[dict], flags: frozenset[str], torch_version: str, sources: str | None,
           key: str | None = None, machine: str | None = None) -> tuple[dict | None, list[str]]:
    """The first installed variant that fits (``variants`` are best first), and why each before it did not.

    Fits: every flag it ``requires`` is in ``flags``; built against ``torch_version``; built from the same
    ``sources`` hash when the sources are there to compare (a source checkout); a ``native`` build off
    x86-64 (no macro map) only on a CPU with the same ``key``."""
    machine = machine or platform.machine()
    why: list[str] = []
    for v in variants:
        missing = sorted(set(v.get("requires", ())) - flags)
        if missing:
            why.append(f"{v['name']}: CPU lacks {' '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        elif v.get("torch") != torch_version:
            why.append(f"{v['name']}: built for torch {v.get('torch')}, this is {torch_version}")
        elif sources is not None and v.get("sources") != sources:
            why.append(f"{v['name']}: built from older sources than plugins/cpu_kernels/csrc")
        elif v["name"] == "native" and machine != "x86_64" and key is not None and v.get("cpu_key") != key:
            why.append(f"{v['name']}: built on another CPU ({v.get('cpu_key')})")
        else:
            return v, why
    return None, why
