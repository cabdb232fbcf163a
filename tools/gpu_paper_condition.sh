#!/usr/bin/env bash
# The paper's condition (parts 1 and 2) on one GPU machine that reaches no registry or hub, as one
# command under 9 minutes: the budget curve (configs/compare/text_squad_long_gpu.yaml: cosine, dot and
# qnorm x 3 seeds, an epoch of SQuAD train each, evaluated after steps 160, 500, 1,000, 1,500 and the
# last) and then the pretraining-geometry grid (configs/compare/text_geometry_gpu.yaml: the seed-0 cosine
# and dot final models fine-tuned on SciFact with 5 modes x 3 seeds), with the budget figure and the
# interaction table. Here, once: `python tools/gpu_pack.py pack`; there, from the repository root,
# carrying .gpu/minilm16 .gpu/text_data.tar.gz .gpu/whl:
#   bash tools/gpu_paper_condition.sh
# The hard negatives are the committed mining (docs/data/squad_train_hn_all.ids.jsonl.gz, no mining
# there). Each grid stops at its timeout (LONG_TIMEOUT_S 300, GEOMETRY_TIMEOUT_S 150); a second run of
# the script continues the cells from their checkpoints. Reports and every run's results go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 tools/gpu_pack.py unpack
if [ ! -f .gpu/squad_train_hn_all.jsonl ]; then
  python3 train/text.py --make-pairs .gpu/squad_train_hn_all.jsonl --beir .gpu/data/squad_train \
      --negatives-from docs/data/squad_train_hn_all.ids.jsonl.gz
fi
out="${OUT:-runs/compare}"
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv || true
timeout --signal=TERM "${LONG_TIMEOUT_S:-300}" \
    python3 eval/compare.py --grid configs/compare/text_squad_long_gpu.yaml --jobs 9 --no-plots \
  || echo "the long grid stopped at LONG_TIMEOUT_S or a cell failed: run this script again to continue it"
python3 eval/budget.py --grid configs/compare/text_squad_long_gpu.yaml --report "$out/results_text_budget_gpu.md" \
    --figure "$out/text_budget_gpu.png" --out "$out/results_text_budget_gpu.json" || true
timeout --signal=TERM "${GEOMETRY_TIMEOUT_S:-150}" \
    python3 eval/compare.py --grid configs/compare/text_geometry_gpu.yaml --jobs 30 --no-plots \
  || echo "the geometry grid stopped at GEOMETRY_TIMEOUT_S or a cell failed (or the long runs are unfinished)"
python3 eval/compare.py --grid configs/compare/text_geometry_gpu.yaml --only-report --no-plots \
    --report "$out/results_text_geometry_gpu.md" --overwrite-report || true
python3 eval/interaction.py --grid configs/compare/text_geometry_gpu.yaml --baseline-start cosine \
    --report "$out/results_text_geometry_gpu_interaction.md" --out "$out/results_text_geometry_gpu_interaction.json" || true
if [ -n "${OUT:-}" ]; then
  (cd runs/compare && find text_squad_long_gpu text_geometry_gpu \( -name 'results.json' -o -name '*.queries.npz' \
      -o -name 'step_*.json' -o -name '*.log' \) | tar cf - -T - | tar xf - -C "$OUT")
fi
