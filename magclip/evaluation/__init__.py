"""The evaluation layer: CLIP retrieval (training validation and zero-shot), zero-shot classification,
the emoji benchmark, text BEIR/STS and RAG retrieval. It never imports magclip.training."""

ZEROSHOT_TASKS = ("retrieval", "classification")  # here, torch-free: the zero-shot command's --help needs no torch
