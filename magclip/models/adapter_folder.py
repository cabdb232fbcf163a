"""A peft adapter folder given as the model: adapter_config.json + the adapter's weights over a base.

`PeftModel.save_pretrained` writes only the adapter and names its base (`base_model_name_or_path`).
sentence-transformers reads such a folder with `load_adapter` over the base model, and peft with
`PeftModel.from_pretrained(base, folder)`; magclip does the same: the base is loaded as any model is
(`BiEncoder.from_pretrained`), then peft applies the adapter to each tower and merges it into the weights
(`merge_and_unload`: the outputs are the adapter model's). A base that is neither a local folder nor in
the hub cache cannot be read offline: refused in one line naming the folder and the base.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_folder(folder: Path) -> bool:
    """peft's folder: its config, and no model of its own (config.json / modules.json) beside it."""
    return (folder / ADAPTER_CONFIG).is_file() and not (folder / "config.json").is_file() \
        and not (folder / "modules.json").is_file()


def adapter_base(folder: Path, resolve) -> str:
    """The base model's local path (`resolve` maps magclip's aliases), or a one-line refusal."""
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{folder}: a peft adapter whose {ADAPTER_CONFIG} names no base_model_name_or_path; "
                         "load the base with model.name and the adapter over it")
    resolved = str(resolve(base))
    for candidate in (Path(resolved).expanduser(), folder / resolved):
        if candidate.is_dir():
            return str(candidate)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(resolved, local_files_only=True)
    except Exception:  # noqa: BLE001 (not cached, not a repository name, no hub package: all the same here)
        raise ValueError(f"{folder}: a peft adapter over the base {base!r}, which is not available offline (not a "
                         "local folder, not in the hub cache); download the base and set its folder as "
                         f"base_model_name_or_path in {folder / ADAPTER_CONFIG}") from None


def merged_with_adapter(tower: nn.Module, folder: Path) -> nn.Module:
    """The tower with the folder's adapter applied by peft and merged into its weights."""
    from peft import PeftModel

    try:
        adapted = PeftModel.from_pretrained(tower, str(folder))
    except Exception as exn:  # noqa: BLE001 (peft's errors name neither the folder nor the tower)
        first = " ".join(str(exn).split())[:300]
        raise ValueError(f"{folder}: the peft adapter does not fit its base ({type(exn).__name__}: {first})") from None
    return adapted.merge_and_unload()
