"""The model options shared by the text evaluation commands (beir, sts, rag).

Light on purpose: a command parses and checks its arguments and input paths with this module, and
imports torch and the model code only after that (`load_model_and_scorers`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from magclip.cli import check_scorer_flags
from magclip.config import EVAL_PRECISIONS, POOLINGS
from magclip.modes import MODES

if TYPE_CHECKING:
    import torch

    from magclip.models.text import BiEncoder
    from magclip.similarity import Scorer


def model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="minilm", help="minilm, a model folder, or a hub name (default: %(default)s)")
    parser.add_argument("--mode", nargs="+", choices=MODES, default=None,
                        help="scoring mode(s); default: the model's own")
    parser.add_argument("--gamma-q", type=float, default=None, help="exponent for --mode fixed/learnable")
    parser.add_argument("--gamma-d", type=float, default=None)
    parser.add_argument("--split", default="test")
    parser.add_argument("--out", required=True, help="results JSON")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--precision", choices=EVAL_PRECISIONS, default="fp32",
                        help="encoding precision (auto: bf16 where the device computes it natively; scores stay "
                             "float32); default: %(default)s")
    parser.add_argument("--pooling", choices=POOLINGS, default=None, help="override the model's pooling")
    parser.add_argument("--query-prefix", default=None)
    parser.add_argument("--passage-prefix", default=None)
    parser.add_argument("--query-max-length", type=int, default=None)
    parser.add_argument("--passage-max-length", type=int, default=None)
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=sys.stderr.isatty(),
                        help="encoding progress bars (default: on when stderr is a terminal)")


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, then check the scoring flags as every evaluation command does (`check_scorer_flags`), before
    any input or model is looked at."""
    args = parser.parse_args(argv)
    check_scorer_flags(args.mode, args.gamma_q, args.gamma_d)
    return args


def load_model_and_scorers(args) -> tuple[BiEncoder, list[Scorer]]:
    """The model and its Scorers (the flags were checked by `parse_args`)."""
    from magclip.evaluation.text import text_scorers
    from magclip.models.text import BiEncoder

    model = BiEncoder.from_pretrained(args.model, pooling=args.pooling, query_prefix=args.query_prefix,
                                      passage_prefix=args.passage_prefix, query_max_length=args.query_max_length,
                                      passage_max_length=args.passage_max_length)
    model.encode_dtype = encoding_dtype(args)
    return model, text_scorers(model, args.mode, args.gamma_q, args.gamma_d)


def encoding_dtype(args) -> torch.dtype | None:
    """bf16 for `--precision bf16` (or `auto` on a device with native bf16), None for fp32; logged."""
    import torch

    from magclip.training.levers import resolve_precision

    precision, why = resolve_precision(args.precision, torch.device(device_of(args)))
    logging.getLogger("magclip.cli").info("encoding precision: %s (%s)", precision, why)
    return torch.bfloat16 if precision == "bf16" else None


def device_of(args) -> str:
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")
