#!/usr/bin/env bash
# train.sharding=fsdp on one GPU machine, all its GPUs, as one command under 9 minutes (issues 50 and 62, the GPU
# form of benchmarks/bench_sharding_memory.py): first a ~7.1 B decoder embedder + LoRA r=16 under fsdp (built on the
# meta device, each rank filling its shards; a checkpoint of the adapters alone, no merged model, and a sharded
# evaluation, each timed), then a randomly initialised ViT-L-14 CLIP and a ~1.1 B Qwen3 decoder embedder under fsdp
# with bf16, then the same two under ddp as the reference while the budget lasts; memory per
# GPU (torch.cuda.max_memory_allocated / reserved, the sharded state from engine.sharding.memory_record) and
# samples/s over 10 steps after 3 warm-up steps, into $OUT/gpu_sharding.json (benchmarks/bench_gpu_sharding.py).
# With one GPU it runs at world size 1 and says that fsdp does not shard there.
#
# What it needs there: this checkout (magclip/ and benchmarks/; no data, no weights, nothing downloaded) and a
# Python with torch (CUDA), torchvision, timm, transformers (Qwen3), accelerate, numpy, pyyaml, pillow, regex,
# tqdm, huggingface_hub and safetensors (the GPU image has them all). What such an image lacks travels as
# wheels in .gpu/whl: open_clip_torch==3.3.0, ftfy==6.3.1, wcwidth==0.7.0 (open_clip's), webdataset==1.0.2,
# braceexpand==0.1.7 (magclip.training.clip imports magclip.data). Here, once, either
#   python tools/gpu_pack.py pack          # .gpu/whl holds these five (+ pytrec-eval-terrier; also the text grid's model and data)
# or only the wheels:
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       --platform any -d .gpu/whl open_clip_torch==3.3.0 ftfy==6.3.1 wcwidth==0.7.0 webdataset==1.0.2 braceexpand==0.1.7
# There, from the repository root, carrying .gpu/whl (~2 MB):
#   bash tools/gpu_sharding.sh                       # extra arguments go to bench_gpu_sharding.py, e.g. --clip-model ViT-H-14
# SHARDING_TIMEOUT_S (default 480) bounds the torchrun; SHARDING_BUDGET_S (default 360) is the point after which
# no further run starts. The JSON is rewritten after every run, so a cut-off keeps what was measured.
set -euo pipefail
cd "$(dirname "$0")/.."
site=""
if compgen -G ".gpu/whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
  site="/tmp/site:"
fi
export PYTHONPATH="${site}$PWD" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ! python3 -c "import open_clip, webdataset, accelerate, transformers" 2>/dev/null; then
  echo "error: open_clip_torch or webdataset (or accelerate, transformers) is missing: carry .gpu/whl (see the top of $0)" >&2
  exit 2
fi
gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -lt 1 ]; then echo "error: nvidia-smi lists no GPU" >&2; exit 2; fi
[ "$gpus" -eq 1 ] && echo "one GPU: world size 1, where train.sharding=fsdp does not shard (the rows show fsdp's code path on a replica)"
out="${OUT:-runs/gpu_sharding}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
timeout --signal=TERM --kill-after=20 "${SHARDING_TIMEOUT_S:-480}" \
    python3 -m torch.distributed.run --standalone --nproc_per_node "$gpus" benchmarks/bench_gpu_sharding.py \
    --out "$out/gpu_sharding.json" --budget-s "${SHARDING_BUDGET_S:-360}" "$@" 2>&1 | tee "$out/gpu_sharding.log" \
  || echo "stopped at SHARDING_TIMEOUT_S or a run failed: $out/gpu_sharding.json holds the runs that finished"
