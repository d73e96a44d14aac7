"""Every module of trtkv/ and plugins/ imports on its own, in a fresh interpreter (tests/import_each_module.py:
one process that imports torch and numpy, then forks a child per module)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("import_each_module.py")


def test_every_module_imports_on_its_own():
    p = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, "modules that fail to import on their own:\n" + p.stdout + p.stderr[-2000:]
    assert "modules imported on their own" in p.stderr
