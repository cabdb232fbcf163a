"""matplotlib, set up once for every figure magclip writes (diagnostics, grid reports): the headless Agg
backend (a training node or CI has no display) and an atomic save, so a reader never sees half a PNG."""

from __future__ import annotations

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
