"""The CLIP model options shared by the zero-shot and suite commands.

Light on purpose: a command parses and checks its arguments with this module, and imports torch and the
model code only in `load_clip_model`, after its inputs were checked.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from magclip.cli import UsageError, check_scorer_flags
from magclip.modes import MODES

if TYPE_CHECKING:
    from magclip.evaluation.checkpoint import EvalModel


def add_clip_model_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("model (one of --checkpoint or --model)")
    src.add_argument("--checkpoint", help="magclip run folder, checkpoint step folder, or its weights file")
    src.add_argument("--model", help="open_clip model name / magclip/models/configs name / JSON config / "
                                     "local-dir:FOLDER")
    src.add_argument("--pretrained", help="with --model: open_clip pretrained tag or a local weights file")
    src.add_argument("--mode", choices=MODES, help="score both directions with this mode (default: the "
                     "checkpoint's own scorers; for --model, those of a magclip.json beside its weights "
                     "(local-dir:STEP, or STEP's own weights file), else cosine)")
    src.add_argument("--gamma-q", type=float, help="with --mode fixed/learnable")
    src.add_argument("--gamma-d", type=float, help="with --mode fixed/learnable")


def check_clip_model_arguments(args: argparse.Namespace) -> None:
    if bool(args.checkpoint) == bool(args.model):
        raise UsageError("give exactly one of --checkpoint or --model")
    if args.pretrained and not args.model:
        raise UsageError("--pretrained goes with --model (a checkpoint's weights come from --checkpoint)")
    check_scorer_flags(args.mode, args.gamma_q, args.gamma_d)


def load_clip_model(args: argparse.Namespace, device: str) -> EvalModel:
    """The model and its scorers: a magclip checkpoint, or open_clip weights (magclip.evaluation.checkpoint)."""
    from magclip.evaluation.checkpoint import load_checkpoint, load_open_clip

    if args.checkpoint:
        return load_checkpoint(args.checkpoint, mode=args.mode, gamma_q=args.gamma_q, gamma_d=args.gamma_d,
                               device=device)
    return load_open_clip(args.model, args.pretrained, mode=args.mode, gamma_q=args.gamma_q, gamma_d=args.gamma_d,
                          device=device)
