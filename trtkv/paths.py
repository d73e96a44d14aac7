"""Where trtkv keeps things: the repository's configs, the model cache."""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
CONFIGS_DIR = REPO_ROOT / "configs"


def cache_dir() -> Path:
    """Model cache: ``$TRTKV_CACHE`` or ``~/.cache/trtkv``."""
    return Path(os.environ.get("TRTKV_CACHE", Path.home() / ".cache" / "trtkv"))
