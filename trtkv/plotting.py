"""matplotlib for the PNG plots of bench, eval and search: headless (Agg), imported only when a plot is drawn."""
from __future__ import annotations

from pathlib import Path

MiB = 2**20


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path, plt) -> Path:
    """Write ``fig`` to ``path`` and close it (pyplot keeps every open figure alive)."""
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
