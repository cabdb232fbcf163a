"""Reliability: bad data, faults and resume -- nothing lost, nothing silent.

The rows of the reliability issue that other files do not already prove (see the table in the
closing note of the issue): damaged tars and decompression bombs in a real training run, bounded
memory on a bomb, non-finite loss and gradients, kill -9 and a full disk while a checkpoint is
written, evaluation of a checkpoint with the wrong model config, a training shard that does not
exist, two processes with fewer shards than ranks, and atomic results files.

Every run is a real `train_clip` on a few 8x8 PNG shards built in tmp_path with the tiny ResNet
(in-process), or `train/clip.py` in a subprocess where a kill or torchrun is needed.
"""

from __future__ import annotations

import errno
import functools
import importlib.util
import itertools
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from pathlib import Path

import open_clip
import pytest
import torch
from torchvision import transforms as T

import magclip.io
import magclip.training.engine
from magclip.training import clip as clip_training
from magclip.training.clip import CLIPTrainModule, train_clip
from magclip.config import load_config
from magclip.data.shards import build_clip_loader, epoch_order
from magclip.training.engine import CheckpointWriteError, NonFiniteLossError
from magclip.io import DamagedFileError, UnsafeFileError, atomic_torch_save, atomic_write_json
from magclip.models.clip import (
    CHECKPOINT_META,
    CONFIG_DIR,
    OPEN_CLIP_CONFIG,
    WEIGHTS_FILE,
    create_clip,
    save_checkpoint_for_open_clip,
)
from magclip.evaluation.checkpoint import load_checkpoint, resolve_checkpoint
from builders import crafted_torch_file, free_port, good, load_weights, max_difference, png, write_tar

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "train" / "clip.py"
STEPS = 4  # clean data: 2 shards x 32 samples, batch 16

needs_dev_full = pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full to fill a 'disk'")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def clean_shards(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("clean")
    for s in range(2):
        write_tar(folder / f"c-{s}.tar", [m for i in range(32) for m in good(f"c{s}{i:02d}")])
    return str(folder / "c-{0..1}.tar")


def overrides(out: Path, name: str, train: str, *extra: str, batch: int = 16) -> list[str]:
    return [f"output_dir={out}", f"name={name}", "model.name=tiny-resnet", f"data.train={train}", "data.workers=0",
            f"train.batch_size={batch}", "train.log_every=1", "train.warmup_steps=1", "train.epochs=1",
            "train.lr=0.001", *extra]


