"""STS files: TSV with a header naming `score`, `sentence1`, `sentence2` (any column order), tab
separated, no quoting (the layout of ../shared/data/text/stsb); a malformed line is an error naming it."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class STSData:
    name: str
    sentence1: list[str]
    sentence2: list[str]
    scores: np.ndarray


def read_sts(path: str | Path, name: str | None = None) -> STSData:
    path = Path(path)
    s1, s2, gold = [], [], []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        missing = {"score", "sentence1", "sentence2"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: header {reader.fieldnames} lacks {sorted(missing)}")
        for number, row in enumerate(reader, start=2):
            if row["sentence1"] is None or row["sentence2"] is None:
                raise ValueError(f"{path}:{number}: expected 3 tab-separated fields")
            s1.append(row["sentence1"])
            s2.append(row["sentence2"])
            gold.append(float(row["score"]))
    return STSData(name or path.stem, s1, s2, np.asarray(gold, dtype=np.float64))
