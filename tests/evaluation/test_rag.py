"""RAG retrieval metrics (magclip.metrics.rag, eval/rag.py): SQuAD normalization and EM, answer recall
at a known rank, gold-passage accuracy, distractors never make it easier, the generator hook end to
end with a tiny randomly initialized GPT-2 (its EM is meaningless: only that it runs and is
computed), and the keys of results.json."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from magclip.data.qa import QAData, load_distractors, load_qa
from magclip.evaluation.rag import build_prompt, evaluate_rag, fit_prompt, generate_answers
from magclip.metrics.rag import (
    DEFAULT_KS,
    contains_answer,
    exact_match,
    generator_exact_match,
    normalize_answer,
    normalize_for_match,
    rag_metrics,
)
from builders import make_tiny_bert

ROOT = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("MAGCLIP_SHARED_DATA", ROOT.parent / "shared" / "data"))
XQUAD = SHARED / "text" / "xquad_en"

spec = importlib.util.spec_from_file_location("eval_rag", ROOT / "eval" / "rag.py")
eval_rag = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eval_rag)


# ---------------------------------------------------------------------------- builders
def write_qa(folder: Path, docs: list[dict], rows: list[dict], qrels: list[tuple[str, str, int]] | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": r["id"], "text": r.get("question", "")}) + "\n"
                                                  for r in rows))
    if qrels is not None:
        (folder / "qrels").mkdir(exist_ok=True)
        (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n"
                                                   + "".join(f"{q}\t{d}\t{s}\n" for q, d, s in qrels))
    return folder


TOY_DOCS = [
    {"_id": "p0", "title": "Whales", "text": "The blue whale is the largest animal, up to 30 metres long."},
    {"_id": "p1", "title": "Cats", "text": "A cat sat on the mat in 1924; cats sleep for 16 hours."},
    {"_id": "p2", "title": "Dogs", "text": "The dog ran to the park. Dogs were domesticated early."},
    {"_id": "p3", "title": "Cells", "text": "Protein made in the cell by ribosomes; a gene codes for it."},
]
TOY_ROWS = [
    {"id": "q0", "question": "what is the largest animal", "answers": ["the Blue Whale"], "passage_id": "p0"},
    {"id": "q1", "question": "how long do cats sleep", "answers": ["16 hours"], "passage_id": "p1"},
    {"id": "q2", "question": "what makes protein", "answers": ["ribosomes"], "passage_id": "p3"},
]
TOY_QRELS = [("q0", "p0", 1), ("q1", "p1", 1), ("q2", "p3", 1)]


def vector_encoder(table: dict[str, list[float]]):
    """encode(texts, side) from a fixed text -> vector table (queries and passages share it)."""
    def encode(texts, side):
        return torch.tensor([table[t] for t in texts], dtype=torch.float32)
    return encode


# ---------------------------------------------------------------------------- normalization
@pytest.mark.parametrize("raw, norm", [
    ("The Cat!", "cat"),
    ("  An   apple,\ta day\n", "apple day"),
    ("Theory of the atheist", "theory of atheist"),  # articles only as whole words
    ("U.S.A.", "usa"),
    ("rock'n'roll", "rocknroll"),                    # punctuation deleted, not spaced (SQuAD)
    ("a", ""),
    ("6½ sacks", "6½ sacks"),
    ("“Quoted” – text", "“quoted” – text"),          # non-ASCII punctuation kept, as in SQuAD
    ("Théâtre", "théâtre"),
])
def test_normalize_answer_is_squad(raw, norm):
    assert normalize_answer(raw) == norm


def test_exact_match_and_answer_matching_rules():
    assert exact_match("the Denver Broncos.", ["Denver Broncos"]) == 1.0
    assert exact_match("Broncos", ["Denver Broncos", "Carolina"]) == 0.0
    assert exact_match("carolina", ["Denver Broncos", "Carolina"]) == 1.0
    assert generator_exact_match(["Denver Broncos", "x"], [["denver broncos"], ["y"]]) == 0.5
    # token rule: whole tokens, punctuation splits
    p = normalize_for_match("Manning's 24-yard pass in 1924, Six-time winner")
    assert p == "manning s 24 yard pass in 1924 six time winner"
    assert contains_answer(p, [normalize_for_match("Manning")])
    assert contains_answer(p, [normalize_for_match("six")])
    assert not contains_answer(p, [normalize_for_match("4")]) and not contains_answer(p, [normalize_for_match("92")])
    assert not contains_answer(p, [""]) and not contains_answer(p, [normalize_for_match("the")])
    # substring rule: the literal reading, on SQuAD-normalized strings
    q = normalize_answer("Manning's 24-yard pass in 1924")
    assert contains_answer(q, ["92"], "substring") and contains_answer(q, ["manning"], "substring")
    with pytest.raises(ValueError, match="answer_match"):
        rag_metrics([["a"]], [["x"]], [["a"]], {"a": "x"}, answer_match="fuzzy")


# ---------------------------------------------------------------------------- metrics
def test_answer_recall_at_known_rank_and_gold_accuracy():
    texts = {f"d{i}": normalize_for_match(f"filler passage number {i}") for i in range(10)}
    texts["d6"] = normalize_for_match("The answer is Blue Whale, obviously.")
    texts["d2"] = normalize_for_match("Paris is the capital")
    ranked = [[f"d{i}" for i in range(10)],                       # answer at rank 7, gold (d6) at rank 7
              [f"d{i}" for i in (2, 0, 1, 3, 4, 5, 6, 7, 8, 9)],  # answer and gold at rank 1
              [f"d{i}" for i in range(10)]]                       # answer nowhere, gold d0 at rank 1
    answers = [["a blue whale"], ["paris"], ["Atlantis"]]
    gold = [["d6"], ["d2"], ["d0"]]
    m = rag_metrics(ranked, answers, gold, texts, ks=(1, 5, 7, 10))
    assert m["answer_recall@1"] == pytest.approx(1 / 3)
    assert m["answer_recall@5"] == pytest.approx(1 / 3)
    assert m["answer_recall@7"] == pytest.approx(2 / 3) and m["answer_recall@10"] == pytest.approx(2 / 3)
    assert m["gold_passage_acc@1"] == pytest.approx(2 / 3)
    assert m["gold_passage_recall@7"] == pytest.approx(1.0) and m["gold_passage_recall@5"] == pytest.approx(2 / 3)
    assert m["answer_in_gold_passage"] == pytest.approx(2 / 3)  # Atlantis is not in d0
    assert m["questions"] == 3 and m["gold_questions"] == 3 and "distractor_top1" not in m
    # a question without a gold passage is left out of gold_* only
    m = rag_metrics(ranked, answers, [["d6"], [], ["d0"]], texts, ks=(1,))
    assert m["gold_passage_acc@1"] == pytest.approx(0.5) and m["gold_questions"] == 2 and m["questions"] == 3


def test_evaluate_rag_ranks_like_the_scorer(tmp_path):
    data = load_qa(write_qa(tmp_path / "toy", TOY_DOCS, TOY_ROWS, TOY_QRELS))
    assert data.warnings == {} and data.gold == {"q0": ["p0"], "q1": ["p1"], "q2": ["p3"]}
    docs = {d["_id"]: f"{d['title']} {d['text']}" for d in TOY_DOCS}
    # q0 -> p0 first; q1 -> p1 last (rank 4) under cosine but first under dot (p1 has a large norm);
    # q2 -> p3 second
    table = {docs["p0"]: [1, 0, 0], docs["p1"]: [0, 10, 0.0], docs["p2"]: [0.6, 0.8, 0], docs["p3"]: [0.8, 0, 0.6],
             "what is the largest animal": [1, 0, 0], "how long do cats sleep": [0.8, 0.2, 0.6],
             "what makes protein": [1, 0, 0.1]}
    out = evaluate_rag(vector_encoder(table), data, ["cosine", "dot"], ks=(1, 2, 4), keep_ranked=4)
    cos, dot = out["modes"]["cosine"], out["modes"]["dot"]
    assert out["ranked"]["cosine"][1] == ["p3", "p0", "p2", "p1"]
    assert cos["answer_recall@1"] == pytest.approx(1 / 3) and cos["answer_recall@2"] == pytest.approx(2 / 3)
    assert cos["answer_recall@4"] == 1.0 and cos["gold_passage_acc@1"] == pytest.approx(1 / 3)
    assert out["ranked"]["dot"][1][0] == "p1" and dot["answer_recall@1"] == pytest.approx(2 / 3)
    assert out["passages"] == 4 and out["distractor_passages"] == 0 and cos["scorer"]["mode"] == "cosine"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_distractors_never_make_it_easier(tmp_path, seed):
    g = torch.Generator().manual_seed(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda omicron sigma tau".split()
    docs = [{"_id": f"p{i}", "title": "", "text": f"{words[i]} is written here, with {words[(i + 3) % 14]}"}
            for i in range(12)]
    rows = [{"id": f"q{i}", "question": f"question {i}", "answers": [words[i]], "passage_id": f"p{i}"}
            for i in range(12)]
    data = load_qa(write_qa(tmp_path / "qa", docs, rows, None))
    assert data.gold_source == "qa.jsonl passage_id"
    dist_folder = tmp_path / "noise"
    dist_folder.mkdir()
    (dist_folder / "corpus.jsonl").write_text("".join(
        json.dumps({"_id": f"p{i}", "title": "", "text": f"nothing useful number {i}"}) + "\n" for i in range(30)))
    distractors, counts = load_distractors([dist_folder], taken=data.corpus)
    assert counts == {"noise": 30} and all(d.startswith("noise:") for d in distractors)  # ids prefixed
    texts = [f"question {i}" for i in range(12)] + [d["text"] for d in docs] + [d["text"] for d in distractors.values()]
    table = {t: torch.randn(8, generator=g).tolist() for t in texts}
    for i in range(12):  # questions lean towards their gold passage, so the clean pool is not hopeless
        table[f"question {i}"] = (torch.tensor(table[docs[i]["text"]]) + torch.randn(8, generator=g)).tolist()
    encode = vector_encoder(table)
    for mode in ("cosine", "dot", "qnorm", "dnorm"):
        clean = evaluate_rag(encode, data, [mode], ks=(1, 3, 5))["modes"][mode]
        hard = evaluate_rag(encode, data, [mode], distractors=distractors, ks=(1, 3, 5))["modes"][mode]
        for key in ("answer_recall@1", "answer_recall@3", "answer_recall@5", "gold_passage_acc@1",
                    "gold_passage_recall@5"):
            assert hard[key] <= clean[key], (mode, key)
        assert hard["answer_only_in_distractors@5"] == 0.0 and "distractor_top1" in hard
    # the constructed case: q0 sits next to its gold passage; a distractor exactly on q0 takes rank 1
    table["question 0"] = (torch.tensor(table[docs[0]["text"]]) + 0.05 * torch.randn(8, generator=g)).tolist()
    first = next(iter(distractors))
    table[distractors[first]["text"]] = table["question 0"]
    clean = evaluate_rag(encode, data, ["cosine"], ks=(1,), keep_ranked=1)
    hard = evaluate_rag(encode, data, ["cosine"], distractors=distractors, ks=(1,), keep_ranked=1)
    assert clean["ranked"]["cosine"][0] == ["p0"] and hard["ranked"]["cosine"][0] == [first]
    c, h = clean["modes"]["cosine"], hard["modes"]["cosine"]
    assert h["gold_passage_acc@1"] <= c["gold_passage_acc@1"] - 1 / 12 + 1e-9
    assert h["answer_recall@1"] <= c["answer_recall@1"] - 1 / 12 + 1e-9 and h["distractor_top1"] >= 1 / 12


def test_distractor_with_the_answer_string_is_counted(tmp_path):
    data = load_qa(write_qa(tmp_path / "qa", TOY_DOCS, TOY_ROWS, TOY_QRELS))
    distractors = {"x:1": {"title": "", "text": "Ribosomes are also found in bacteria."}}
    docs = {d["_id"]: f"{d['title']} {d['text']}" for d in TOY_DOCS}
    table = {docs["p0"]: [1, 0], docs["p1"]: [0, 1], docs["p2"]: [0.7, 0.7], docs["p3"]: [0.6, 0.8],
             "Ribosomes are also found in bacteria.": [0.01, 1], "what is the largest animal": [1, 0],
             "how long do cats sleep": [0, 1], "what makes protein": [0.01, 1]}
    m = evaluate_rag(vector_encoder(table), data, ["cosine"], distractors=distractors, ks=(1,))["modes"]["cosine"]
    assert m["answer_only_in_distractors@1"] == pytest.approx(1 / 3)  # q2 credited by the distractor only
    assert m["gold_passage_acc@1"] == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------- generator hook
def make_tiny_gpt2(folder: Path, texts: list[str], n_positions: int = 64) -> Path:
    """A 1-layer random GPT-2 (n_embd 32) over a word-level tokenizer built from `texts`."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    split = pre_tokenizers.Whitespace()
    words = {w for t in texts + [build_prompt("q", ["p"])] for w, _ in split.pre_tokenize_str(t.lower())}
    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "<eos>"] + sorted(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="<eos>")
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(vocab), n_positions=n_positions, n_embd=32, n_layer=1, n_head=2,
                     bos_token_id=2, eos_token_id=2, pad_token_id=1)
    GPT2LMHeadModel(cfg).eval().save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> Path:
    texts = [d["title"] + " " + d["text"] for d in TOY_DOCS] + [r["question"] for r in TOY_ROWS]
    return make_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2"), texts)


