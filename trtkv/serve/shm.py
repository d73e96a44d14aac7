"""Keep tritonserver's /dev/shm regions private to the server's user, and remove them afterwards.

The Python backend creates its shared-memory regions with mode 0644 whatever the umask (boost
interprocess sets the mode explicitly), and those regions carry every request's prompt and every
response's text.  trtkv names the regions with a prefix it knows and takes group/other access
away as soon as they exist (before the model is ready, so before any prompt), then again
periodically for regions created later.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def regions(prefix: str) -> list[Path]:
    return sorted(SHM_DIR.glob(f"{prefix}*")) if SHM_DIR.is_dir() else []


def make_private(prefix: str) -> list[Path]:
    """chmod 0600 every region of `prefix` that others could read; returns those changed."""
    changed = []
    for path in regions(prefix):
        try:
            st = path.stat()
            if st.st_uid == os.getuid() and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                path.chmod(0o600)
                changed.append(path)
        except FileNotFoundError:  # removed meanwhile
            pass
    return changed


def remove(prefix: str) -> list[Path]:
    """Unlink the regions of `prefix` left behind (a crashed server cannot unlink its own)."""
    gone = []
    for path in regions(prefix):
        try:
            path.unlink()
            gone.append(path)
        except FileNotFoundError:
            pass
    return gone
