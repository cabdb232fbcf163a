"""The accelerate training loop shared by the CLIP and text paths.

A task subclasses `TrainModule` (forward = encode a micro-batch into features, `compute_loss` =
the contrastive loss on features of the whole accumulated batch, `project_` = clip constrained
parameters after a step) and a loader factory. The engine owns what every contrastive run needs:

- AdamW over the module's own groups (`TrainModule.param_groups`: no weight decay on 1-D parameters,
  the logit scale and the norm exponents), with the speed levers of magclip/training/levers.py
  (fused kernel, channels_last, precision, compile), each logged once;
- cosine schedule with linear warmup;
- precision fp32/bf16/fp16 through accelerate;
- gradient accumulation with open_clip's feature cache: features of all micro-batches are first
  computed without gradient, then each micro-batch is re-encoded with gradient and the loss is
  taken over the whole accumulated batch, so negatives span it (naive accumulation would not);
- gradient clipping; non-finite steps skipped and counted, the run stopped with the step number
  after `max_nonfinite_steps` in a row. With the fused optimizer the skip happens on the device (its
  `found_inf`; BatchNorm buffers put back with a `where`), and the outcome of each step is read on
  the host only where it is needed (log steps, checkpoints, the end): no host sync per step;
- checkpoints (latest + every N) with optimizer, scheduler, RNG, data position and the recent-loss
  window, so `resume=latest` continues exactly; the files are `Checkpointer`'s (training/checkpoints.py);
- log records (metrics.jsonl + tensorboard, `MetricsLog` in training/metrics_log.py) and tqdm on the
  main process only; a resume takes back the records logged after its checkpoint;
- stop requests (a signal, the time limit: `StopGuard`, training/preemption.py) at step boundaries.

The data loader is *not* passed through `accelerator.prepare`: webdataset loaders already shard
by rank, and accelerate would re-dispatch batches from rank 0.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from tqdm.auto import tqdm

from magclip.config import TrainConfig
from magclip.distributed import gather_objects, naming_lost_ranks
from magclip.training.checkpoints import (
    CHECKPOINTS_DIR,
    Checkpointer,
    CheckpointWriteError,
    RunWriteError,
    get_rng_state,
    resolve_resume,
    set_rng_state,
    tidy_interrupted_writes,
)
from magclip.training.frozen_base import check_base
from magclip.training.levers import compile_choice, compile_module, optimizer_kwargs, resolve_precision, use_channels_last
from magclip.training.metrics_log import MetricsLog, ResumePoint
from magclip.training.preemption import StopGuard, state_bytes
from magclip.training.sharding import (
    SHARDED_DIR,
    Sharding,
    load_training_weights,
    make_sharding,
    save_sharded,
    trainable_state,
)

__all__ = ["CheckpointWriteError", "Engine", "LoopState", "NonFiniteLossError", "RunWriteError", "TrainModule"]

log = logging.getLogger("magclip.training.engine")

SHORTFALL = "epoch_shortfall_micro_batches"  # micro-batches an epoch lacked: no usable data was left
RECENT_LOSS_STEPS = 20  # results.json's train_loss_recent: mean loss over the last this many steps


class TrainModule(nn.Module):
    """What the engine trains: encoders (the subclass's `forward(batch)` -> features), a contrastive
    loss with its Scorers, and a logit scale. `compute_loss` runs on features of the whole
    accumulated batch; the loss and the scale are the "loss parameters" that take part in every
    micro-batch's loss (see `Engine._accumulated_backward`)."""

    feature_names: tuple[str, ...] = ()
    channels_last = False  # set by the engine: images go in channels_last memory (`train.channels_last`)
    compile_blocker: str | None = None  # why `train.compile: auto` must not compile this module's towers (levers.py)

    def __init__(self, loss: nn.Module, logit_scale: nn.Module, logit_bias: nn.Module | None = None):
        super().__init__()
        self.loss = loss
        self.logit_scale = logit_scale
        self.logit_bias = logit_bias  # the sigmoid loss's; None for the softmax losses

    def towers(self) -> nn.Module:
        """The encoders: what the speed levers (channels_last, compile) apply to."""
        raise NotImplementedError

    def compute_loss(self, *features: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.logit_bias is not None:
            return self.loss(*features, self.logit_scale(), self.logit_bias())
        return self.loss(*features, self.logit_scale())

    def project_(self) -> None:
        """Keep the scale and the exponents in range; called after every optimizer step."""
        self.logit_scale.project_()
        self.loss.project_()

    def loss_parameters(self) -> list[nn.Parameter]:
        """Parameters used by `compute_loss` directly rather than through the features."""
        bias = [*self.logit_bias.parameters()] if self.logit_bias is not None else []
        return [*self.logit_scale.parameters(), *bias, *self.loss.parameters()]

    def log_state(self) -> dict[str, float]:
        state = {"logit_scale": self.logit_scale.value}
        if self.logit_bias is not None:
            state["logit_bias"] = self.logit_bias.value
        return state

    def param_groups(self, weight_decay: float, loss_lr: float | None = None) -> list[dict]:
        """AdamW groups (the module knows its parameters, as nanoGPT's configure_optimizers): no decay on
        1-D tensors (norms, biases, gains) and on the loss parameters (logit scale, exponents). With
        `loss_lr` the loss parameters get that learning rate: at a fine-tuning rate such as 2e-5 they
        would otherwise barely move."""
        own = {id(p) for p in self.loss_parameters()}
        decay, no_decay, loss_side = [], [], []
        for p in self.parameters():
            if not p.requires_grad:
                continue
            if id(p) in own:
                (loss_side if loss_lr is not None else no_decay).append(p)
            elif p.ndim < 2:
                no_decay.append(p)
            else:
                decay.append(p)
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if loss_side:
            groups.append({"params": loss_side, "weight_decay": 0.0, "lr": loss_lr})
        return groups


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


@dataclass
class StepOutcome:
    """A step whose finiteness is still a device tensor (read on the host in `Engine._settle_steps`)."""

    step: int
    finite: torch.Tensor
    keys: list[str]
    loss: torch.Tensor
    grad_norm: torch.Tensor
    batches: int


@dataclass
class LoopState:
    step: int = 0                    # optimizer steps done
    epoch: int = 0
    batches_in_epoch: int = 0        # micro-batches of `epoch` already consumed
    skipped_samples: Counter = field(default_factory=Counter)
    nonfinite_steps: int = 0
    samples_seen: int = 0
    wall_before_s: float = 0.0       # wall time of the earlier processes of a resumed run, to its checkpoint


def cosine_with_warmup(warmup: int, total: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


class Engine:
    """Runs `steps_per_epoch * epochs` optimizer steps of `module` on batches from `make_loader(epoch)`."""

    def __init__(self, cfg: TrainConfig, accelerator: Accelerator, module: nn.Module, run_dir: Path,
                 make_loader: Callable[[int], Iterable[dict]], steps_per_epoch: int,
                 save_model: Callable[[nn.Module, Path], None],  # (module, step folder): writes the model
                 evaluate: Callable[[nn.Module, int], dict[str, float]] | None = None,
                 run_config: dict[str, Any] | None = None,  # the resolved config, kept in each checkpoint
                 started: float | None = None,  # time.perf_counter() when the process began the run
                 stop: StopGuard | None = None,  # signals and time limit (training/preemption.py)
                 sharding: Sharding | None = None,  # one that sharded the module already (training/meta_start.py)
                 frozen_base: dict[str, Any] | None = None,  # a LoRA run's base (training/frozen_base.py): checkpoints
                 # hold only what trains, the base is read again from its files on resuming
                 save_trained: Callable[[nn.Module, dict[str, torch.Tensor], Path], None] | None = None):
        # (module, its trainable parameters gathered whole, step folder): a LoRA run's adapter folder under fsdp,
        # written instead of save_model's merged model (which would gather the base: magclip-consolidate --merge)
        self.cfg = cfg
        self._started = time.perf_counter() if started is None else started
        self.acc = accelerator
        self.run_dir = run_dir
        self.make_loader = make_loader
        self.steps_per_epoch = steps_per_epoch
        self.total_steps = steps_per_epoch * cfg.epochs
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        if self.total_steps < 1:
            raise ValueError(f"the run has no step to take: {steps_per_epoch} steps per epoch (batch {cfg.batch_size} "
                             f"x accum {cfg.accum_freq} x {accelerator.num_processes} processes)")
        self.evaluate = evaluate
        self.frozen_base = frozen_base
        self.save_trained = save_trained
        self.stop = stop or StopGuard([], cfg.time_limit)
        self.levers = self._apply_levers(module)
        self.sharding = sharding or make_sharding(cfg.sharding, accelerator,
                                                  resolve_precision(cfg.precision, accelerator.device)[0])
        module = self.sharding.shard(module)  # before the optimizer: it holds the sharded parameters
        self.levers["sharding"] = (f"{cfg.sharding} ({accelerator.num_processes} processes)" if cfg.sharding == "ddp"
                                   else f"fsdp ({accelerator.num_processes} processes; parameters, gradients and "
                                        "optimizer state sharded)")
        if cfg.sharding == "ddp" and cfg.save_full_model != "every":
            log.info("train.save_full_model=%s applies to fsdp: under ddp every checkpoint writes the model files "
                     "(each process holds the whole model: writing it gathers nothing)", cfg.save_full_model)
        if frozen_base is not None and cfg.sharding == "fsdp" and accelerator.is_main_process:
            log.info("LoRA under fsdp: every checkpoint holds the adapters (adapter/, peft's folder) and their optimizer "
                     "state, never the frozen base nor a merged model (train.save_full_model does not apply): "
                     "`magclip-consolidate STEP --merge` writes the merged model offline")
        groups = module.param_groups(cfg.weight_decay, cfg.loss_lr)
        impl, self.levers["optimizer"] = optimizer_kwargs(cfg.optimizer_impl, [p for g in groups for p in g["params"]])
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(cfg.warmup_steps, self.total_steps))
        # the scheduler is stepped by hand once per optimizer step: accelerate's wrapper would
        # step it once per process, assuming a dataloader it sharded itself
        self.model, self.optimizer = self.sharding.prepare(module, optimizer)
        self._unwrapped = self.sharding.unwrap(self.model)  # once: unwrap_model probes the file system per call
        # the fused kernel skips a non-finite step on the device (its found_inf), unless a loss scaler owns that;
        # sharded parameters take the host's decision (a found_inf beside DTensors is not dispatched)
        self._inner_optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        self._skips_on_device = bool(impl.get("fused")) and accelerator.scaler is None and not self.sharding.sharded
        self._pending: list[StepOutcome] = []
        if accelerator.is_main_process:
            log.info("speed levers: %s", "; ".join(f"{k}: {v}" for k, v in self.levers.items()))
        self.state = LoopState()
        self._recent_losses: deque[torch.Tensor] = deque(maxlen=RECENT_LOSS_STEPS)
        self.ckpt_dir = run_dir / CHECKPOINTS_DIR
        self.checkpointer = Checkpointer(self.ckpt_dir, save_model, run_config)
        self.metrics = MetricsLog(run_dir, accelerator.is_main_process, cfg.report_to, run_config)  # train.report_to
        self._resumed: ResumePoint | None = None
        self._saved_step: int | None = None
        self._log_norms: list[torch.Tensor] | None = None  # mean feature norms of a logged step (0-d tensors)

    @property
    def unwrapped(self) -> nn.Module:
        return self._unwrapped

    def wall_time_s(self) -> float:
        """The run's wall time so far, across resumes: what the earlier processes spent up to the
        checkpoint this one resumed from (work after it was lost and is not counted) plus this process's."""
        return self.state.wall_before_s + time.perf_counter() - self._started

    def _apply_levers(self, module: nn.Module) -> dict[str, str]:
        """channels_last and compile on the module's towers (before the optimizer and DDP see them); what
        each lever resolved to, for the log and results.json."""
        cfg = self.cfg
        precision, why = resolve_precision(cfg.precision, self.acc.device)  # the rule make_accelerator applied
        levers = {"precision": f"{precision} ({why})"}
        towers = module.towers()
        sharded = cfg.sharding == "fsdp"  # FSDP2 shards contiguous parameters only: channels_last weights are not
        module.channels_last = use_channels_last(towers, cfg.channels_last and not sharded)
        levers["channels_last"] = ("on" if module.channels_last else "off, as configured" if not cfg.channels_last
                                   else "off (train.sharding=fsdp shards contiguous weights)" if sharded
                                   else "off (no convolutions)")
        wanted, why = compile_choice(cfg.compile, self.total_steps, module.compile_blocker, sharded)
        compiled = compile_module(towers, wanted, cfg.compile_mode)
        levers["compile"] = f"on (mode {cfg.compile_mode}; {why})" if compiled else f"off ({why})"
        return levers

    # ---------------------------------------------------------------- loop
    def fit(self) -> LoopState:
        """Train to the last step; a lost rank ends it with a PeerLostError that names that rank."""
        with naming_lost_ranks(lambda: f"training step {self.state.step + 1}"):
            return self._fit()

    def _fit(self) -> LoopState:
        if self.cfg.resume:
            if self.acc.is_main_process:
                tidy_interrupted_writes(self.ckpt_dir)
            self.acc.wait_for_everyone()
            start = resolve_resume(self.cfg.resume, self.ckpt_dir)
            if start is not None:  # None: 'auto' found no checkpoint
                self.load_checkpoint(start)
        self.metrics.open(self._resumed)
        bar = tqdm(total=self.total_steps, initial=self.state.step, disable=not self.acc.is_main_process,
                   desc="train", dynamic_ncols=True)
        self.stop.start_loop(self.acc.num_processes)
        try:  # closed on any way out: a fatal error's one line must not land on the bar's line
            self._loop(bar)
        finally:
            bar.close()
        self.save_checkpoint()
        self.stop.end_loop()
        return self.state

    def _loop(self, bar: tqdm) -> None:
        """Epochs of steps until the last step."""
        self._rate_mark = (time.perf_counter(), self.state.samples_seen)
        limit = self.steps_per_epoch * self.cfg.accum_freq
        if self.state.batches_in_epoch >= limit:  # resumed from a checkpoint taken at an epoch's last step
            self._next_epoch()
        while self.state.step < self.total_steps:
            fresh_epoch = self.state.batches_in_epoch == 0
            steps_taken = 0
            for micro_batches in self._steps_of_epoch():
                steps_taken += 1
                out = self._train_step(micro_batches)
                del micro_batches  # no batch outlives its step: the loader fills the next one without it
                self._after_step(out, bar)
                if self.state.step >= self.total_steps:
                    break
                if self.stop.should_stop(self.acc.num_processes):   # a signal or the time limit, on any rank
                    saved = self._saved_step == self.state.step      # a periodic checkpoint of this very step
                    raise self.stop.stop(self.state.step, str(self.ckpt_dir / f"step_{self.state.step:08d}"
                                                              if saved else self.save_checkpoint()))
            if fresh_epoch and steps_taken == 0:
                raise RuntimeError(f"epoch {self.state.epoch} yielded no complete batch: check the training data")
            if self.state.step < self.total_steps or self.state.batches_in_epoch >= limit:
                self._next_epoch()  # the epoch's data is used up (a resume then starts the next one)

    def _after_step(self, out: dict[str, torch.Tensor], bar: tqdm) -> None:
        """Count the step; log, validate and checkpoint on their schedules."""
        self.state.step += 1
        bar.update(1)
        self._recent_losses.append(out["loss"].detach())  # kept as tensors: no device sync per step
        step = self.state.step
        checkpoint_due = bool(self.cfg.checkpoint_every) and step % self.cfg.checkpoint_every == 0
        if not self._skips_on_device or self._logs_at(step) or checkpoint_due or step >= self.total_steps:
            self._settle_steps()
        if self._logs_at(step):
            now, samples = time.perf_counter(), self.state.samples_seen
            t_last, samples_last = self._rate_mark
            self._rate_mark = (now, samples)
            self._log(out, (samples - samples_last) * self.acc.num_processes / max(now - t_last, 1e-9))
            bar.set_postfix(loss=f"{float(out['loss'].detach()):.4f}")
        if self._validates_at(step):
            self.run_evaluation()
        if self.cfg.checkpoint_every and step % self.cfg.checkpoint_every == 0:
            self.save_checkpoint()

    def _validates_at(self, step: int) -> bool:
        """A validation after step `step`: every `val_every` steps and at each of `val_at` (the last step's
        is the run's final evaluation, taken by the task)."""
        periodic = bool(self.cfg.val_every) and step % self.cfg.val_every == 0
        return (periodic or step in self.cfg.val_at) and step < self.total_steps

    def _logs_at(self, step: int) -> bool:
        """Whether optimizer step `step` (1-based) is written to metrics.jsonl."""
        return step % self.cfg.log_every == 0 or step == self.total_steps

    def recent_loss(self) -> float | None:
        """Mean training loss (this rank) over the last RECENT_LOSS_STEPS steps: where training ended up."""
        if not self._recent_losses:
            return None
        return float(torch.stack(list(self._recent_losses)).float().mean())

    def _next_epoch(self) -> None:
        self.state.epoch += 1
        self.state.batches_in_epoch = 0

    def _steps_of_epoch(self) -> Iterator[list[dict]]:
        """Groups of `accum_freq` micro-batches from the current epoch, after the ones already consumed."""
        accum = self.cfg.accum_freq
        limit = self.steps_per_epoch * accum
        loader = iter(self.make_loader(self.state.epoch))
        if self.state.batches_in_epoch:
            # resume inside an epoch: replay the data position (its skips were counted before the
            # checkpoint). With 0 loader workers the replayed batches' augmentations draw from the
            # global RNGs just restored from the checkpoint: put them back, so that the next batch
            # starts from the saved state as in an unbroken run.
            rng = get_rng_state()
            for _ in range(self.state.batches_in_epoch):
                next(loader)
            set_rng_state(rng)
        while self.state.batches_in_epoch < limit:
            group = list(itertools.islice(loader, accum))
            if len(group) < accum:
                got = self.state.batches_in_epoch + len(group)
                log.warning("epoch %d ended after %d of %d micro-batches", self.state.epoch, got, limit)
                # counted like a skip, so results.json says the epoch came up short
                self.state.skipped_samples[SHORTFALL] += limit - self.state.batches_in_epoch
                return
            self.state.batches_in_epoch += accum
            yield group
            del group  # before the next islice: a batch (pinned, on a GPU host) is freed when its step ends

    def _train_step(self, micro_batches: list[dict]) -> dict[str, torch.Tensor]:
        self.model.train()
        # buffers change in the forward pass (BatchNorm statistics, possibly to inf/NaN in an overflow):
        # a skipped step puts them back, so that it leaves no trace in the model
        self.sharding.sync_buffers(self.unwrapped)
        buffers = [b.detach().clone() for b in self.unwrapped.buffers()]
        for b in micro_batches:
            self._count_skips(b)
            self.state.samples_seen += _batch_size(b)
        if len(micro_batches) == 1:
            with self.acc.autocast():
                features = self.model(micro_batches[0])
                out = self.unwrapped.compute_loss(*features)
            self.acc.backward(out["loss"])
        else:
            out = self._accumulated_backward(micro_batches)
        self.sharding.after_backward(self.unwrapped)
        logged = self._logs_at(self.state.step + 1)  # the step being taken
        # mean feature norms for the log, kept as 0-d tensors (no device sync) and only on logged steps
        self._log_norms = ([f.detach().float().norm(dim=-1).mean() for f in features]
                           if logged and len(micro_batches) == 1 else None)
        grad_norm = self._clip_gradients()
        finite = torch.isfinite(out["loss"].detach()) & torch.isfinite(grad_norm)
        if self._skips_on_device:
            self._inner_optimizer.found_inf = (~finite).float()  # the fused kernel leaves everything as it was
            self.optimizer.step()
            self._inner_optimizer.found_inf = None
            self._keep_buffers_where(finite, buffers)
            self.unwrapped.project_()
        elif bool(finite):
            self.optimizer.step()
            self.unwrapped.project_()
        else:
            self._keep_buffers_where(finite, buffers)
        keys = [k for b in micro_batches for k in b.get("keys", [])][:8]
        self._pending.append(StepOutcome(self.state.step + 1, finite, keys, out["loss"].detach(), grad_norm,
                                         len(micro_batches)))
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        out["grad_norm"] = grad_norm
        return out

    @torch.no_grad()
    def _keep_buffers_where(self, finite: torch.Tensor, saved: list[torch.Tensor]) -> None:
        """Buffers as the forward pass left them where the step was finite, else as they were before it."""
        for b, before in zip(self.unwrapped.buffers(), saved):
            b.copy_(torch.where(finite, b, before))

    def _accumulated_backward(self, micro_batches: list[dict]) -> dict[str, torch.Tensor]:
        """open_clip's --accum-freq: a loss over all micro-batches' features, one micro-batch with grad at a time."""
        with torch.no_grad(), self.acc.autocast():
            cached = [self.model(b) for b in micro_batches]
        out: dict[str, torch.Tensor] = {}
        for j, batch in enumerate(micro_batches):
            last = j == len(micro_batches) - 1
            with (self.sharding.no_sync(self.model) if not last else nullcontext()):
                with self.acc.autocast():
                    fresh = self.model(batch)
                    parts = [torch.cat([c[k] if i != j else fresh[k] for i, c in enumerate(cached)])
                             for k in range(len(fresh))]
                    out = self.unwrapped.compute_loss(*parts)
                self.acc.backward(out["loss"])
        # the loss's own parameters (logit scale, exponents) took part in every micro-batch's loss,
        # so they hold accum_freq copies of their gradient (open_clip's --accum-freq keeps them so)
        for p in self.unwrapped.loss_parameters():
            if p.grad is not None:
                p.grad /= len(micro_batches)
        return out

    def _clip_gradients(self) -> torch.Tensor:
        """The total gradient norm as a 0-d tensor (read on the host only on log steps)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return torch.zeros((), device=self.acc.device)
        return self.sharding.grad_norm(params, self.cfg.grad_clip)

    def _settle_steps(self) -> None:
        """Read the outcome of the steps taken since the last call (one host sync): count and report each
        skipped non-finite step; stop the run after `max_nonfinite_steps` in a row."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        for outcome, finite in zip(pending, torch.stack([p.finite for p in pending]).tolist()):
            if finite:
                self.state.nonfinite_steps = 0
                continue
            self.state.nonfinite_steps += 1
            self.state.skipped_samples["nonfinite_step_batches"] += outcome.batches
            msg = (f"step {outcome.step}: non-finite loss {float(outcome.loss)} or gradient norm "
                   f"{float(outcome.grad_norm)}; step skipped (first keys {outcome.keys}, "
                   f"state {self.unwrapped.log_state()})")
            log.warning(msg)
            if self.state.nonfinite_steps >= self.cfg.max_nonfinite_steps:
                raise NonFiniteLossError(f"{msg}; {self.state.nonfinite_steps} non-finite steps in a row, stopping")

    def _count_skips(self, batch: dict) -> None:
        self.state.skipped_samples.update(batch.get("skipped", {}))

    # ---------------------------------------------------------------- evaluation and logs
    def run_evaluation(self) -> dict[str, float]:
        if self.evaluate is None:
            return {}
        self.model.eval()
        step = self.state.step
        metrics = self.evaluate_model(lambda module: self.evaluate(module, step)) or {}
        if self.acc.is_main_process:
            self.metrics.write({"step": step, "epoch": self.state.epoch, **{f"val/{k}": v for k, v in metrics.items()}})
        with naming_lost_ranks(f"the evaluation after step {step}"):
            self.acc.wait_for_everyone()
        return metrics

    def evaluate_model(self, evaluate: Callable[[nn.Module], Any]) -> Any:
        """`evaluate(module)` under no_grad and the training's autocast where the evaluation runs (every process calls
        this; the main process gets the result, the others None): on the main process with the whole model (ddp; under
        fsdp on one process), or under fsdp on every rank with the sharded model, each encoding its share
        (`sharding.eval_share()`, which the task's evaluation takes)."""
        if self.sharding.eval_share().sharded:
            with naming_lost_ranks(f"the sharded evaluation after step {self.state.step}"), torch.no_grad(), \
                    self.acc.autocast():
                out = evaluate(self.unwrapped)
            return out if self.acc.is_main_process else None
        module = self.eval_module()
        out = None
        if self.acc.is_main_process:
            with torch.no_grad(), self.acc.autocast():
                out = evaluate(module)
            self.sharding.release(module)
        return out

    def eval_module(self) -> nn.Module | None:
        """The module the main process evaluates where the evaluation is not sharded: the model itself (the main
        process gets it, `sharding.release` it after)."""
        with naming_lost_ranks("the gathering of the model for its evaluation"):
            return self.sharding.eval_module(self.unwrapped)

    def _log(self, out: dict[str, torch.Tensor], samples_per_s: float) -> None:
        record: dict[str, Any] = {"step": self.state.step, "epoch": self.state.epoch,
                                  "lr": self.scheduler.get_last_lr()[0], "samples_per_s": samples_per_s}
        record.update({k: float(v.detach()) for k, v in out.items()})
        record.update(self.unwrapped.log_state())
        if self._log_norms is not None:
            for name, norm in zip(self.unwrapped.feature_names, self._log_norms):
                record[f"norm_{name}"] = float(norm)
        skipped = self.reduce_counts(self.state.skipped_samples)
        record["skipped"] = dict(skipped)
        record["skipped_total"] = sum(skipped.values())
        self.metrics.write(record)

    def reduce_counts(self, counts: Counter) -> Counter:
        """Sum per-rank counters over all ranks (every rank must call this)."""
        return _sum_counts(self._gather_counts(counts))

    def _gather_counts(self, counts: Counter) -> list[dict[str, int]]:
        """Every rank's counts, in rank order (they differ: each rank reads its own shards); a collective."""
        with naming_lost_ranks("the exchange of skipped-sample counts between ranks"):
            return gather_objects(dict(counts))

    def close(self) -> None:
        self.metrics.close()

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        """checkpoints/step_N of the current step (the main process writes; every process calls it)."""
        self._settle_steps()  # the counts it saves are complete
        skips_by_rank = self._gather_counts(self.state.skipped_samples)  # a resume gives each rank its own back
        final = self.ckpt_dir / f"step_{self.state.step:08d}"
        t0 = time.perf_counter()
        if self.sharding.name == "fsdp":
            self._save_sharded_checkpoint(skips_by_rank)
        elif self.acc.is_main_process:
            state = self._training_state(skips_by_rank)
            self.stop.set_checkpoint_size(state_bytes(state))
            self.checkpointer.save(self.unwrapped, state, self.state.step)
        self.acc.wait_for_everyone()
        self.stop.checkpoint_took(time.perf_counter() - t0)
        self._saved_step = self.state.step
        return final

    def _save_sharded_checkpoint(self, skips_by_rank: list[dict[str, int]]) -> None:
        """Every rank writes its shards (DCP) into the step's temporary folder; the main process adds the consolidated
        model files and state.pt and renames the folder into place (a kill leaves the previous checkpoint whole)."""
        step = self.state.step
        self.sharding.sync_buffers(self.unwrapped)  # rank 0's BatchNorm statistics, whichever rank writes them
        tmp = self.checkpointer.begin(step) if self.acc.is_main_process else self.checkpointer.tmp_dir(step)
        with naming_lost_ranks(f"the sharded checkpoint of step {step}"):
            self.acc.wait_for_everyone()
            self.checkpointer.write_or_fail(step, lambda: save_sharded(tmp / SHARDED_DIR, self.unwrapped, self.optimizer,
                                                                       trainable_only=self.frozen_base is not None))
            if self.frozen_base is not None and self.save_trained is not None:   # LoRA: the adapters, gathered alone
                trained = self.sharding.gathered_trainable(self.unwrapped)
                if self.acc.is_main_process:
                    state = self._training_state(skips_by_rank, sharded=True)
                    self.stop.set_checkpoint_size(state_bytes(state) + _shard_bytes(tmp / SHARDED_DIR))
                    self.checkpointer.finish(None, state, step,
                                             write_model=lambda folder: self.save_trained(self.unwrapped, trained, folder))
                return
            with (self.sharding.full_module(self.unwrapped) if self._writes_full_model() else nullcontext()) as full:
                if self.acc.is_main_process:
                    state = self._training_state(skips_by_rank, sharded=True)
                    self.stop.set_checkpoint_size(state_bytes(state) + _shard_bytes(tmp / SHARDED_DIR))
                    self.checkpointer.finish(full, state, step)

    def _writes_full_model(self) -> bool:
        """Whether this fsdp checkpoint also holds the consolidated model files (`train.save_full_model`), which
        gathers the full weights on the main process; without them the step folder holds the DCP shards alone."""
        when = self.cfg.save_full_model
        return when == "every" or (when == "last" and self.state.step >= self.total_steps)

    def _training_state(self, skips_by_rank: list[dict[str, int]] | None = None, sharded: bool = False) -> dict[str, Any]:
        partial = self.frozen_base is not None   # a LoRA run: what trains (and the buffers), not the frozen base
        module_state = None if sharded else trainable_state(self.unwrapped) if partial else dict(self.unwrapped.state_dict())
        return {
            # under fsdp the model and optimizer state are the step folder's DCP shards (sharding.SHARDED_DIR)
            "module": module_state,
            "optimizer": None if sharded else self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.acc.scaler.state_dict() if self.acc.scaler is not None else None,
            "loop": {"step": self.state.step, "epoch": self.state.epoch, "batches_in_epoch": self.state.batches_in_epoch,
                     "samples_seen": self.state.samples_seen, "skipped_samples": dict(self.state.skipped_samples),
                     "skipped_samples_by_rank": skips_by_rank or [dict(self.state.skipped_samples)],
                     "recent_losses": [float(x) for x in self._recent_losses],  # train_loss_recent after a resume
                     "wall_s": self.wall_time_s(), "metrics_lines": self.metrics.lines,
                     "world_size": self.acc.num_processes, "batch_size": self.cfg.batch_size,
                     "sharding": self.sharding.name, "trainable_only": partial},
            "rng": get_rng_state(),
            **({"base": self.frozen_base} if partial else {}),
        }

    def load_checkpoint(self, path: Path) -> None:
        state = self.checkpointer.load_state(path)
        if state["loop"].get("trainable_only"):   # a LoRA checkpoint: its adapters mean nothing on another base
            check_base(state.get("base"), self.frozen_base or {}, path)
        with naming_lost_ranks(f"the loading of checkpoint {path}"):
            how = load_training_weights(path, state, self.unwrapped, self.optimizer, self.sharding)
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"] is not None and self.acc.scaler is not None:
            self.acc.scaler.load_state_dict(state["scaler"])
        loop = state["loop"]
        self.state = LoopState(step=loop["step"], epoch=loop["epoch"], batches_in_epoch=self._data_position(loop),
                               samples_seen=loop["samples_seen"], skipped_samples=self._own_skips(loop),
                               wall_before_s=loop.get("wall_s", 0.0))
        if "wall_s" not in loop:
            log.warning("%s records no wall time (an older checkpoint): wall_time_s counts this process only", path)
        self._recent_losses.clear()
        self._recent_losses.extend(torch.tensor(x, device=self.acc.device) for x in loop.get("recent_losses", []))
        set_rng_state(state["rng"])
        self._resumed = ResumePoint(self.state.step, loop.get("metrics_lines"))
        log.info("resumed from %s at step %d (epoch %d, batch %d): %s", path, self.state.step, self.state.epoch,
                 self.state.batches_in_epoch, how)

    def _data_position(self, loop: dict[str, Any]) -> int:
        position = resumed_data_position(loop, self.acc.num_processes, self.cfg.batch_size, self.cfg.accum_freq)
        world = loop.get("world_size", self.acc.num_processes)
        if world != self.acc.num_processes and loop["batches_in_epoch"]:
            (log.warning if self.acc.is_main_process else log.debug)(
                "the checkpoint was written by %d processes, this run has %d: the epoch in progress continues from "
                "micro-batch %d on every rank (the same share of the epoch); its shards are split over the ranks anew, "
                "so until the epoch ends some samples are read twice and others not at all", world,
                self.acc.num_processes, position)
        return position

    def _own_skips(self, loop: dict[str, Any]) -> Counter:
        """This rank's skip counts from a checkpoint: its own entry when the world size is unchanged; with
        another world size the main process takes the total (the sum over ranks stays right)."""
        by_rank = loop.get("skipped_samples_by_rank")
        if not by_rank:  # a checkpoint written before per-rank counts were kept
            return Counter(loop["skipped_samples"])
        if len(by_rank) == self.acc.num_processes:
            return Counter(by_rank[self.acc.process_index])
        return _sum_counts(by_rank) if self.acc.is_main_process else Counter()


def _sum_counts(counts: Iterable[dict[str, int]]) -> Counter:
    return sum((Counter(c) for c in counts), Counter())


def resumed_data_position(loop: dict[str, Any], world_size: int, batch_size: int, accum_freq: int) -> int:
    """This rank's micro-batches already taken of the epoch in progress, on resuming a checkpoint's `loop` state. On
    the world size the checkpoint was written with, its own count (the run continues exactly). On another, the same
    share of the epoch: the samples of the global batches taken so far, over the new global batch, rounded down to
    whole steps. The shards are split over the ranks anew, so the new ranks' first batches of the epoch are skipped
    without being the ones taken before: until the epoch ends some samples are read twice and others not at all
    (later epochs are whole)."""
    world = loop.get("world_size", world_size)
    taken = loop["batches_in_epoch"]
    if world == world_size or not taken:
        return taken
    samples = taken * loop.get("batch_size", batch_size) * world
    return samples // (batch_size * world_size) // accum_freq * accum_freq


def _shard_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*") if f.is_file())


def _batch_size(batch: dict) -> int:
    for v in batch.values():
        if isinstance(v, torch.Tensor):
            return int(v.shape[0])
    return 0