def test_generator_hook_runs_and_cuts_long_prompts(tiny_gpt2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_gpt2))
    long = TOY_DOCS[0]["text"] * 10                                  # far more than 64 positions
    prompt, cut = fit_prompt(tok, "what is the largest animal", [long, TOY_DOCS[1]["text"]], 60)
    assert cut == 1 and len(tok(prompt)["input_ids"]) <= 60
    assert prompt.endswith("Question: what is the largest animal\nAnswer:")
    questions = [r["question"] for r in TOY_ROWS]
    passages = [[long, TOY_DOCS[1]["text"], TOY_DOCS[2]["text"]]] * 3
    preds = generate_answers(tiny_gpt2, questions, passages, k_ctx=2, max_new_tokens=4, batch_size=2)
    assert len(preds) == 3 and all(isinstance(p, str) for p in preds)
    assert preds == generate_answers(tiny_gpt2, questions, passages, k_ctx=2, max_new_tokens=4, batch_size=3)
    em = generator_exact_match(preds, [r["answers"] for r in TOY_ROWS])  # random model: value meaningless
    assert 0.0 <= em <= 1.0
    with pytest.raises(FileNotFoundError, match="local folder"):
        generate_answers(tiny_gpt2 / "nope", questions, passages)


def test_launcher_results_json_with_distractors_and_generator(tmp_path, tiny_gpt2, capsys):
    qa = write_qa(tmp_path / "toyqa", TOY_DOCS, TOY_ROWS, TOY_QRELS)
    noise = tmp_path / "noise"
    noise.mkdir()
    (noise / "corpus.jsonl").write_text(json.dumps({"_id": "p0", "title": "t", "text": "a dog sat"}) + "\n")
    bert = make_tiny_bert(tmp_path / "bert")
    out = tmp_path / "res.json"
    res = eval_rag.main(["--model", str(bert), "--data", str(qa), "--distractors", str(noise), "--mode", "cosine",
                         "dot", "--out", str(out), "--generator", str(tiny_gpt2), "--max-new-tokens", "3",
                         "--max-questions", "2", "--k-ctx", "2"])
    saved = json.loads(out.read_text())
    assert saved.keys() == res.keys() == {"toyqa"}
    e = saved["toyqa"]
    for k in DEFAULT_KS:
        assert 0.0 <= e[f"answer_recall@{k}"] <= 1.0
    assert e["answer_recall@20"] == 1.0                      # the whole pool (5 passages) is retrieved
    assert {"gold_passage_acc@1", "questions", "passages", "modes", "scorer", "warnings"} <= e.keys()
    assert e["questions"] == 3 and e["passages"] == 5 and e["distractor_passages"] == 1
    assert e["distractors"] == {"noise": 1} and e["scorer"]["mode"] == "cosine" and set(e["modes"]) == {"cosine", "dot"}
    g = e["generator"]
    assert g["questions"] == 2 and len(g["predictions"]) == 2 and 0.0 <= g["exact_match"] <= 1.0
    assert g["exact_match"] == sum(p["em"] for p in g["predictions"]) / 2
    table = capsys.readouterr().out
    assert "| toyqa | cosine |" in table and "| toyqa | dot |" in table and "generator EM" in table


@pytest.mark.skipif(not XQUAD.is_dir(), reason=f"real xquad_en not found at {XQUAD} (../shared/data)")
def test_xquad_loads_and_every_answer_is_in_its_gold_passage():
    data = load_qa(XQUAD)
    assert isinstance(data, QAData) and data.warnings == {} and data.gold_source == "qrels/test.tsv"
    assert len(data.questions) == 1190 and len(data.corpus) == 240
    qids = list(data.questions)
    texts = {d: normalize_for_match(v["text"]) for d, v in data.corpus.items()}
    m = rag_metrics([data.gold[q] for q in qids], [data.answers[q] for q in qids], [data.gold[q] for q in qids],
                    texts, ks=(1,))
    assert m["gold_passage_acc@1"] == 1.0
    assert m["answer_recall@1"] >= 0.999  # one answer in the data is cut off mid-number
