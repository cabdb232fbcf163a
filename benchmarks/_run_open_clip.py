"""Child process: one open_clip_train run (`open_clip_train.main.main(argv)`, the 3.x trainer shipped
in open_clip_torch), timed per step by the same optimizer hook as magclip.

Not meant to be run by hand; `bench_train.py` starts it. The model config is registered first
with `open_clip.add_model_config` (through magclip's `register_model_configs`, which only resolves
`pkg:` placeholders and calls that), then open_clip_train runs unmodified.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import StepClock, gpu_peak_mb, peak_rss_mb, steady_rate, train_child_parser, write_json


def main() -> None:
    p = train_child_parser()
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--measure", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--shim-missing-deps", action="store_true",
                   help="run without open_clip's [training] extra: stub pandas (used only by its CSV datasets) and "
                        "adapt open_clip_train to webdataset 1.x (its end-of-shard marker, open_clip issue #935)")
    p.add_argument("--open-clip-args", default="",
                   help="more open_clip_train arguments (shell words), after the ones here: a later flag wins")
    p.add_argument("--out", required=True)
    p.add_argument("--workdir", required=True)
    a = p.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    shimmed = _shim_training_extra() if a.shim_missing_deps else []
    from magclip.models.clip import register_model_configs

    register_model_configs()
    from open_clip_train import main as oc_main

    # the same hyper-parameters magclip's engine uses (AdamW betas/eps, weight decay, clip 1.0)
    argv = [
        "--train-data", a.data, "--train-num-samples", str(a.num_samples), "--dataset-type", "webdataset",
        "--batch-size", str(a.batch_size), "--precision", a.precision, "--workers", str(a.workers),
        "--model", a.model, "--epochs", str(a.epochs), "--lr", "0.001", "--warmup", "10", "--wd", "0.1",
        "--beta1", "0.9", "--beta2", "0.98", "--eps", "1e-6", "--grad-clip-norm", "1.0",
        "--report-to", "", "--save-frequency", "0", "--logs", f"{a.workdir}/logs", "--name", "bench",
        "--device", a.device, "--seed", "0", "--log-every-n-steps", "10", *shlex.split(a.open_clip_args),
    ]
    clock = StepClock()
    rc = oc_main.main(argv)
    clock.close()
    if rc not in (None, 0):
        raise SystemExit(f"open_clip_train returned {rc}")
    rate = steady_rate(clock.times, a.batch_size, a.skip, a.measure)
    write_json(a.out, {"contender": "open_clip_train", "mode": "cosine (ClipLoss)", "world_size": 1, "rank": 0,
                       "steps": len(clock.times),
                       "threads": torch.get_num_threads(), "workers": a.workers, "batch_size": a.batch_size,
                       "precision": a.precision, "model": a.model, **rate, **peak_rss_mb(), **gpu_peak_mb(),
                       "shimmed": shimmed})


def _shim_training_extra() -> list[str]:
    """Run open_clip_train in an environment without its [training] extra; returns what was adapted.

    - pandas: open_clip_train.data imports it at the top, but only its CsvDataset uses it. Import
      open_clip_train with a placeholder module, then take the placeholder out of sys.modules so
      that no other library mistakes it for pandas.
    - webdataset 1.x: `tar_file_expander` yields an empty dict at the end of every shard, which
      open_clip's `group_by_keys_nothrow` reads as a file (KeyError 'fname', open_clip issue #935,
      the reason for its webdataset<=0.2.86 pin). Pass eof_value=None, as the old version behaved.
    """
    import inspect
    import types
    from functools import partial

    done = []
    try:
        import pandas  # noqa: F401
    except ImportError:
        import open_clip  # noqa: F401  (imports torchvision and torch._dynamo, which probe installed modules)
        import torch._dynamo  # noqa: F401

        sys.modules["pandas"] = types.ModuleType("pandas")
        try:
            import open_clip_train.main  # noqa: F401
        finally:
            del sys.modules["pandas"]
        done.append("pandas stubbed")
    import open_clip_train.data as ocd
    from webdataset import tariterators

    if "eof_value" in inspect.signature(tariterators.tar_file_expander).parameters:
        ocd.tar_file_expander = partial(tariterators.tar_file_expander, eof_value=None)
        done.append("webdataset tar_file_expander eof_value=None")
    return done


if __name__ == "__main__":
    main()
