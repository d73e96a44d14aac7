"""Import every module of trtkv/ and plugins/ on its own, each in a fresh interpreter state.

Run as a script (``python tests/import_each_module.py``; tests/test_imports.py does): this process imports
only the heavy third-party libraries every module needs anyway (torch, numpy), then forks one child per
module, which imports that module and nothing else first. A module that works only when another trtkv
module happened to be imported before it (an import cycle resolved by luck, a name taken from a partially
initialised module) fails here. Prints one line per failure, ``module: last line of the error``; exit 1 if any.
"""
from __future__ import annotations

import os
import select
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("trtkv", "plugins")
PER_MODULE_TIMEOUT_S = 180
# modules that run only inside Triton's Python backend stub, next to `triton_python_backend_utils` and the
# files `trtkv deploy` / PyTriton copy into the model repository (the serve tests start them there)
INSIDE_TRITON = {"trtkv.serve.triton_model", "trtkv.serve.pytriton_proxy"}


def module_names() -> list[str]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            if "__pycache__" not in parts and ".".join(parts) not in INSIDE_TRITON:
                out.append(".".join(parts))
    return out


def _child(name: str, wfd: int) -> None:
    code = 0
    try:
        import importlib

        importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001 - report whatever it was
        msg = f"{type(e).__name__}: {e}".strip().splitlines()
        os.write(wfd, (msg[-1] if msg else type(e).__name__).encode()[:2000])
        code = 1
    os._exit(code)


def run(names: list[str], jobs: int) -> dict[str, str]:
    """``{module: error}`` of the modules that fail to import on their own."""
    failures: dict[str, str] = {}
    pending = list(reversed(names))
    running: dict[int, tuple[str, int, float]] = {}  # pid -> (module, read end, start)
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop()
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                _child(name, w)
            os.close(w)
            running[pid] = (name, r, time.monotonic())
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            for p, (name, r, t0) in list(running.items()):
                if time.monotonic() - t0 > PER_MODULE_TIMEOUT_S:
                    os.kill(p, 9)
            select.select([], [], [], 0.02)
            continue
        name, r, _ = running.pop(pid)
        msg = os.read(r, 4096).decode(errors="replace")
        os.close(r)
        if os.waitstatus_to_exitcode(status) != 0:
            failures[name] = msg or f"exit status {os.waitstatus_to_exitcode(status)} (timeout or crash)"
    return failures


def main() -> int:
    sys.path.insert(0, str(ROOT))
    import numpy  # noqa: F401 - the heavy libraries every module imports anyway, loaded once before forking
    import torch  # noqa: F401

    names = module_names()
    t0 = time.monotonic()
    failures = run(names, jobs=max(1, min(4, os.cpu_count() or 1)))
    for name, msg in sorted(failures.items()):
        print(f"{name}: {msg}")
    print(f"{len(names) - len(failures)} of {len(names)} modules imported on their own "
          f"({time.monotonic() - t0:.1f} s)", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
