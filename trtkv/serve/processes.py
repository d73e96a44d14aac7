"""Find and end the processes a tritonserver leaves behind (its Python-backend stubs).

A stub whose tritonserver crashed is re-parented and keeps ~1 GB and its shared memory; it ignores
SIGTERM.  The launchers note the stubs while tritonserver is healthy and SIGKILL any still alive
once tritonserver has exited, checking the command line first so a recycled pid is never hit.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def _stat_fields(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int(_stat_fields(int(p.name))[1]) == pid:
                    out.append(int(p.name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every live descendant."""
    out, todo = {}, [pid]
    while todo:
        for child in children(todo.pop()):
            out[child] = cmdline(child)
            todo.append(child)
    return out


def kill_leftovers(noted: dict[int, str]) -> list[int]:
    """SIGKILL the noted processes that still run the same command line; returns those killed."""
    killed = []
    for pid, cmd in noted.items():
        if cmd and cmdline(pid) == cmd:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
    return killed
