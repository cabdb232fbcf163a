"""Zero-shot retrieval and classification, scored with the evaluated model's own Scorer.

Installed as `magclip-zeroshot` (the same arguments); every option: --help (magclip/cli/zeroshot.py).

    python eval/zeroshot.py --checkpoint runs/emoji --data '../shared/data/emoji/id_novel-000000.tar' --out results.json
    python eval/zeroshot.py --checkpoint runs/emoji/checkpoints/step_00000250 --data SHARDS --mode qnorm --out r.json \\
        --save-embeddings emb/
    python eval/zeroshot.py --checkpoint runs/emoji --data id=SHARDS_A --data ood=SHARDS_B --out r.json
    python eval/zeroshot.py --checkpoint runs/emoji --emoji ../shared/data/emoji --out runs/emoji/zeroshot.json
    python eval/zeroshot.py --checkpoint runs/x --data 'val-{000..003}.tar' --task classification \\
        --classes classnames.txt --templates openai --out r.json
    python eval/zeroshot.py --checkpoint runs/x --data SHARDS --classes classes.jsonl --class-name-field name \\
        --class-key-field id --label-field class_id --out r.json
    python eval/zeroshot.py --checkpoint runs/x --data eurosat=~/data/eurosat/test --classes en_classnames.json \\
        --templates en_zeroshot_classification_templates.json --out r.json
    python eval/zeroshot.py --model tiny-resnet --mode qnorm --data ~/data/pets/test --templates 'a photo of a {c}.' \\
        --out /tmp/r.json
    python eval/zeroshot.py --model ViT-B-32 --pretrained laion2b_s34b_b79k --mode cosine --data SHARDS --out r.json
    python eval/zeroshot.py --model tiny-resnet --mode qnorm --emoji ../shared/data/emoji --out /tmp/r.json

--data DIR with class sub-folders of images (torchvision's ImageFolder, CLIP_benchmark's --dataset_root) is
classified over its folders; --classes / --templates take CLIP_benchmark's JSON files ({data set: [...]},
"{c}" templates), picking the entry named like the set (NAME=, else the folder) or --class-set KEY.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.cli.zeroshot import console, main  # noqa: E402,F401  (main: for callers)

if __name__ == "__main__":
    console()