def checkpointed(out: Path, name: str, train: str, *extra: str) -> list[str]:
    """4 steps, checkpoints at steps 2 and 4 (and step 4 again at the end of fit)."""
    return overrides(out, name, train, "train.checkpoint_every=2", *extra)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def latest_name(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def assert_complete_checkpoint(step_dir: Path, step: int) -> None:
    """The weights load in plain open_clip, state.pt holds the step, magclip.json parses; all finite."""
    open_clip.create_model_and_transforms(f"local-dir:{step_dir}")
    state = torch.load(step_dir / "state.pt", map_location="cpu", weights_only=True)
    assert state["loop"]["step"] == step
    assert all(torch.isfinite(v).all() for v in state["module"].values() if v.is_floating_point())
    assert json.loads((step_dir / CHECKPOINT_META).read_text())["model"] == "tiny-resnet"


def subprocess_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "MAGCLIP_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory, clean_shards) -> Path:
    """The reference: the checkpointed 4-step run, never interrupted."""
    out = tmp_path_factory.mktemp("unbroken")
    train_clip(load_config(None, checkpointed(out, "ref", clean_shards)))
    return out / "ref"


# ----------------------------------------------------------------------------- PNG bombs


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_declaring(width: int, height: int, idat: bytes) -> bytes:
    """An 8-bit grayscale PNG whose header declares width x height, with this compressed pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


# 900 Mpx declared (beyond PIL's own bomb limit), one row of data
HEADER_BOMB = png_declaring(30_000, 30_000, zlib.compress(bytes(30_001)))


@functools.cache
def real_bomb(side: int = 12_000) -> bytes:
    """A complete, valid 144 Mpx black PNG of ~140 kB: above magclip's 89 Mpx limit but below the 179
    Mpx at which PIL itself refuses, so only magclip's header check stands between it and ~0.5 GB of
    decoded pixels (grayscale + the RGB conversion)."""
    z = zlib.compressobj(9)
    rows = bytes(side + 1) * 100  # filter byte 0 + a black row, 100 rows at a time
    data = b"".join(z.compress(rows) for _ in range(side // 100)) + z.flush()
    return png_declaring(side, side, data)


# ----------------------------------------------------------------------------- rows 1-3: bad data in a run


def corrupt_header(path: Path, member: str) -> None:
    """Overwrite the checksum field of `member`'s header (a bit flip anywhere in it does the same)."""
    with tarfile.open(path) as tar:
        offset = tar.getmember(member).offset
    data = bytearray(path.read_bytes())
    data[offset + 148:offset + 156] = b"garbage!"
    path.write_bytes(bytes(data))


def truncate_inside(path: Path, member: str) -> None:
    with tarfile.open(path) as tar:
        cut = tar.getmember(member).offset_data + 10
    path.write_bytes(path.read_bytes()[:cut])


DAMAGED_GOOD = 6 + 4 + 5  # good samples before the clean shard
DAMAGED_SKIPS = {"image_too_large": 2, "undecodable_image": 1, "bad_caption_encoding": 1, "corrupt_tar": 2}


def damaged_shards(folder: Path) -> tuple[str, dict[str, Path]]:
    """Four shards; the clean one comes last in epoch 0's shard order, so that every damage is met
    before the epoch's last sample (counts are then exact)."""
    folder.mkdir(parents=True, exist_ok=True)
    urls = [str(folder / f"x-{i}.tar") for i in range(4)]
    order = dict(zip(("members", "header", "truncated", "clean"), map(Path, epoch_order(urls, True, 0, 0))))
    write_tar(order["members"], [
        *good("b00"), *good("b01"),
        ("bomb1.png", HEADER_BOMB), ("bomb1.txt", b"a 900-megapixel header"),
        *good("b02"),
        ("bomb2.png", real_bomb()), ("bomb2.txt", b"a 144-megapixel png"),
        *good("b03"),
        ("junk.png", bytes(range(256)) * 4), ("junk.txt", b"a member of garbage bytes"),
        *good("b04"),
        ("latin.png", png(7)), ("latin.txt", "caf\u00e9 cr\u00e8me".encode("latin-1")),
        *good("b05"),
    ])
    write_tar(order["header"], [m for i in range(8) for m in good(f"h{i:02d}")])
    corrupt_header(order["header"], "h04.png")  # h00-h03 survive
    write_tar(order["truncated"], [m for i in range(8) for m in good(f"t{i:02d}")])
    truncate_inside(order["truncated"], "t05.png")  # t00-t04 survive
    write_tar(order["clean"], [m for i in range(8) for m in good(f"k{i:02d}")])
    return str(folder / "x-{0..3}.tar"), order


def test_damaged_tars_bombs_and_bad_captions_are_skipped_and_counted_in_a_run(tmp_path, caplog):
    train, shards = damaged_shards(tmp_path / "shards")
    with caplog.at_level("WARNING", logger="magclip.data"):
        results = train_clip(load_config(None, overrides(
            tmp_path, "bad", train, f"data.num_samples={DAMAGED_GOOD + 1}", "data.shuffle_buffer=1",
            "data.streams=1", batch=8)))  # one stream reads the shards in epoch 0's order: every damage is met
    run_dir = tmp_path / "bad"
    assert results["steps"] == 2 and results["samples_seen_per_rank"] == 16  # the run finished
    assert results["skipped_samples"] == DAMAGED_SKIPS
    assert json.loads((run_dir / "results.json").read_text())["skipped_samples"] == DAMAGED_SKIPS
    records = train_records(run_dir)
    assert records[-1]["skipped"] == DAMAGED_SKIPS and records[-1]["skipped_total"] == 6
    # the log names reason, shard and key of every skip
    for reason, where in (("image_too_large", f"{shards['members']} key bomb1"),
                          ("image_too_large", f"{shards['members']} key bomb2"),
                          ("undecodable_image", f"{shards['members']} key junk"),
                          ("bad_caption_encoding", f"{shards['members']} key latin"),
                          ("corrupt_tar", f"{shards['header']}: ReadError: invalid header"),
                          ("corrupt_tar", f"{shards['truncated']}:")):
        assert f"skipped {reason}: shard {where}" in caplog.text, (reason, where)


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE).group(1))


def test_decompression_bombs_are_refused_before_decoding(tmp_path):
    """The peak memory of this process stays flat while the loader reads the bombs (decoding the real
    one would add ~0.5 GB). Linux: the peak (VmHWM) is reset through /proc/self/clear_refs."""
    shard = write_tar(tmp_path / "bombs.tar", [
        *good("a"), ("bomb1.png", HEADER_BOMB), ("bomb1.txt", b"header"),
        ("bomb2.png", real_bomb()), ("bomb2.txt", b"real"), *good("b")])
    loader = build_clip_loader(str(shard), preprocess=T.Compose([T.Resize((8, 8)), T.ToTensor()]),
                               tokenizer=lambda caps: torch.zeros(len(caps), 4, dtype=torch.long),
                               batch_size=1, shuffle=False, drop_last=False)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
        start = _status_kib("VmRSS")
    except OSError:
        start = None
    keys = [k for b in loader for k in b["keys"]]
    assert keys == ["a", "b"] and dict(loader.skip_counts) == {"image_too_large": 2}
    if start is not None:
        grew = (_status_kib("VmHWM") - start) / 1024
        assert grew < 100, f"peak memory grew by {grew:.0f} MiB reading two refused bombs"


# ----------------------------------------------------------------------------- row 4: missing shard in a run


