"""Issue 71 item 4, a reranker through the classifier's chain: recipes/rerank_search.yaml shrunk
onto a random-init cross-encoder (2 layers, 64 wide, one-label head) and a small pair table
(JSONL: query, document, relevance; 24 train and 16 eval queries x 5 documents): distilled
into a 1-layer student on the teacher's score logits, pruned (unstructured, half of each
chosen Linear, with recovery towards its unpruned scores), exported as ONNX Runtime int8 and
searched (ONNX Runtime int8 and float, on the student and on a shape with half its FFN
neurons removed) within a Kendall's tau budget against the float teacher. Every stage is
scored by nDCG@10 and MRR@10 against the labels and by Kendall's tau against the teacher; the
search keeps the fastest trial within the budget, judged by that measure. What a reranker does
not take is refused by `compress validate` in one line each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import REPO, cli, minilm_folder, write_recipe

NOUNS = ["film", "cast", "script", "score", "plot", "pace", "ending", "camera", "story",
         "music"]
ADJECTIVES = ["gripping", "dull", "sharp", "lifeless", "warm", "clumsy", "superb", "flat"]


def write_pairs(path: Path, queries: range) -> None:
    """Query q asks for noun q % 10 described by adjective q % 8: the document saying both is
    relevant (2), one with the adjective and another noun partly (1), three others not (0)."""
    rows = []
    for q in queries:
        noun, adjective = NOUNS[q % len(NOUNS)], ADJECTIVES[q % len(ADJECTIVES)]
        others = [NOUNS[(q + k) % len(NOUNS)] for k in (1, 3, 5, 7)]
        documents = [(f"the {noun} is {adjective} throughout", 2),
                     (f"a {adjective} {others[0]}, not much more", 1),
                     *((f"this {other} felt {ADJECTIVES[(q + k) % len(ADJECTIVES)]}", 0)
                       for k, other in zip((2, 4, 6), others[1:], strict=True))]
        rows += [{"query": f"{adjective} {noun}", "document": d, "relevance": grade}
                 for d, grade in documents]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def cross_encoder(folder: Path, pairs: Path) -> Path:
    """A random 2-layer, 64-wide BERT with a one-label head (a Hugging Face folder, as
    sentence-transformers before v6 saved a CrossEncoder), its head scaled and shifted so that
    its logits over the pairs in `pairs` have mean 0 and deviation 2: its Sigmoid scores
    spread over (0, 1), where a random head's sit within 0.002 of each other (near-ties)."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder(), model_max_length=32)
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, max_position_embeddings=64,
        num_labels=1, initializer_range=0.2)).eval()
    rows = [json.loads(line) for file in sorted(pairs.glob("*.jsonl"))
            for line in file.read_text().splitlines()]
    inputs = tokenizer([r["query"] for r in rows], [r["document"] for r in rows],
                       padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[:, 0]
        scale = 2 / logits.std()
        model.classifier.weight.mul_(scale)
        model.classifier.bias.copy_((model.classifier.bias - logits.mean()) * scale)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> tuple[Path, Path]:
    """(the cross-encoder's folder, the pair table's folder)."""
    tmp = tmp_path_factory.mktemp("rerank_sources")
    write_pairs(tmp / "pairs" / "train.jsonl", range(24))
    write_pairs(tmp / "pairs" / "validation.jsonl", range(24, 40))
    return cross_encoder(tmp / "ce", tmp / "pairs"), tmp / "pairs"


def shrunk_recipe(sources: tuple[Path, Path], out: Path) -> dict[str, Any]:
    """recipes/rerank_search.yaml on the tiny cross-encoder and the pair table, every stage
    cut to a few steps, package left out (tests/serving covers a reranker's archive); the
    search's budget loose (every trial within 100 nDCG@10 points)."""
    raw = yaml.safe_load((REPO / "recipes/rerank_search.yaml").read_text())
    distill, prune, export, search = raw["stages"][:4]
    assert [s["kind"] for s in raw["stages"]] == ["distill", "prune", "export", "search",
                                                  "package"]
    model, pairs = sources
    raw["model"]["source"] = str(model)
    raw["data"] = {"source": str(pairs), "text_column": "query",
                   "pair_column": "document", "label_column": "relevance", "max_length": 32,
                   "train": {"split": "train"},
                   "calibration": {"split": "train", "max_samples": 8},
                   "eval": {"split": "validation"}}
    distill.update(student={"layers": 1}, max_steps=20, batch_size=16, learning_rate=3e-3,
                   checkpoint_every=1000)
    prune = {"kind": "prune", "method": "unstructured", "amount": 0.5,
             "recovery": {"max_steps": 4, "batch_size": 16, "learning_rate": 1e-4}}
    export["min_kendall_tau"] = 0.5  # a 1-layer random student: its int8 file is checked
    search.update(max_ndcg_drop=100.0, candidates=["ort_dynamic_int8", "onnx_fp32"],
                  calibration={"samples": 8, "batch_size": 8}, sensitivity_samples=8,
                  max_fallback_layers=1, final_rounds=1, shapes=[{"ffn": 0.5}],
                  shape_training={"max_steps": 2, "batch_size": 16,
                                  "recovery": {"max_steps": 2, "batch_size": 16}})
    search.pop("min_kendall_tau", None)
    search.pop("time_budget_s")
    raw["stages"] = [distill, prune, export, search]
    raw["evaluation"] = {"batch_size": 32, "latency": {
        "enabled": False, "batch_sizes": [1, 8], "seq_len": 16, "iters": 2, "warmup": 1}}
    raw["output_dir"] = str(out)
    return raw


def searched(run_dir: Path) -> dict[str, Any]:
    """search.json of the run, with its finished trials as `ok`."""
    record = json.loads((run_dir / "03-search/search.json").read_text())
    return {**record, "ok": [t for t in record["trials"] if t["status"] == "ok"]}


@pytest.fixture(scope="module")
def chain(sources, tmp_path_factory) -> dict[str, Any]:
    """The shrunk chain run twice in this process, the second time with a Kendall's tau
    budget instead, halfway between the highest and the lowest tau of the first search's
    trials (only the search stage runs again, from its cached trials): {"run_dir", "raw",
    "manifest", "metrics" (each stage's, by kind), "loose" and "tight" (search.json of each
    search), "min_tau"}."""
    from builders import run_in_process

    tmp = tmp_path_factory.mktemp("rerank_chain")
    raw = shrunk_recipe(sources, tmp / "runs")
    manifest = run_in_process(write_recipe(tmp / "rerank.yaml", raw))
    assert manifest["model"]["task"] == "reranking"
    run_dir = tmp / "runs" / raw["name"]
    loose = searched(run_dir)
    taus = sorted(t["kendall_tau"] for t in loose["ok"])
    assert taus[0] < taus[-1], taus  # the trials rank differently: a budget can split them
    min_tau = round((taus[0] + taus[-1]) / 2, 4)
    search = raw["stages"][3]
    search.pop("max_ndcg_drop")
    search["min_kendall_tau"] = min_tau
    again = run_in_process(write_recipe(tmp / "rerank.yaml", raw))
    assert [s["status"] for s in again["stages"]] == ["cached"] * 3 + ["done"], again
    return {"run_dir": run_dir, "raw": raw, "manifest": manifest, "min_tau": min_tau,
            "metrics": {s["kind"]: s["metrics"] for s in manifest["stages"]},
            "loose": loose, "tight": searched(run_dir),
            "tight_metrics": again["stages"][3]["metrics"]}


def test_every_stage_runs_and_is_ranked(chain) -> None:
    stages = chain["manifest"]["stages"]
    assert [(s["kind"], s["status"]) for s in stages] == [
        ("distill", "done"), ("prune", "done"), ("export", "done"), ("search", "done")]
    for kind, metrics in chain["metrics"].items():
        assert 0 < metrics["ndcg_at_10"] <= 1 and 0 < metrics["mrr_at_10"] <= 1, kind
        assert -1 <= metrics["kendall_tau"] <= 1, kind  # against the float teacher


def test_the_student_learns_the_teachers_scores(chain, sources) -> None:
    """The stage's closeness to the teacher, and the same figure of the untrained student
    (the teacher's last layer kept, as `student.layers: 1` keeps it): training raised it."""
    from compress.algorithms.distill import student_from_layers
    from compress.data.datasets import read_table
    from compress.families.reranker.distillation import as_reranker, classifier_view
    from compress.families.reranker.family import score
    from compress.families.reranker.folder import load_cross_encoder
    from compress.families.reranker.measures import pearson
    from compress.families.reranker.pairs import table_pairs

    distill = chain["metrics"]["distill"]
    assert (distill["teacher_layers"], distill["student_layers"]) == (2, 1)
    assert distill["params"] < distill["teacher_params"]
    assert distill["distill_loss"] == "mse of the score logit" and "temperature" not in distill
    # the teacher is the run's reference: the stage's tau is the student's against it
    assert distill["kendall_tau_to_teacher"] == pytest.approx(distill["kendall_tau"], abs=1e-6)
    teacher = load_cross_encoder(sources[0])
    untrained = as_reranker(student_from_layers(classifier_view(teacher), [1]), teacher)
    pairs = table_pairs(read_table(sources[1] / "validation.jsonl"), "query", "document",
                        "relevance", None, 0)
    want, got = (score(b.model, pairs, 32, teacher.tokenizer, 32) for b in (teacher, untrained))
    before = pearson(got, want)
    assert distill["score_pearson_to_teacher"] > before + 0.1, (before, distill)


def test_the_pruned_model_is_as_sparse_as_asked(chain) -> None:
    from compress.models.bundle import sparsity
    from compress.models.folders import load_saved

    prune = chain["metrics"]["prune"]
    assert prune["sparsity_target"] == 0.5
    assert prune["sparsity_layers"] == pytest.approx(0.5, abs=1e-3)
    assert prune["pruned_layers"] == 6  # q, k, v, attention output, FFN in and out
    assert 0 < prune["sparsity"] < 0.5  # the whole model: embeddings and head kept dense
    saved = load_saved(chain["run_dir"] / "01-prune" / "model")
    assert saved.kind == "reranker"
    assert sparsity(saved.model) == pytest.approx(prune["sparsity"], abs=1e-6)


def test_the_int8_file_is_held_to_its_source(chain) -> None:
    export = chain["metrics"]["export"]
    assert export["parity_kendall_tau"] >= export["parity_min_kendall_tau"] == 0.5
    assert export["runtime"] == "onnx"


def winner_is_the_fastest_within(record: dict[str, Any]) -> dict[str, Any]:
    """The winner of a search.json, checked: within the budget and the fastest trial within
    it (re-timed finalists: within 3% of the fastest)."""
    within = [t for t in record["ok"] if t["within"]]
    winner = next(t for t in record["ok"] if t.get("won"))
    assert winner in within and record["winner"] == winner["id"]
    if "final_ms" in winner:
        assert winner["final_ms"] <= 1.03 * min(t["final_ms"] for t in within
                                                if "final_ms" in t)
    else:
        assert winner[record["metric"]] == min(t[record["metric"]] for t in within)
    return winner


def test_every_trial_is_ranked_and_the_fastest_wins(chain) -> None:
    record = chain["loose"]
    assert record["budget"] == "max_ndcg_drop 100" and record["metric"] == "latency_ms_b32_real"
    assert {(t["shape"], t["candidate"]) for t in record["ok"]} == {
        (shape, candidate) for shape in (None, "all-ffn50")
        for candidate in ("ort_dynamic_int8", "onnx_fp32")}
    float_ndcg = chain["metrics"]["search"]["search_float_ndcg_at_10"]
    for t in record["ok"]:
        assert 0 < t["ndcg_at_10"] <= 1 and 0 < t["mrr_at_10"] <= 1 and t["within"]
        assert t["ndcg_drop"] == pytest.approx(100 * (float_ndcg - t["ndcg_at_10"]), abs=2e-3)
    winner_is_the_fastest_within(record)


def test_a_tau_budget_keeps_only_the_trials_that_rank_as_the_teacher(chain) -> None:
    record, min_tau = chain["tight"], chain["min_tau"]
    assert record["budget"] == f"min_kendall_tau {min_tau:g}"
    assert record["trials_cached"] >= 4  # the first search's trials, judged again
    for t in record["ok"]:
        assert t["within"] == (t["kendall_tau"] >= min_tau), t
        if not t["within"]:
            assert t["lost"].startswith(f"Kendall's tau {t['kendall_tau']:.4f} < "
                                        f"min_kendall_tau {min_tau:g}"), t
    assert any(not t["within"] for t in record["ok"])
    winner = winner_is_the_fastest_within(record)
    metrics = chain["tight_metrics"]
    assert metrics["search_min_kendall_tau"] == min_tau
    assert metrics["kendall_tau"] == winner["kendall_tau"] >= min_tau
    for path in (chain["run_dir"] / "03-search").rglob("sensitivity.json"):  # fallbacks
        assert json.loads(path.read_text())["divergence"] == "squared score difference"
    section = (chain["run_dir"] / "03-search/section.md").read_text()
    assert f"within min_kendall_tau {min_tau:g} of the float model" in section
    assert "| nDCG@10 | Δ pt | MRR@10 | tau |" in section


def test_a_search_shape_is_read_back_at_its_pruned_shapes(chain) -> None:
    from compress.data.datasets import Examples
    from compress.families.reranker.family import score
    from compress.models.folders import load_saved

    shape = chain["loose"]["shapes"][0]
    folder = chain["run_dir"] / "03-search/shapes" / shape["folder"] / "model"
    assert json.loads((folder / "structure.json").read_text())["modules"]
    bundle = load_saved(folder)
    assert bundle.kind == "reranker" and bundle.structure is not None
    layer = bundle.model.classifier.bert.encoder.layer[0]
    assert layer.intermediate.dense.out_features == 64  # half of 128
    assert shape["params"] == sum(p.numel() for p in bundle.model.parameters())
    pairs = Examples(labels=[0, 0], texts=["dull film", "warm plot"],
                     pairs=["the film is dull", "a warm story"])
    scores = score(bundle.model, pairs, 2, bundle.tokenizer, 32)
    assert scores.shape == (2,) and torch.isfinite(scores).all()


@pytest.mark.parametrize(("stages", "wanted"), [
    ([{"kind": "distill", "student": {"layers": 1}, "temperature": 3.0}],
     "stages.0.temperature: not an option of a reranker's distillation"),
    ([{"kind": "distill"}], "stages.0.student: required key is missing"),
    # no float teacher left: a distillation after int8
    ([{"kind": "quantize", "mode": "dynamic"}, {"kind": "distill", "student": {"layers": 1}}],
     "stages.1: a distill stage cannot take the model of a quantize stage"),
    ([{"kind": "prune", "amount": 1.5}], "stages.0.amount: Input should be less than 1"),
    ([{"kind": "prune", "recovery": {"max_steps": 1}, "recovery_distill": True}],
     "stages.0.recovery_distill: not an option of a reranker's prune"),
    ([{"kind": "search", "candidates": ["onnx_fp32"]}],
     "stages.0: a reranker's search needs a budget"),
    ([{"kind": "search", "min_kendall_tau": 0.9, "max_accuracy_drop": 1.0}],
     "stages.0.max_accuracy_drop: a reranker is held to min_kendall_tau and max_ndcg_drop"),
    ([{"kind": "search", "min_kendall_tau": 0.9, "shapes": [{"layers": 1, "teacher": False}]}],
     "stages.0.shapes.0.teacher: a reranker's shapes are distilled from its score logits"),
])
def test_a_wrong_option_is_one_line(stages, wanted, sources, monkeypatch, capsys,
                                    tmp_path: Path) -> None:
    raw = shrunk_recipe(sources, tmp_path / "runs")
    raw["stages"] = stages
    code, _, err = cli(monkeypatch, capsys, "validate",
                       str(write_recipe(tmp_path / "r.yaml", raw)))
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and wanted in lines[0], err
