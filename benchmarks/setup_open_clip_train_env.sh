#!/usr/bin/env bash
# open_clip_train's own environment for bench_train.py: the interpreter's packages (torch, open_clip_torch,
# timm, transformers) plus what open_clip_torch's [training] extra adds: pandas, fsspec and
# webdataset<=0.2.86 (open_clip pins it: newer webdataset breaks its group_by_keys_nothrow, issue #935).
# magclip itself runs on current webdataset 1.x outside this venv.
#   bash benchmarks/setup_open_clip_train_env.sh            # -> $OPEN_CLIP_TRAIN_VENV or ~/.cache/magclip-bench/open_clip_train_venv
set -euo pipefail
VENV="${OPEN_CLIP_TRAIN_VENV:-$HOME/.cache/magclip-bench/open_clip_train_venv}"
PY="${PYTHON:-python}"
"$PY" -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install --quiet "webdataset==0.2.86" pandas fsspec
"$VENV/bin/python" -c "import webdataset, pandas, open_clip_train.main, torch; print('open_clip_train env ok:', '$VENV', 'webdataset', webdataset.__version__, 'torch', torch.__version__)"
