"""Loads the C++ CPU kernels built at install; compiles them at first use only in a source checkout without one.

``pip install`` / ``make setup`` compile the kernels (``setup.py``, torch's ``BuildExtension``) into
``plugins/cpu_kernels/_C_<variant>*.so`` with a ``_C_build.json`` saying what each variant needs from the
CPU (plugins/cpu_kernels/variants.py). The import loads the first variant that fits this CPU, this torch
and - where the sources are there to compare - these sources. So a trtkv process compiles nothing.

Only when no installed variant fits and the sources are here (a checkout used through ``PYTHONPATH``, or
sources edited since the install) does the first use compile them, with ``-march=native``, into
``~/.cache/trtkv/cpu_kernels/<arch>_<hash of the CPU flags>`` (``TRTKV_KERNEL_CACHE`` overrides the root),
one log line saying so. That build holds an ``flock`` (released by the kernel when its holder dies, so a
killed build never blocks the next one), compiles in a private ``work-<pid>`` directory seeded from the last
finished build (incremental), and publishes ``trtkv_cpu_kernels_<hash>.so`` by an atomic rename.
``TRTKV_CPU_KERNELS_JIT=1`` forces this path (ignores the installed builds), ``=0`` forbids it.

If nothing fits and nothing can be built (no compiler, no ninja, a wheel without sources) one log line says
so and the dispatcher falls back to the torch reference.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path
from types import ModuleType

from plugins.cpu_kernels import variants as V

log = logging.getLogger("trtkv")

CSRC = V.CSRC
PKG_DIR = Path(__file__).parent
SOURCES = V.SOURCES
CFLAGS = V.cflags("native")  # the first-use build's flags (torch adds -std, -fPIC and the defines)
JIT_NAME = "trtkv_cpu_kernels"  # TORCH_EXTENSION_NAME of the first-use build (PyInit_ symbol)
LOCK_TIMEOUT_S = float(os.environ.get("TRTKV_KERNEL_BUILD_TIMEOUT", "900"))


def _cpu_key() -> str:
    """Architecture plus a hash of the CPU feature flags (what ``-march=native`` compiles for)."""
    return V.cpu_key()


def build_dir() -> Path:
    root = Path(os.environ.get("TRTKV_KERNEL_CACHE", Path.home() / ".cache" / "trtkv" / "cpu_kernels"))
    return root / _cpu_key()


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled module, or None (logged once, one line) when none fits and none can be built here."""
    jit = os.environ.get("TRTKV_CPU_KERNELS_JIT", "auto")
    why = "forced by TRTKV_CPU_KERNELS_JIT=1"
    if jit != "1":
        mod, why = load_installed()
        if mod is not None:
            return mod
    if jit == "0" or not V.sources_present(CSRC):
        log.warning("trtkv: no compiled CPU kernels fit here (%s); using the slower torch reference kernels", why)
        return None
    try:
        return jit_build(why=why)
    except Exception as e:  # noqa: BLE001 - any build failure means: use the reference
        log.warning("trtkv: CPU kernels could not be built (%s); using the slower torch reference kernels",
                    _one_line(e))
        return None


def installed_variants(pkg_dir: Path | None = None) -> list[dict]:
    try:
        return json.loads(((pkg_dir or PKG_DIR) / V.BUILD_INFO).read_text())
    except (OSError, ValueError):
        return []


def load_installed(pkg_dir: Path | None = None) -> tuple[ModuleType | None, str]:
    """The best installed variant that fits, or ``(None, why not)``."""
    import torch

    built = installed_variants(pkg_dir)
    if not built:
        return None, "none built at install"
    sources = V.source_hash(CSRC) if V.sources_present(CSRC) else None
    why: list[str] = []
    while built:
        v, skipped = V.select(built, V.cpu_flags(), torch.__version__, sources, key=_cpu_key())
        why += skipped
        if v is None:
            break
        try:
            return importlib.import_module(f"{__package__}.{v['module']}"), ""
        except ImportError as e:
            why.append(f"{v['name']}: {_one_line(e)}")
            built = built[built.index(v) + 1:]
    return None, "; ".join(why) or "none built at install"


