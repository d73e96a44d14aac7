"""The C++ CPU kernels are built at install (setup.py), a wheel's variant is picked by the CPU's flags, and the
first-use build of a source checkout never hangs on a killed build (plugins/cpu_kernels/build.py)."""
from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from plugins.cpu_kernels import variants as V

ROOT = Path(__file__).resolve().parents[1]
CXX = os.environ.get("CXX", "c++")
x86_compiler = pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which(CXX) is None,
                                  reason="needs an x86-64 C++ compiler")

# /proc/cpuinfo flags (the ISA part) of real CPUs, oldest first
SANDY_BRIDGE = ("fpu mmx fxsr sse sse2 ssse3 cx16 sse4_1 sse4_2 popcnt aes xsave avx lahf_lm pni pclmulqdq "
                "xsaveopt")
HASWELL = SANDY_BRIDGE + " fma movbe f16c rdrand abm avx2 bmi1 bmi2 fsgsbase erms invpcid"
SKYLAKE_SP = HASWELL + (" 3dnowprefetch adx rdseed clflushopt clwb avx512f avx512dq avx512cd avx512bw avx512vl "
                        "xsavec xsaves rtm hle mpx pku")
ICE_LAKE = SKYLAKE_SP + (" avx512ifma avx512vbmi avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg "
                         "avx512_vpopcntdq rdpid sha_ni")
ZEN2 = HASWELL + " 3dnowprefetch adx rdseed clflushopt clwb sha_ni xsavec xsaves rdpid sse4a clzero mwaitx"


def flags(line: str) -> frozenset[str]:
    return V.cpu_flags("flags\t\t: " + line)


def macros(march: list[str]) -> set[str]:
    return V.compiler_macros(CXX, march)


@pytest.fixture(scope="module")
def portable():
    """The portable variants as setup.py records them: requires = the compiler's ISA macros, mapped."""
    return [{"name": n, "module": V.module_name(n), "requires": V.compiler_isa_flags(CXX, V.MARCH[n]),
             "torch": "T", "sources": "S"} for n in V.expand("portable", "x86_64")]


# --- which paths each variant compiles, and what it needs -----------------------------------------------------
@x86_compiler
def test_portable_variants_compile_the_paths_the_csrc_has():
    """code_attention.h: AVX-512 F+BW+VBMI, else AVX2+FMA+F16C; paged_common.h: AVX-512 F+BW, else AVX2."""
    v4vbmi, v4, v3 = (macros(V.MARCH[n]) for n in ("x86-64-v4-vbmi", "x86-64-v4", "x86-64-v3"))
    assert {"AVX512F", "AVX512BW", "AVX512VBMI", "AVX2", "FMA", "F16C"} <= v4vbmi
    assert {"AVX512F", "AVX512BW", "AVX2", "FMA", "F16C"} <= v4 and "AVX512VBMI" not in v4
    assert {"AVX2", "FMA", "F16C"} <= v3 and "AVX512F" not in v3
    assert V.expand("portable", "x86_64") == ["x86-64-v4-vbmi", "x86-64-v4", "x86-64-v3"]
    assert V.expand("native,portable,native", "x86_64")[0] == "native" and V.expand("none") == []
    assert V.expand("portable", "aarch64") == ["generic"]
    with pytest.raises(ValueError, match="unknown variant"):
        V.expand("x86-64-v9", "x86_64")


@x86_compiler
def test_every_isa_macro_of_a_portable_variant_is_checked_at_import(portable):
    """Each instruction-set macro the compiler turns on for a variant maps to a cpuinfo flag it requires,
    so the import can never pick a variant whose instructions the CPU lacks."""
    not_isa = {m for m in macros(["-march=x86-64"]) if m not in V.ISA_MACROS}  # float model, ABI, OS macros
    for v in portable:
        isa = macros(V.MARCH[v["name"]]) - not_isa
        assert isa <= set(V.ISA_MACROS), f"{v['name']}: unmapped {sorted(isa - set(V.ISA_MACROS))}"
        assert {V.ISA_MACROS[m] for m in isa} == set(v["requires"])


@x86_compiler
@pytest.mark.parametrize("cpu,want", [(ICE_LAKE, "x86-64-v4-vbmi"), (SKYLAKE_SP, "x86-64-v4"), (HASWELL, "x86-64-v3"),
                                      (ZEN2, "x86-64-v3"), (SANDY_BRIDGE, None)])
def test_a_wheel_picks_the_best_variant_the_cpu_runs(portable, cpu, want):
    v, why = V.select(portable, flags(cpu), "T", None, machine="x86_64")
    assert (v and v["name"]) == want
    if want is None:  # every variant said why (the one log line at import)
        assert [w.split(":")[0] for w in why] == [p["name"] for p in portable]
        assert "CPU lacks" in why[-1] and "avx2" in why[-1]


