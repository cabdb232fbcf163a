"""The training engine on fixed in-memory batches: accumulation keeps all negatives, 2 processes = 1."""

import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import torch
from builders import free_port

from magclip.config import LossConfig, TrainConfig
from magclip.models.clip import create_clip
from magclip.training.accelerator import make_accelerator
from magclip.training.clip import CLIPTrainModule, build_logit_scale, build_loss
from magclip.training.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
GLOBAL_BATCH = 16


def fixed_batches(n: int, seed: int = 0) -> list[dict]:
    """`n` samples of random 32x32 images and token ids, as one list of single-sample dicts."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 32, 32, generator=g)
    texts = torch.randint(1, 400, (n, 32), generator=g)
    return [{"images": images[i:i + 1], "texts": texts[i:i + 1], "keys": [str(i)], "skipped": {}} for i in range(n)]


def collate(samples: list[dict]) -> dict:
    return {"images": torch.cat([s["images"] for s in samples]), "texts": torch.cat([s["texts"] for s in samples]),
            "keys": [k for s in samples for k in s["keys"]], "skipped": {}}


def run_engine(run_dir: Path, batches: list[dict], *, accum: int = 1, mode: str = "qnorm", steps: int = 2) -> dict:
    """Train `steps` steps on `batches` (this rank's micro-batches, in order) and return the final weights."""
    torch.manual_seed(0)
    # eps well above float32 gradient noise: Adam's first steps are ~lr*sign(g), which would turn
    # last-bit differences of near-zero gradients into lr-sized weight differences
    # fp32: the equivalences compared here (ranks, accumulation) hold to float32 rounding, not bf16's
    cfg = TrainConfig(epochs=1, batch_size=batches[0]["images"].shape[0], lr=1e-3, eps=1e-3, warmup_steps=0,
                      accum_freq=accum, log_every=1, grad_clip=1.0, precision="fp32")
    acc = make_accelerator(cfg, run_dir)
    loss_cfg = LossConfig(i2t=mode, t2i="learnable" if mode == "qnorm" else mode)
    module = CLIPTrainModule(create_clip("tiny-vit").model, build_loss(loss_cfg), build_logit_scale(loss_cfg))
    engine = Engine(cfg, acc, module, run_dir, lambda epoch: batches, steps_per_epoch=steps,
                    save_model=lambda m, step_dir: torch.save(m.state_dict(), step_dir / "model.pt"))
    engine.fit()
    engine.close()
    return {k: v.detach().clone() for k, v in engine.unwrapped.state_dict().items()}




def assert_same_weights(a: dict, b: dict, atol: float = 2e-6) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst <= atol, f"max weight difference {worst}"


def test_feature_cache_accumulation_equals_the_large_batch(tmp_path):
    samples = fixed_batches(2 * GLOBAL_BATCH)
    large = [collate(samples[:GLOBAL_BATCH]), collate(samples[GLOBAL_BATCH:])]
    half = GLOBAL_BATCH // 2
    micro = [collate(samples[i:i + half]) for i in range(0, 2 * GLOBAL_BATCH, half)]
    a = run_engine(tmp_path / "a", large, accum=1)
    b = run_engine(tmp_path / "b", micro, accum=2)
    assert_same_weights(a, b)
    # and naive accumulation would differ: half-size batches without the cache see fewer negatives
    c = run_engine(tmp_path / "c", micro[:2], accum=1)
    assert max(float((a[k] - c[k]).abs().max()) for k in a) > 1e-4


def test_two_processes_equal_one_process_on_the_global_batch(tmp_path):
    samples = fixed_batches(2 * GLOBAL_BATCH)
    one = run_engine(tmp_path / "one", [collate(samples[:GLOBAL_BATCH]), collate(samples[GLOBAL_BATCH:])])
    out = tmp_path / "two"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                           str(Path(__file__).with_name("engine_two_ranks.py")), str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "world.json").read_text()) == {"world_size": 2}
    two = torch.load(out / "weights.pt", weights_only=True)
    assert_same_weights(one, two)


def test_loss_parameters_can_have_their_own_learning_rate():
    loss_cfg = LossConfig(i2t="learnable", t2i="learnable")
    module = CLIPTrainModule(create_clip("tiny-resnet").model, build_loss(loss_cfg), build_logit_scale(loss_cfg))
    groups = module.param_groups(weight_decay=0.1, loss_lr=0.05)
    own = {id(p) for p in module.loss_parameters()}
    assert own and {id(p) for p in groups[-1]["params"]} == own and groups[-1]["lr"] == 0.05
    assert not own & {id(p) for g in groups[:-1] for p in g["params"]}
    assert len(module.param_groups(weight_decay=0.1)) == 2


def test_close_does_not_wait_on_a_hung_tensorboard_writer(monkeypatch):
    """A SIGINT while metrics are written once hung the trainer in SummaryWriter.close for 121 s."""
    import threading
    import time

    from magclip.training import metrics_log

    released = threading.Event()

    class HungWriter:
        def close(self):
            released.wait(60)

    monkeypatch.setattr(metrics_log, "TB_CLOSE_TIMEOUT_S", 0.5)
    eng = metrics_log.MetricsLog(Path("unused"))
    eng._tb = HungWriter()
    t0 = time.perf_counter()
    eng.close()
    assert time.perf_counter() - t0 < 5
    released.set()


def test_no_batch_outlives_its_step(tmp_path):
    """The loader is asked for the next batch only once the previous one is unreachable: on a GPU host a
    batch is pinned memory, and one kept across the fetch of the next is a second batch of it."""
    freed: list[bool] = []

    def loader(epoch: int):
        previous = None
        for i in range(4):
            if previous is not None:
                freed.append(previous() is None)  # refcounting frees at once: no gc.collect() needed
            batch = collate(fixed_batches(4, seed=i))
            previous = weakref.ref(batch["images"])
            yield batch
            del batch

    torch.manual_seed(0)
    cfg = TrainConfig(epochs=1, batch_size=4, warmup_steps=0, log_every=1)
    loss_cfg = LossConfig(i2t="qnorm", t2i="qnorm")
    module = CLIPTrainModule(create_clip("tiny-vit").model, build_loss(loss_cfg), build_logit_scale(loss_cfg))
    engine = Engine(cfg, make_accelerator(cfg, tmp_path), module, tmp_path, loader, steps_per_epoch=4,
                    save_model=lambda m, step_dir: None)
    engine.fit()
    engine.close()
    assert freed == [True, True, True], freed