def test_missing_training_shard_is_named_before_any_work(tmp_path, clean_shards):
    folder = Path(clean_shards).parent
    with pytest.raises(FileNotFoundError, match=r"shard not found: .*c-2\.tar"):
        train_clip(load_config(None, overrides(tmp_path, "missing", str(folder / "c-{0..2}.tar"),
                                               "data.num_samples=64")))
    run_dir = tmp_path / "missing"
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "results.json").exists()


# ----------------------------------------------------------------------------- row 5: NaN / inf


class _InfGradient(torch.autograd.Function):
    """Identity forward; an infinite gradient backward (a finite loss with non-finite gradients)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def poison_losses(monkeypatch, kinds: dict[int, str]) -> None:
    """compute_loss call n (= step n with accum_freq 1) returns a NaN loss or a loss with inf gradients."""
    real = CLIPTrainModule.compute_loss
    calls = itertools.count(1)

    def compute_loss(self, *features):
        out = real(self, *features)
        kind = kinds.get(next(calls))
        if kind == "nan_loss":
            out["loss"] = out["loss"] * float("nan")
        elif kind == "inf_grad":
            out["loss"] = _InfGradient.apply(out["loss"])
        return out

    monkeypatch.setattr(CLIPTrainModule, "compute_loss", compute_loss)


def record_steps(monkeypatch) -> list[dict]:
    """Per step: the weights before and after, the batch keys, and the engine (for its final weights)."""
    steps: list[dict] = []

    class RecordingEngine(clip_training.Engine):
        def _train_step(self, micro_batches):
            before = {k: v.detach().clone() for k, v in self.unwrapped.state_dict().items()}
            steps.append({"before": before, "keys": [k for b in micro_batches for k in b["keys"]], "engine": self})
            out = super()._train_step(micro_batches)
            steps[-1]["after"] = {k: v.detach().clone() for k, v in self.unwrapped.state_dict().items()}
            return out

    monkeypatch.setattr(clip_training, "Engine", RecordingEngine)
    return steps


@pytest.mark.parametrize("optimizer", ["fused", "for_loop"])  # skipped on the device / on the host
def test_nonfinite_loss_and_gradient_steps_are_skipped_and_counted(tmp_path, clean_shards, monkeypatch, caplog,
                                                                   optimizer):
    poison_losses(monkeypatch, {2: "nan_loss", 3: "inf_grad"})
    steps = record_steps(monkeypatch)
    with caplog.at_level("WARNING", logger="magclip.training.engine"):
        results = train_clip(load_config(None, overrides(tmp_path, "nan", clean_shards,
                                                         f"train.optimizer_impl={optimizer}")))
    run_dir = tmp_path / "nan"
    assert results["steps"] == STEPS and len(steps) == STEPS
    assert results["skipped_samples"] == {"nonfinite_step_batches": 2}

    # a skipped step leaves every weight (towers, logit scale) exactly as it was; the others train
    for n, s in enumerate(steps, start=1):
        same = all(torch.equal(s["before"][k], s["after"][k]) for k in s["before"])
        assert same == (n in (2, 3)), f"step {n}: weights {'unchanged' if same else 'changed'}"
    final = steps[-1]["after"]
    assert all(torch.isfinite(v).all() for v in final.values() if v.is_floating_point())

    # warned with the step number, the loss or gradient norm, and the batch keys
    assert "step 2: non-finite loss nan or gradient norm" in caplog.text
    assert repr(steps[1]["keys"][0]) in caplog.text and repr(steps[2]["keys"][0]) in caplog.text
    step3 = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("step 3:"))
    assert "non-finite loss nan" not in step3 and "step skipped" in step3  # finite loss, inf gradients

    # counted in metrics.jsonl as they happen, and in results.json
    records = {r["step"]: r for r in train_records(run_dir)}
    assert [records[n]["skipped"].get("nonfinite_step_batches", 0) for n in range(1, STEPS + 1)] == [0, 1, 2, 2]
    assert json.loads((run_dir / "results.json").read_text())["skipped_samples"] == {"nonfinite_step_batches": 2}
    weights = load_weights(run_dir / "checkpoints" / latest_name(run_dir) / WEIGHTS_FILE)
    assert all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())


def test_consecutive_nonfinite_steps_stop_the_run_with_the_step_number(tmp_path, clean_shards, monkeypatch):
    poison_losses(monkeypatch, {n: "nan_loss" for n in range(2, 10)})
    steps = record_steps(monkeypatch)
    with pytest.raises(NonFiniteLossError) as err:
        train_clip(load_config(None, overrides(tmp_path, "stop", clean_shards, "train.max_nonfinite_steps=2",
                                               "train.checkpoint_every=1")))
    msg = str(err.value)
    assert msg.startswith("step 3: non-finite loss nan") and "2 non-finite steps in a row, stopping" in msg
    assert repr(steps[2]["keys"][0]) in msg and "logit_scale" in msg
    now = steps[2]["engine"].unwrapped.state_dict()  # the weights of step 1, untouched by steps 2 and 3
    assert len(steps) == 3 and all(torch.equal(steps[0]["after"][k], now[k]) for k in now)
    run_dir = tmp_path / "stop"
    assert not (run_dir / "results.json").exists()  # no results for a failed run
    # the last checkpoint (after the skipped step 2) holds step 1's weights: finite and resumable
    assert latest_name(run_dir) == "step_00000002"
    assert_complete_checkpoint(run_dir / "checkpoints" / "step_00000002", 2)
    saved = load_weights(run_dir / "checkpoints" / "step_00000002" / WEIGHTS_FILE)
    assert max_difference(saved, load_weights(run_dir / "checkpoints" / "step_00000001" / WEIGHTS_FILE)) == 0


# ----------------------------------------------------------------------------- row 7: kill -9 mid-checkpoint


KILL_SCRIPT = r'''
"""Train (argv[2:] are the overrides), and SIGKILL this process at one point (argv[1]) of the
step-4 checkpoint write."""
import io, os, signal, sys
from pathlib import Path
import torch
from magclip.training.clip import train_clip
from magclip.config import load_config

WHERE, STEP = sys.argv[1], "step_00000004"
real_save, real_replace = torch.save, os.replace


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def save(obj, f, *args, **kwargs):
    if WHERE == "state.pt" and isinstance(f, str) and f".tmp_{STEP}" in f and Path(f).name.startswith(".state.pt."):
        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        with open(f, "wb") as out:  # half of the file is on disk when the kill comes
            out.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            out.flush()
            os.fsync(out.fileno())
        die()
    return real_save(obj, f, *args, **kwargs)


def replace(src, dst, *args, **kwargs):
    src, dst = Path(src), Path(dst)
    real_replace(src, dst, *args, **kwargs)
    if WHERE == "replace" and src.name == STEP and dst.name == f".{STEP}.old":
        die()  # re-saving step 4 at the end of fit: the old one moved aside, the new one not in place


torch.save, os.replace = save, replace
train_clip(load_config(None, sys.argv[2:]))
'''


@pytest.mark.parametrize(("where", "resumes_at"), [
    ("state.pt", 2),  # state.pt of step 4 half written (its weights and magclip.json complete)
    ("replace", 4),   # step 4 re-saved at the end: killed between publish_dir's two renames
])
def test_kill_during_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, clean_shards, unbroken, where,
                                                                     resumes_at, caplog):
    script = tmp_path / "kill_at.py"
    script.write_text(KILL_SCRIPT)
    args = checkpointed(tmp_path, "killed", clean_shards)
    proc = subprocess.run([sys.executable, str(script), where, *args], env=subprocess_env(tmp_path),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == -signal.SIGKILL, f"rc {proc.returncode}:\n{proc.stderr[-3000:]}"
    run_dir = tmp_path / "killed"
    ckpts = run_dir / "checkpoints"
    assert not (run_dir / "results.json").exists()
    left = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("."))  # the kill came where intended
    assert left == {"state.pt": [".tmp_step_00000004"],  # holding a half state.pt
                    "replace": [".step_00000004.old", ".tmp_step_00000004"]}[where], left

    # no published step folder is incomplete, and `latest` leads to a loadable checkpoint
    for step_dir in ckpts.glob("step_*"):
        assert_complete_checkpoint(step_dir, int(step_dir.name.split("_")[1]))
    found = resolve_checkpoint(run_dir)  # the evaluation's view (reads a folder left aside, if any)
    assert_complete_checkpoint(found, resumes_at)
    assert load_checkpoint(run_dir).model_name == "tiny-resnet"

    # resume=latest continues from it, tidies the leftovers, and lands on the unbroken run's weights
    with caplog.at_level("INFO", logger="magclip.training.engine"):
        results = train_clip(load_config(None, [*args, "train.resume=latest"]))
    assert f"at step {resumes_at} " in caplog.text
    assert results["steps"] == STEPS and latest_name(run_dir) == "step_00000004"
    reference = json.loads((unbroken / "results.json").read_text())
    for key in ("steps", "epochs_completed", "samples_seen_per_rank", "skipped_samples"):
        assert results[key] == reference[key], key
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002", "step_00000004"]
    diff = max_difference(load_weights(unbroken / "checkpoints" / "step_00000004" / WEIGHTS_FILE),
                          load_weights(ckpts / "step_00000004" / WEIGHTS_FILE))
    assert diff <= 1e-6, f"weights differ from the unbroken run by {diff}"


# ----------------------------------------------------------------------------- row 8: disk full


def fill_disk(monkeypatch, *names: str) -> list[bool]:
    """Once armed, the temp file of every atomic write of one of `names` is /dev/full: writes fail with
    ENOSPC in the kernel, as on a full disk (torch.save then says 'unexpected pos', Python 'No space left')."""
    armed: list[bool] = []
    real = tempfile.mkstemp
    prefixes = {f".{name}." for name in names}

    def mkstemp(suffix=None, prefix=None, dir=None, text=False):
        fd, path = real(suffix=suffix, prefix=prefix, dir=dir, text=text)
        if armed and prefix in prefixes:
            os.close(fd)
            os.unlink(path)
            os.symlink("/dev/full", path)
            fd = os.open(path, os.O_WRONLY)
        return fd, path

    monkeypatch.setattr(magclip.io.tempfile, "mkstemp", mkstemp)
    return armed


@needs_dev_full
@pytest.mark.parametrize("target", [WEIGHTS_FILE, "state.pt", "latest"])
def test_disk_full_while_writing_a_checkpoint(tmp_path, clean_shards, monkeypatch, target):
    armed = fill_disk(monkeypatch, target)
    full = [True]

    class FillingEngine(clip_training.Engine):
        def save_checkpoint(self):
            if full and self.state.step == 4:
                armed.append(True)
            return super().save_checkpoint()

    monkeypatch.setattr(clip_training, "Engine", FillingEngine)
    args = checkpointed(tmp_path, "full", clean_shards)
    with pytest.raises(CheckpointWriteError) as err:
        train_clip(load_config(None, args))
    run_dir = tmp_path / "full"
    ckpts = run_dir / "checkpoints"
    msg = str(err.value)
    assert f"could not write checkpoint {ckpts / 'step_00000004'} (disk full" in msg
    assert f"the previous checkpoint {ckpts / 'step_00000002'} is intact" in msg and "train.resume=latest" in msg
    if target == "state.pt":
        assert "RuntimeError" in msg  # torch's own words ('unexpected pos') are kept, after ours
    else:
        assert err.value.errno == errno.ENOSPC and "No space left on device" in msg

    assert not (run_dir / "results.json").exists()
    assert latest_name(run_dir) == "step_00000002"
    assert_complete_checkpoint(ckpts / "step_00000002", 2)
    leftovers = [p.name for p in ckpts.rglob("*") if p.name.startswith(".")]
    assert leftovers == [], f"temp files left behind: {leftovers}"
    published = sorted(p.name for p in ckpts.glob("step_*"))
    assert published == (["step_00000002", "step_00000004"] if target == "latest" else ["step_00000002"])

    full.clear()  # space freed: the run continues from the intact checkpoint
    armed.clear()
    assert train_clip(load_config(None, [*args, "train.resume=latest"]))["steps"] == STEPS
    assert latest_name(run_dir) == "step_00000004"


def fill_open_file(path: Path) -> None:
    """The file this process holds open at `path` now writes to /dev/full (ENOSPC in the kernel, as
    when the disk fills while it is open)."""
    fds = [int(fd) for fd in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{fd}") == str(path)]
    assert fds, f"{path} is not open"
    full = os.open("/dev/full", os.O_WRONLY)
    for fd in fds:
        os.dup2(full, fd)
    os.close(full)


def fill_tensorboard_folder(monkeypatch, folder: Path) -> None:
    """tensorboard's writer thread opens its event file for every write: from now on, files it opens
    under `folder` are /dev/full."""
    import io

    from tensorboard.compat.tensorflow_stub.io import gfile

    class FullDisk:
        @staticmethod
        def open(name, mode="r", *args, **kwargs):
            return io.open("/dev/full" if os.fsdecode(name).startswith(str(folder)) else name, mode, *args, **kwargs)

    monkeypatch.setattr(gfile, "io", FullDisk)


@needs_dev_full
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # no thread traceback either
@pytest.mark.parametrize("target", ["metrics.jsonl", "tensorboard"])
def test_disk_full_while_writing_metrics(tmp_path, clean_shards, monkeypatch, target):
    """Issue rows 9.01: the disk fills after the checkpoint of step 2, while metrics.jsonl or the
    tensorboard events are open: one error naming the file and 'disk full', the lines written before
    it intact, the checkpoint named for a resume, and the resume completes the run."""
    full = [True]

    class FillingEngine(clip_training.Engine):
        def save_checkpoint(self):
            step = super().save_checkpoint()
            if full and self.state.step == 2:
                if target == "tensorboard":
                    fill_tensorboard_folder(monkeypatch, self.run_dir / target)
                else:
                    fill_open_file(self.run_dir / target)
            return step

    monkeypatch.setattr(clip_training, "Engine", FillingEngine)
    args = checkpointed(tmp_path, "full", clean_shards)
    with pytest.raises(magclip.training.engine.RunWriteError) as err:
        train_clip(load_config(None, args))
    run_dir = tmp_path / "full"
    msg = str(err.value)
    assert msg.startswith(f"could not write {run_dir / target} (disk full): ") and err.value.errno == errno.ENOSPC
    assert f"the last checkpoint {run_dir / 'checkpoints' / 'step_00000002'} is complete" in msg
    assert "train.resume=latest" in msg
    assert [r["step"] for r in train_records(run_dir)] == [1, 2] + ([3] if target == "tensorboard" else [])
    assert_complete_checkpoint(run_dir / "checkpoints" / "step_00000002", 2)

    full.clear()  # space freed: the run continues from the intact checkpoint
    monkeypatch.undo()
    assert train_clip(load_config(None, [*args, "train.resume=latest"]))["steps"] == STEPS
    assert [r["step"] for r in train_records(run_dir)][-1] == STEPS


@needs_dev_full
def test_disk_full_while_writing_results_says_how_to_write_them_again(tmp_path, clean_shards, monkeypatch):
    """Issue row 9.02: results.json cannot be written at the end: one error naming it, the final
    checkpoint complete, and `train.resume=latest` on the finished run evaluates it and writes them."""
    armed = fill_disk(monkeypatch, "results.json")
    armed.append(True)
    args = checkpointed(tmp_path, "full", clean_shards)
    with pytest.raises(magclip.training.engine.RunWriteError) as err:
        train_clip(load_config(None, args))
    run_dir = tmp_path / "full"
    msg = str(err.value)
    assert msg.startswith(f"could not write {run_dir / 'results.json'} (disk full): ")
    assert f"training finished; the last checkpoint {run_dir / 'checkpoints' / 'step_00000004'} is complete" in msg
    assert not (run_dir / "results.json").exists() and not (run_dir / ".magclip.lock").exists()
    assert_complete_checkpoint(run_dir / "checkpoints" / "step_00000004", STEPS)

    armed.clear()
    weights = load_weights(run_dir / "checkpoints" / "step_00000004" / WEIGHTS_FILE)
    results = train_clip(load_config(None, [*args, "train.resume=latest"]))
    assert results["steps"] == STEPS and json.loads((run_dir / "results.json").read_text())["steps"] == STEPS
    assert max_difference(weights, load_weights(run_dir / "checkpoints" / "step_00000004" / WEIGHTS_FILE)) == 0  # no step taken


def test_a_sizes_json_that_overclaims_does_not_repeat_the_data(tmp_path, caplog):
    """Issue row 9.12: a sizes.json claiming 10x the samples the shards hold made "1 epoch" 40 steps,
    each sample trained 10 times, without a word. The epoch is what the shards hold, and one warning
    names the sizes.json with the claimed and the real count."""
    for s in range(2):
        write_tar(tmp_path / f"c-{s}.tar", [m for i in range(32) for m in good(f"c{s}{i:02d}")])
    (tmp_path / "sizes.json").write_text(json.dumps({"c-0.tar": 320, "c-1.tar": 320}))
    with caplog.at_level("WARNING", logger="magclip.data"):
        results = train_clip(load_config(None, overrides(tmp_path / "runs", "sizes", str(tmp_path / "c-{0..1}.tar"))))
    assert results["steps"] == STEPS and results["train_samples_per_epoch"] == 64
    warnings = [r.getMessage() for r in caplog.records if "sizes.json" in r.getMessage()]
    assert len(warnings) == 1 and str(tmp_path / "sizes.json") in warnings[0], warnings
    assert "claims 640 samples for 2 shards that hold 64" in warnings[0]


# ----------------------------------------------------------------------------- row 10: wrong model config


@pytest.fixture(scope="module")
def resnet_step(tmp_path_factory) -> Path:
    """A tiny-resnet checkpoint as the trainer writes it (run/checkpoints/step_00000001)."""
    run = tmp_path_factory.mktemp("resnet_run")
    step = run / "checkpoints" / "step_00000001"
    torch.manual_seed(0)
    save_checkpoint_for_open_clip(create_clip("tiny-resnet").model, step / "model.pt", logit_scale=10.0)
    (step / CHECKPOINT_META).write_text(json.dumps({
        "model": "tiny-resnet", "logit_scale": 10.0, "config": {"model": {"name": "tiny-resnet"}},
        "scorers": {"i2t": {"mode": "cosine"}, "t2i": {"mode": "cosine"}}}))
    (run / "checkpoints" / "latest").write_text("step_00000001\n")
    return step


def test_checkpoint_with_another_models_magclip_json_is_a_clear_error(tmp_path, resnet_step):
    step = tmp_path / "step"
    step.mkdir()
    (step / "model.pt").symlink_to(resnet_step / "model.pt")
    meta = json.loads((resnet_step / CHECKPOINT_META).read_text())
    (step / CHECKPOINT_META).write_text(json.dumps({**meta, "model": "tiny-vit"}))
    with pytest.raises(ValueError) as err:
        load_checkpoint(step)
    msg = str(err.value)
    assert f"checkpoint {step / 'model.pt'} does not fit model 'tiny-vit'" in msg
    assert "missing keys, e.g. visual.class_embedding" in msg and "unexpected keys" in msg
    assert f"named in {step / CHECKPOINT_META}; its run config says model 'tiny-resnet'" in msg
    assert len(msg) < 1000  # a summary, not torch's list of every key


def test_evaluating_weights_with_another_model_is_a_clear_error(tmp_path, resnet_step, clean_shards):
    spec = importlib.util.spec_from_file_location("eval_zeroshot", ROOT / "eval" / "zeroshot.py")
    eval_zeroshot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(eval_zeroshot)
    out = tmp_path / "r.json"
    weights = resnet_step / "model.pt"
    with pytest.raises(ValueError) as err:
        eval_zeroshot.main(["--model", "tiny-vit", "--pretrained", str(weights), "--data", clean_shards, "--out", str(out)])
    msg = str(err.value)
    assert f"checkpoint {weights} does not fit model 'tiny-vit'" in msg
    assert f"says it was trained as model 'tiny-resnet': evaluate it with --checkpoint {resnet_step}" in msg
    assert not out.exists()


def test_weights_of_another_width_are_a_clear_error_before_training(tmp_path, resnet_step, clean_shards):
    cfg = json.loads((CONFIG_DIR / "tiny-resnet.json").read_text())
    cfg["embed_dim"] = 32
    narrow = tmp_path / "narrow-resnet.json"
    narrow.write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        train_clip(load_config(None, [*overrides(tmp_path, "narrow", clean_shards), f"model.name={narrow}",
                                      f"model.pretrained={resnet_step / 'model.pt'}"]))
    msg = str(err.value)
    assert f"checkpoint {resnet_step / 'model.pt'} does not fit model 'narrow-resnet'" in msg
    assert "shape mismatches, e.g. text_projection: checkpoint [128, 64] vs model [128, 32]" in msg
    assert not (tmp_path / "narrow" / "checkpoints").exists()


# ----------------------------------------------------------------------------- row 11: 2 processes, 1 shard


def test_two_processes_with_fewer_shards_than_ranks_fail_fast(tmp_path):
    shard = write_tar(tmp_path / "one-0.tar", [m for i in range(16) for m in good(f"o{i:02d}")])
    out = tmp_path / "runs"
    args = [f"output_dir={out}", "name=ddp", "model.name=tiny-resnet", f"data.train={shard}",
            "data.num_samples=16", "data.workers=0", "train.batch_size=4", "train.max_steps=2"]
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_port", str(free_port()), str(SCRIPT), *args],
                            env=subprocess_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("two processes with one shard hung for 120 s instead of failing")
    assert proc.returncode != 0
    assert "1 shards cannot be split over 2 ranks: need at least 2 shards (or resampled=True)" in stderr, stderr[-3000:]
    assert not (out / "ddp" / "checkpoints").exists() and not (out / "ddp" / "results.json").exists()
    assert time.monotonic() - t0 < 120


# ----------------------------------------------------------------------------- atomic results files


@needs_dev_full
def test_atomic_writes_keep_the_old_file_when_the_disk_is_full(tmp_path, monkeypatch):
    results, state = tmp_path / "results.json", tmp_path / "state.pt"
    atomic_write_json(results, {"old": True})
    atomic_torch_save({"old": torch.ones(3)}, state)
    fill_disk(monkeypatch, "results.json", "state.pt").append(True)
    with pytest.raises(OSError, match="No space left on device"):
        atomic_write_json(results, {"new": list(range(10_000))})
    with pytest.raises(RuntimeError):
        atomic_torch_save({"new": torch.zeros(10_000)}, state)
    assert json.loads(results.read_text()) == {"old": True}
    assert torch.equal(torch.load(state, weights_only=True)["old"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "state.pt"]  # no temp file left


# ----------------------------------------------------------------------------- security: files that carry code


def test_resume_from_a_crafted_state_pt_is_refused_and_runs_nothing(tmp_path, clean_shards, resnet_step):
    step = tmp_path / "shared_ckpt"
    step.mkdir()
    (step / "model.pt").write_bytes((resnet_step / "model.pt").read_bytes())
    (step / CHECKPOINT_META).write_bytes((resnet_step / CHECKPOINT_META).read_bytes())
    marker = tmp_path / "payload_ran"
    crafted_torch_file(step / "state.pt", marker, {"loop": {"step": 1}})
    with pytest.raises(UnsafeFileError) as err:
        train_clip(load_config(None, overrides(tmp_path, "victim", clean_shards, f"train.resume={step}")))
    assert not marker.exists()
    assert f"refusing to load {step / 'state.pt'}" in str(err.value) and "arbitrary code" in str(err.value)


def test_crafted_model_pt_is_refused_by_evaluation_and_training(tmp_path, clean_shards, resnet_step):
    step = tmp_path / "step"
    step.mkdir()
    (step / CHECKPOINT_META).write_bytes((resnet_step / CHECKPOINT_META).read_bytes())
    marker = tmp_path / "payload_ran"
    weights = crafted_torch_file(step / "model.pt", marker, load_weights(resnet_step / "model.pt"))
    with pytest.raises(UnsafeFileError, match=f"refusing to load {re.escape(str(weights))}"):
        load_checkpoint(step)
    with pytest.raises(UnsafeFileError, match=f"refusing to load {re.escape(str(weights))}"):
        train_clip(load_config(None, [*overrides(tmp_path, "init", clean_shards), f"model.pretrained={weights}"]))
    assert not marker.exists()


def test_safe_state_pt_round_trips_every_rng(tmp_path, unbroken):
    """What the trainer writes loads with weights_only=True: no pickled object is needed to resume."""
    state = torch.load(unbroken / "checkpoints" / latest_name(unbroken) / "state.pt", weights_only=True)
    assert state["rng"]["numpy"]["keys"].dtype == torch.int64 and len(state["rng"]["numpy"]["keys"]) == 624


@pytest.mark.parametrize("name", ["state.pt", WEIGHTS_FILE])
def test_truncated_checkpoint_file_is_named_as_damaged(tmp_path, clean_shards, unbroken, name):
    step = tmp_path / "step"
    step.mkdir()
    for f in (unbroken / "checkpoints" / latest_name(unbroken)).iterdir():
        (step / f.name).write_bytes(f.read_bytes())
    data = (step / name).read_bytes()
    (step / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(DamagedFileError, match=f"{re.escape(str(step / name))} is damaged: truncated"):
        if name == WEIGHTS_FILE:
            load_checkpoint(step)
        else:
            train_clip(load_config(None, overrides(tmp_path, "resumed", clean_shards, f"train.resume={step}")))


# ----------------------------------------------------------------------------- files get the user's umask


def test_published_files_get_the_mode_the_umask_gives(tmp_path, unbroken):
    expected = 0o666 & ~_umask()
    step = unbroken / "checkpoints" / latest_name(unbroken)
    for f in [unbroken / "config.yaml", unbroken / "results.json", unbroken / "metrics.jsonl",
              unbroken / "checkpoints" / "latest", step / WEIGHTS_FILE, step / OPEN_CLIP_CONFIG, step / "state.pt",
              step / CHECKPOINT_META]:
        assert f.stat().st_mode & 0o777 == expected, f"{f}: {oct(f.stat().st_mode & 0o777)}"
    old = os.umask(0o027)
    try:
        atomic_write_json(tmp_path / "r.json", {"a": 1})
        atomic_torch_save({"a": torch.ones(1)}, tmp_path / "s.pt")
    finally:
        os.umask(old)
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "s.pt").stat().st_mode & 0o777 == 0o640


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ----------------------------------------------------------------------------- one run per run directory


def test_a_run_directory_in_use_is_refused_at_once_naming_the_holder(tmp_path, clean_shards):
    from magclip.training.run import LOCK_FILE, RunDirBusyError

    args = overrides(tmp_path, "shared", clean_shards, "train.max_steps=1")
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "shared").mkdir()
        (tmp_path / "shared" / LOCK_FILE).write_text(f"{holder.pid} {socket.gethostname()}\n")
        t0 = time.perf_counter()
        for extra in ([], ["overwrite=true"]):  # overwrite never deletes a folder another run trains into
            with pytest.raises(RunDirBusyError, match=f"in use by process {holder.pid}"):
                train_clip(load_config(None, [*args, *extra]))
        assert time.perf_counter() - t0 < 30 and not (tmp_path / "shared" / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone (killed): its claim is stale and the next run takes the folder
    assert train_clip(load_config(None, args))["steps"] == 1
    assert not (tmp_path / "shared" / LOCK_FILE).exists()  # released at the end


# ----------------------------------------------------------------------------- a worker without data, damage counted once


def test_a_zero_byte_shard_as_a_workers_only_shard_does_not_stop_the_run(tmp_path, clean_shards):
    """One good shard + one empty file, 2 loader workers: the worker holding the empty shard has no
    usable data; the good shard makes up its share and the damage is counted once per epoch."""
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "d-0.tar").write_bytes(Path(clean_shards.replace("{0..1}", "0")).read_bytes())
    (folder / "d-1.tar").write_bytes(b"")
    args = overrides(tmp_path, "empty", str(folder / "d-{0..1}.tar"), "data.workers=2", "train.epochs=2")
    results = train_clip(load_config(None, args))
    assert results["steps"] == 4 and results["epochs_completed"] == 2  # 32 samples / batch 16, two epochs
    assert results["skipped_samples"] == {"corrupt_tar": 2}


def test_a_damaged_shard_is_counted_once_per_epoch(tmp_path):
    """Five damaged shards in a fixed-length epoch that reads its shards twice: five counts, not more."""
    folder = tmp_path / "shards"
    for i in range(5):
        write_tar(folder / f"z-{i}.tar", [m for k in range(4) for m in good(f"z{i}{k}")])
        corrupt_header(folder / f"z-{i}.tar", f"z{i}2.png")  # 2 samples survive in each
    write_tar(folder / "z-5.tar", [m for k in range(8) for m in good(f"g{k}")])
    loader = build_clip_loader(str(folder / "z-{0..5}.tar"), preprocess=T.ToTensor(),
                               tokenizer=lambda caps: torch.zeros(len(caps), 4, dtype=torch.long), batch_size=6,
                               num_samples=36, workers=2, shuffle=False)  # 18 good samples: two passes
    assert len(list(loader)) == 6
    assert loader.skip_counts["corrupt_tar"] == 5
