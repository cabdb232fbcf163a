#!/usr/bin/env bash
# The SQuAD text grid on one GPU machine that reaches no registry or hub, as one command < 9 minutes
# (configs/compare/text_squad_gpu.yaml). Here, once: `python tools/gpu_pack.py pack`; there, from the
# repository root, carrying .gpu/minilm16 .gpu/text_data.tar.gz .gpu/whl:
#   bash tools/gpu_text_grid.sh
# It installs the carried wheels, unpacks the model (fp32) and the data, mines the hard negatives of
# all 87,599 SQuAD train questions with MiniLM on the GPU, runs the 15 cells at once, stops them at
# GRID_TIMEOUT_S (default 420 s; run the script again to finish from their checkpoints), writes the
# report, and copies the report and every run's results (results.json, results.queries.npz) to $OUT
# when that is set.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 tools/gpu_pack.py unpack
if [ ! -f .gpu/squad_train_hn.jsonl ]; then
  python3 train/text.py --make-pairs .gpu/squad_train_hn.jsonl --beir .gpu/data/squad_train \
      --mine-with .gpu/minilm --negatives 3 --skip-top 2
fi
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv || true
timeout --signal=TERM "${GRID_TIMEOUT_S:-420}" \
    python3 eval/compare.py --grid configs/compare/text_squad_gpu.yaml --jobs 15 --no-plots \
  || echo "the grid stopped at GRID_TIMEOUT_S or a cell failed: run this script again to finish the missing cells"
report="${OUT:-runs/compare/text_squad_gpu}/results_text_squad_gpu.md"
python3 eval/compare.py --grid configs/compare/text_squad_gpu.yaml --only-report --no-plots --report "$report" \
    --overwrite-report || true
if [ -n "${OUT:-}" ]; then
  (cd runs/compare && find text_squad_gpu -name 'results.json' -o -name 'results.queries.npz' -o -name '*.log' \
      | tar cf - -T - | tar xf - -C "$OUT")
fi
