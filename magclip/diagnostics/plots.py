"""matplotlib, set up once for every figure magclip writes (diagnostics, grid reports): the headless Agg
backend (a training node or CI has no display) and an atomic save, so a reader never sees half a PNG."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

DPI = 110


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, imported on first use (a command that plots nothing never loads it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path) -> Path:
    """Write `fig` to `path` through a temporary file renamed into place, and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=DPI)
    pyplot().close(fig)
    tmp.replace(path)
    return path


def panels(n: int, cols: int = 3) -> tuple[Any, list[Any]]:
    """A figure of `n` panels, up to `cols` a row, and its first `n` axes (the rest hidden): one
    panel per metric, as the budget and interaction figures draw."""
    cols = max(1, min(cols, n))
    rows = math.ceil(n / cols)
    fig, axes = pyplot().subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)[:n]