@x86_compiler
def test_a_native_build_moved_to_an_older_cpu_is_skipped(portable):
    native = {"name": "native", "module": "_C_native", "requires": sorted(flags(ICE_LAKE) & set(V.ISA_MACROS.values())),
              "torch": "T", "sources": "S", "cpu_key": "x86_64_elsewhere"}
    v, why = V.select([native, *portable], flags(ICE_LAKE), "T", "S", machine="x86_64")
    assert v["name"] == "native" and why == []
    v, why = V.select([native, *portable], flags(HASWELL), "T", "S", machine="x86_64")
    assert v["name"] == "x86-64-v3" and why[0].startswith("native: CPU lacks")
    v, _ = V.select([native], flags(ICE_LAKE), "T", "S", key="x86_64_here", machine="aarch64")
    assert v is None  # off x86-64 (no macro map) a native build runs only on the CPU it was built on


def test_a_build_for_another_torch_or_older_sources_is_skipped():
    built = [{"name": "native", "module": "_C_native", "requires": [], "torch": "2.13.0", "sources": "S1"},
             {"name": "x86-64-v3", "module": "_C_x86_64_v3", "requires": [], "torch": "2.13.0", "sources": "S0"}]
    v, why = V.select(built, frozenset(), "2.14.0", "S1")
    assert v is None and all("built for torch 2.13.0" in w for w in why)
    v, why = V.select(built, frozenset(), "2.13.0", "S0")
    assert v["name"] == "x86-64-v3" and "older sources" in why[0]
    v, _ = V.select(built, frozenset(), "2.13.0", None)  # a wheel without sources: nothing to compare
    assert v["name"] == "native"


def test_source_hash_follows_every_source_and_header(tmp_path):
    for f in ("a.cpp", "b.h"):
        (tmp_path / f).write_text("x")
    h = V.source_hash(tmp_path)
    (tmp_path / "b.h").write_text("y")
    assert V.source_hash(tmp_path) != h