# --- first-use build (a source checkout without an install) ------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _BuildLock:
    """``flock`` on ``<dir>/build.lock``: the kernel drops it when its holder dies (kill -9 included), so a
    stale lock cannot exist; a live holder is waited for (one log line) up to ``timeout`` seconds."""

    def __init__(self, directory: Path, timeout: float):
        self.path, self.owner, self.timeout = directory / "build.lock", directory / "build.owner", timeout

    def __enter__(self):
        import fcntl

        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline, said = time.monotonic() + self.timeout, False
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise TimeoutError(f"another process ({self._holder()}) held {self.path} for "
                                       f"{self.timeout:.0f} s") from None
                if not said:
                    log.warning("trtkv: waiting for %s, which is compiling the CPU kernels in %s",
                                self._holder(), self.path.parent)
                    said = True
                time.sleep(0.2)
        self.owner.write_text(str(os.getpid()))
        return self

    def _holder(self) -> str:
        try:
            return f"pid {int(self.owner.read_text())}"
        except (OSError, ValueError):
            return "another process"

    def __exit__(self, *exc):
        import fcntl

        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def jit_key(sources: list[Path], cflags: list[str], ldflags: list[str]) -> str:
    import sys

    import torch

    h = hashlib.sha256(f"{torch.__version__} {sys.version} {cflags} {ldflags} {os.environ.get('CXX', 'c++')}"
                       .encode())
    for p in sorted(sources) + sorted(p for p in sources[0].parent.glob("*.h")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def _import_so(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def jit_build(sources: list[Path] | None = None, name: str = JIT_NAME, out: Path | None = None,
              cflags: list[str] = CFLAGS, ldflags: list[str] = V.LDFLAGS, why: str = "") -> ModuleType:
    """Compile ``sources`` once per (sources, flags, torch) into ``out`` and import the result."""
    sources = sources or [CSRC / s for s in SOURCES]
    out = out or build_dir()
    final = out / f"{name}_{jit_key(sources, cflags, ldflags)}.so"
    if final.exists():
        return _import_so(name, final)
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler {cxx!r} on PATH; install g++ or set CXX")
    import ninja  # noqa: F401  (torch drives the build with the ninja binary)

    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and shutil.which("ninja") is None:
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    out.mkdir(parents=True, exist_ok=True)
    with _BuildLock(out, LOCK_TIMEOUT_S):
        if final.exists():  # built by the process we waited for
            return _import_so(name, final)
        log.warning("trtkv: compiling the CPU kernels for this CPU into %s (once; %s; `make setup` or "
                    "`pip install --no-build-isolation -e .` builds them at install)", out, why or "not installed")
        for d in out.glob("work-*"):  # left by a killed build: its pid is gone and we hold the lock
            pid = d.name.removeprefix("work-")
            if not pid.isdigit() or not _pid_alive(int(pid)):
                shutil.rmtree(d, ignore_errors=True)
        work = out / f"work-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        last = out / "work"
        if last.is_dir():  # ninja rebuilds only what changed since the last finished build
            shutil.copytree(last, work, ignore=shutil.ignore_patterns("lock", "*.so"))
        else:
            work.mkdir()
        mod = _torch_load(name, sources, cflags, ldflags, work)
        tmp = out / f".{final.name}.{os.getpid()}"
        shutil.copy2(work / f"{name}.so", tmp)
        os.replace(tmp, final)
        old = out / f"work-old-{os.getpid()}"
        if last.is_dir():
            os.replace(last, old)
        os.replace(work, last)
        shutil.rmtree(old, ignore_errors=True)
        return mod


def _torch_load(name: str, sources: list[Path], cflags: list[str], ldflags: list[str], work: Path) -> ModuleType:
    from torch.utils.cpp_extension import load

    torch_log = logging.getLogger("torch.utils.cpp_extension")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)  # its compiler-ABI banners are not ours to print
    try:
        return load(name=name, sources=[str(s) for s in sources], extra_cflags=cflags, extra_ldflags=ldflags,
                    extra_include_paths=[str(sources[0].parent)], build_directory=str(work), verbose=False)
    finally:
        torch_log.setLevel(level)


def cpu_kernels_available() -> bool:
    return cpu_kernels() is not None
