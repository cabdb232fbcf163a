"""The retrieval side of RAG on QA folders: answer recall@k and gold-passage accuracy@1.

Installed as `magclip-rag` (the same arguments); every option: --help (magclip/cli/rag.py).

    python eval/rag.py --model minilm --data ../shared/data/text/xquad_en --out results/rag_xquad_minilm.json
    python eval/rag.py --model minilm --data ../shared/data/text/xquad_en --mode cosine dot qnorm dnorm \
        --distractors ../shared/data/text/scifact --out results/rag_xquad_scifact.json   # a harder pool
    python eval/rag.py --model minilm --data ../shared/data/text/xquad_en --out results/rag_gen.json \
        --generator /path/to/local/causal-lm --k-ctx 3 --max-new-tokens 16 --max-questions 200
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.cli.rag import console, main  # noqa: E402,F401  (main: for callers)

if __name__ == "__main__":
    console()