# --- what a process does at import ----------------------------------------------------------------------------
def _run(code: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRTKV_KERNELS": "auto", **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


IMPL = ("import torch, plugins.ops\nfrom plugins.backend import kernel_impl\n"
        "from plugins.cpu_kernels import build\nprint(kernel_impl(torch.zeros(1)))\n")


def test_the_installed_build_loads_without_compiling(tmp_path):
    """After `make setup` / `pip install`: an empty kernel cache and no compiler, and the kernels load at once."""
    from plugins.cpu_kernels.build import load_installed

    if load_installed()[0] is None:
        pytest.skip(f"no installed build fits here ({load_installed()[1]}): a source checkout without "
                    "`make setup`")
    cache = tmp_path / "cache"
    r = _run(IMPL, {"TRTKV_KERNEL_CACHE": str(cache), "CXX": str(tmp_path / "no-such-g++")})
    assert r.returncode == 0 and r.stdout.split() == ["cpu"], r.stderr
    assert _lines(r.stderr) == [] and not cache.exists()


def test_no_fitting_variant_is_one_line_and_the_reference(tmp_path):
    """A wheel none of whose variants this CPU runs (and no run-time build): one log line, then the reference."""
    (tmp_path / V.BUILD_INFO).write_text(json.dumps(
        [{"name": "x86-64-v9", "module": "_C_x86_64_v9", "requires": ["avx1024"], "torch": "T", "sources": "S"}]))
    code = f"from plugins.cpu_kernels import build\nbuild.PKG_DIR = build.Path({str(tmp_path)!r})\n" + IMPL
    r = _run(code, {"TRTKV_CPU_KERNELS_JIT": "0", "TRTKV_KERNEL_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0 and r.stdout.split() == ["reference"], r.stderr
    lines = _lines(r.stderr)
    assert len(lines) == 1 and "no compiled CPU kernels fit here (x86-64-v9: CPU lacks avx1024)" in lines[0], r.stderr


# --- the first-use build: a killed build never blocks the next one ----------------------------------------------
PROBE = textwrap.dedent("""\
    #include <Python.h>
    static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
    static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};
    static PyModuleDef def = {PyModuleDef_HEAD_INIT, "trtkv_probe", nullptr, -1, methods};
    PyMODINIT_FUNC PyInit_trtkv_probe(void) { return PyModule_Create(&def); }
    """)


@pytest.fixture
def probe(tmp_path):
    """A one-function extension (compiles in about a second) and a compiler wrapper that signals when a
    compile starts and can be held there: the first-use build's machinery without its minutes."""
    if shutil.which(CXX) is None:
        pytest.skip("no C++ compiler")
    pytest.importorskip("ninja")
    src = tmp_path / "src" / "probe.cpp"
    src.parent.mkdir()
    src.write_text(PROBE)
    slow = tmp_path / "slow-c++"
    slow.write_text(f"#!/bin/sh\necho $$ >> {tmp_path}/compiling\n"  # held until the test says go (or 120 s)
                    f"[ -n \"$PROBE_HOLD\" ] && for i in $(seq 1200); do [ -e {tmp_path}/go ] && break; sleep 0.1; done\n"
                    f"exec {shutil.which(CXX)} \"$@\"\n")
    slow.chmod(0o755)
    code = ("import sys\nfrom pathlib import Path\nfrom plugins.cpu_kernels.build import jit_build\n"
            f"m = jit_build([Path({str(src)!r})], name='trtkv_probe', out=Path({str(tmp_path / 'cache')!r}), "
            "cflags=['-O0'], ldflags=[])\nprint(m.answer())\n")
    yield tmp_path, slow, code
    for pid in _pids(tmp_path):  # a held compiler wrapper of a killed build
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _pids(d: Path) -> list[int]:
    f = d / "compiling"
    return [int(p) for p in f.read_text().split()] if f.exists() else []


def _start(code: str, env: dict) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _wait_compiling(d: Path, n: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(_pids(d)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the build never reached the compiler"
        time.sleep(0.05)


def test_a_build_killed_midway_leaves_the_next_one_working(probe):
    """kill -9 during the compile (the issue: the next process waited forever on torch's lock file, and the
    orphaned compiler kept going): the next process builds and loads in seconds, one line saying it compiles."""
    d, slow, code = probe
    first = _start(code, {"CXX": str(slow), "PROBE_HOLD": "1"})
    _wait_compiling(d, 1, first)
    first.kill()
    first.wait()
    r = _run(code, {"CXX": str(slow)}, timeout=120)  # was: no output, no end
    assert r.returncode == 0 and r.stdout.split() == ["42"], r.stderr
    lines = _lines(r.stderr)
    assert len(lines) == 1 and "compiling the CPU kernels" in lines[0], r.stderr
    left = sorted(p.name for p in (d / "cache").iterdir())
    assert not [n for n in left if n.startswith("work-")], left  # the killed build's directory is gone
    calls = len(_pids(d))
    r = _run(code, {"CXX": str(slow)}, timeout=120)  # built once: the next process only loads it
    assert r.returncode == 0 and r.stdout.split() == ["42"] and _lines(r.stderr) == [], r.stderr
    assert len(_pids(d)) == calls


@pytest.mark.timeout(300)
def test_a_second_process_waits_for_a_live_build_then_loads_it(probe):
    d, slow, code = probe
    first = _start(code, {"CXX": str(slow), "PROBE_HOLD": "1"})
    _wait_compiling(d, 1, first)
    second = _start(code, {"CXX": str(slow)})
    said = second.stderr.readline()  # blocks until the second process reports the wait (pytest-timeout bounds it)
    assert f"waiting for pid {first.pid}, which is compiling the CPU kernels" in said, said
    (d / "go").touch()
    out1, err1 = first.communicate(timeout=120)
    calls = len(_pids(d))
    out2, err2 = second.communicate(timeout=120)
    assert first.returncode == 0 and out1.split() == ["42"], err1
    assert second.returncode == 0 and out2.split() == ["42"] and _lines(err2) == [], err2
    assert len(_pids(d)) == calls  # compiled once, by the first


@pytest.mark.model
def test_trtkv_generate_killed_during_startup_leaves_the_next_run_working(tmp_path, engine_factory, tiny_ckpt):
    """Issue 38's reproduction: an empty kernel cache, `kill -9` of `trtkv generate` during start-up, and the
    next run answers (the kernels come from the install, so start-up compiles nothing)."""
    from plugins.cpu_kernels.build import load_installed

    if load_installed()[0] is None:
        pytest.skip("no installed build fits here: a source checkout without `make setup` compiles at first use")
    eng = engine_factory(tiny_ckpt, "full")
    env = {**os.environ, "TRTKV_KERNEL_CACHE": str(tmp_path / "cache"), "TRTKV_KERNELS": "auto"}
    cmd = [sys.executable, "-m", "trtkv.cli", "generate", str(eng), "--prompt", "hi", "--max-tokens", "4"]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    time.sleep(2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_real_first_use_build_killed_midway_then_rebuilt(tmp_path):
    """The same with the real kernels compiled at first use (TRTKV_CPU_KERNELS_JIT=1): minutes on 2 cores."""
    if shutil.which(CXX) is None:
        pytest.skip("no C++ compiler")
    cache = tmp_path / "cache"
    env = {"TRTKV_CPU_KERNELS_JIT": "1", "TRTKV_KERNEL_CACHE": str(cache)}
    first = _start(IMPL, env)
    deadline = time.monotonic() + 300
    while not list(cache.glob("*/work-*/build.ninja")):  # torch writes it, then runs ninja
        assert first.poll() is None, first.communicate()
        if time.monotonic() > deadline:
            first.kill()
            pytest.fail("the first-use build never started")
        time.sleep(0.5)
    time.sleep(5)  # the compilers are running
    first.kill()
    first.wait()
    r = _run(IMPL, env, timeout=1200)
    assert r.returncode == 0 and r.stdout.split() == ["cpu"], r.stderr
    assert [ln for ln in _lines(r.stderr) if "waiting" in ln] == []
