"""magclip: embedding magnitude in contrastive learning (CLIP and text retrieval).

The public names are imported on first use, so that `import magclip.config` (and every command's
argument and config checks) runs without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
_PUBLIC = {"CLIPLoss": "magclip.losses", "LogitScale": "magclip.temperature", "MODES": "magclip.modes",
           "Scorer": "magclip.similarity", "default_logit_scale": "magclip.temperature"}
__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'magclip' has no attribute {name!r}")
