"""magclip: embedding magnitude in contrastive learning (CLIP and text retrieval)."""

from magclip.losses import CLIPLoss
from magclip.similarity import MODES, Scorer
from magclip.temperature import LogitScale, default_logit_scale

__version__ = "0.1.0"
__all__ = ["CLIPLoss", "LogitScale", "MODES", "Scorer", "default_logit_scale", "__version__"]
