"""Builds trtkv's C++ CPU kernels (plugins/cpu_kernels/csrc) at install, with torch's BuildExtension.

Everything else about the package is in pyproject.toml. The kernels compile against the torch they will
run with, so torch must be importable by the build: install torch first, then install trtkv without
pip's build isolation (an isolated build would fetch some other torch, gigabytes of CUDA wheels, whose
ABI the installed torch need not share)::

    pip install torch==2.13.0 "setuptools>=68" ninja
    pip install --no-build-isolation -e ".[gguf,test,serve,onnx]"     # what `make setup` runs

``TRTKV_CPU_ARCH`` picks the variants (plugins/cpu_kernels/variants.py):
  native (default)  ``-march=native``: for the machine that installs (an editable or local install);
  portable          x86-64-v4 + VBMI, x86-64-v4, x86-64-v3 (``generic`` off x86-64): a wheel for other
                    machines, e.g. ``TRTKV_CPU_ARCH=portable pip wheel --no-build-isolation --no-deps .``;
  a comma list      of variant names, e.g. ``native,portable``;
  none              no compiled kernels (every CPU call runs the slower torch reference).
The import picks the first variant whose instruction sets the CPU has (plugins/cpu_kernels/build.py).
"""
from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
PKG = "plugins.cpu_kernels"


def _variants():
    spec = importlib.util.spec_from_file_location("_trtkv_cpu_variants", HERE / "plugins/cpu_kernels/variants.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


V = _variants()
NO_TORCH = f"""
trtkv: the C++ CPU kernels are compiled at install, against the torch that will run them, and this build
cannot import torch ({{err}}). pip's build isolation hides the installed torch from the build; install
torch first and then trtkv without isolation:
    {sys.executable} -m pip install torch "setuptools>=68" ninja
    {sys.executable} -m pip install --no-build-isolation .      (or -e .; `make setup` does this)
or install without the compiled kernels (CPU decoding on the slower torch reference kernels):
    TRTKV_CPU_ARCH=none {sys.executable} -m pip install .
"""
NO_CXX = """
trtkv: no C++ compiler {cxx!r} on PATH to build the CPU kernels at install. Install g++ (or set CXX), or
install a wheel built elsewhere with TRTKV_CPU_ARCH=portable, or install without the compiled kernels:
TRTKV_CPU_ARCH=none pip install ...
"""


def _extensions_and_cmdclass():
    try:
        names = V.expand(os.environ.get("TRTKV_CPU_ARCH", "native"))
    except ValueError as e:
        sys.exit(f"trtkv: {e}")
    if not names:
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as e:
        sys.exit(NO_TORCH.format(err=e))
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        sys.exit(NO_CXX.format(cxx=cxx))
    csrc = "plugins/cpu_kernels/csrc"
    exts = [CppExtension(f"{PKG}.{V.module_name(n)}", sources=[f"{csrc}/{s}" for s in V.SOURCES],
                         include_dirs=[str(HERE / csrc)], extra_compile_args=V.cflags(n), extra_link_args=V.LDFLAGS,
                         depends=sorted(str(p.relative_to(HERE)) for p in (HERE / csrc).glob("*.h")))
            for n in names]

    class BuildCpuKernels(BuildExtension):
        """BuildExtension with the first-use build's exact compiler command, one temp dir per variant, and a
        ``_C_build.json`` beside the modules saying what each variant needs from the CPU."""

        def build_extensions(self):
            # Python's own CFLAGS (-g -fwrapv -Wall ..., from sysconfig) are not the kernels' flags: the
            # compiler sees what torch.utils.cpp_extension.load gave it, so the code is the same.
            for attr, cmd in (("compiler_so", [cxx, "-fPIC"]), ("compiler_so_cxx", [cxx, "-fPIC"]),
                              ("compiler_cxx", [cxx]), ("linker_so", [cxx, "-shared"]),
                              ("linker_so_cxx", [cxx, "-shared"])):
                if hasattr(self.compiler, attr):
                    self.compiler.set_executable(attr, cmd)
            super().build_extensions()

        def build_extension(self, ext):
            temp = self.build_temp
            self.build_temp = os.path.join(temp, ext.name)  # variants compile the same sources to other .o
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = temp

        def run(self):
            super().run()
            sources = V.source_hash(HERE / csrc)
            info = []
            for n in names:
                v = {"name": n, "module": V.module_name(n), "cflags": V.cflags(n), "torch": torch.__version__,
                     "sources": sources, "requires": V.compiler_isa_flags(cxx, V.MARCH[n]) if platform.machine()
                     == "x86_64" else [], "machine": platform.machine()}
                if n == "native":
                    v["cpu_key"] = V.cpu_key()
                info.append(v)
            text = json.dumps(info, indent=1) + "\n"
            inplace, self.inplace = self.inplace, False
            dirs = {os.path.dirname(self.get_ext_fullpath(exts[0].name))}
            self.inplace = inplace
            if inplace:
                dirs.add(self.get_finalized_command("build_py").get_package_dir(PKG))
            for d in dirs:
                os.makedirs(d, exist_ok=True)
                Path(d, V.BUILD_INFO).write_text(text)

    return exts, {"build_ext": BuildCpuKernels}


ext_modules, cmdclass = _extensions_and_cmdclass()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
