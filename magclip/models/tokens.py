"""How many captions a CLIP text tower cuts: open_clip's tokenizers truncate silently to the context.

Why it matters: captions longer than the context are cut to their first tokens; two long captions that
share them get identical embeddings, and a retrieval set of such captions scores ties, not a model.
Evaluation counts them (`long_captions`) and says so in the log and the results.

Token counts include the start and end tokens, as the tokenizers place them: open_clip's
`SimpleTokenizer` (every OpenAI-style tower) keeps `context_length` tokens, the last replaced by the end
token; a Hugging Face tokenizer behind open_clip's `HFTokenizer`/`SigLipTokenizer` truncates to
`context_length` with its own special tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("magclip.evaluation")


def caption_token_counts(tokenizer: Any, captions: Sequence[str]) -> list[int] | None:
    """Untruncated token counts of `captions` under an open_clip tokenizer, special tokens included; None for a
    tokenizer of another kind (or one with a reduction strategy instead of truncation)."""
    if getattr(tokenizer, "reduction_fn", None) is not None:
        return None
    encode = getattr(tokenizer, "encode", None)
    if callable(encode) and hasattr(tokenizer, "sot_token_id"):  # open_clip.SimpleTokenizer
        return [len(encode(c)) + 2 for c in captions]
    hf = getattr(tokenizer, "tokenizer", None)
    if hf is not None and callable(hf):  # open_clip.HFTokenizer / SigLipTokenizer: the transformers tokenizer
        clean = getattr(tokenizer, "clean_fn", None) or (lambda text: text)
        return [len(ids) for ids in hf([clean(c) for c in captions], truncation=False)["input_ids"]]
    return None


def long_captions(tokenizer: Any, captions: Sequence[str]) -> dict[str, int]:
    """{"long_captions": how many captions the tokenizer truncates, "longest_caption_tokens": the longest
    caption's tokens, "context_length": the tower's context}; {} where the counts are unknown. A warning
    is logged when any caption is cut."""
    context = getattr(tokenizer, "context_length", None)
    counts = caption_token_counts(tokenizer, captions) if context else None
    if not counts:
        return {}
    cut = sum(n > context for n in counts)
    longest = max(counts)
    if cut:
        log.warning("%d of %d captions are longer than the text tower's context of %d tokens (the longest has %d) "
                    "and are truncated as open_clip does: captions that share their first %d tokens get identical "
                    "embeddings", cut, len(counts), context, longest, context)
    return {"long_captions": int(cut), "longest_caption_tokens": int(longest), "context_length": int(context)}
