"""The token memo (magclip/data/token_memo.py): the tokenizer's rows bit for bit, for open_clip's tokenizer and a
Hugging Face one; off (and still right) for a tokenizer that pads to the batch's longest; within its budget."""

from __future__ import annotations

import random

import pytest
import torch

from magclip.data.token_memo import TokenMemo

WORDS = "a red circle blue square small large green triangle above below left of the café naïve 😀".split()


def captions(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def batches(texts: list[str], size: int, seed: int = 1) -> list[list[str]]:
    """Batches drawn with repeats, as epochs over the same captions give them."""
    rng = random.Random(seed)
    return [[rng.choice(texts) for _ in range(size)] for _ in range(12)]


def open_clip_tokenizer():
    import open_clip

    return open_clip.get_tokenizer("RN50")


def hf_tokenizer():
    from transformers import AutoTokenizer

    from magclip.models.text import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("minilm"))  # the packaged all-MiniLM-L6-v2
    return lambda texts: tok(texts, padding="max_length", truncation=True, max_length=24, return_tensors="pt")["input_ids"]


@pytest.mark.parametrize("make", [open_clip_tokenizer, hf_tokenizer], ids=["open_clip", "hf_fixed_length"])
def test_the_memo_gives_the_tokenizers_rows(make):
    tokenizer = make()
    memo = TokenMemo(tokenizer, max_bytes=10**8)
    texts = captions(40)
    for batch in batches(texts, 16):
        assert torch.equal(memo(batch), tokenizer(batch))
    assert len(memo.rows) == len(set(texts) & {t for b in batches(texts, 16) for t in b})
    assert not memo.off


def test_a_tokenizer_padding_to_the_longest_turns_the_memo_off_and_stays_right():
    def to_longest(texts: list[str]) -> torch.Tensor:
        ids = [[len(w) for w in t.split()] for t in texts]
        out = torch.zeros(len(texts), max(map(len, ids)), dtype=torch.long)
        for i, row in enumerate(ids):
            out[i, :len(row)] = torch.tensor(row)
        return out

    memo = TokenMemo(to_longest, max_bytes=10**8)
    for batch in batches(captions(30), 8):
        assert torch.equal(memo(batch), to_longest(batch))
    assert memo.off and not memo.rows


def test_the_memo_keeps_to_its_budget_and_still_tokenizes_the_rest():
    tokenizer = open_clip_tokenizer()
    row_bytes = 77 * 8
    memo = TokenMemo(tokenizer, max_bytes=5 * (row_bytes + 300))
    texts = captions(20)
    for batch in batches(texts, 10):
        assert torch.equal(memo(batch), tokenizer(batch))
    assert 0 < len(memo.rows) <= 5 and memo.nbytes <= memo.max_bytes
