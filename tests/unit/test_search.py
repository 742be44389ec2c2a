"""The search stage's own rules: bad options are one line at validation (exit 2), the
winner is the best trial within the tolerance, and the layer ranking finds a layer int8
breaks and the fallback keeps exactly that one in float."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from conftest import cli, digits_recipe
from torch import nn

from compress.cli.search import add_search_stage
from compress.search.choice import decide
from compress.search.quality import AccuracyDrop


def recipe_file(tmp_path: Path, *stages: dict) -> Path:
    raw = digits_recipe(tmp_path / "runs")
    raw["stages"] = [raw["stages"][0], *stages]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


BAD_SEARCHES = [
    ({"max_accuracy_drop": None}, "stages.1.max_accuracy_drop: required: the largest accuracy "
                                  "loss in points"),
    ({"min_fidelity": 0.99}, "stages.1.min_fidelity: an embedding model's budget"),
    ({"objective": "latency_b3"}, "stages.1.objective: Input should be 'latency_b1'"),
    ({"candidates": ["int4_magic"]}, "stages.1.candidates.0: Input should be"),
    ({"max_accuracy_drop": -0.1}, "stages.1.max_accuracy_drop: Input should be greater "
                                  "than or equal to 0"),
    ({"candidates": ["bf16_aoti"]}, "stages.1.candidates: none applies to model.source "
                                    "compress.models.zoo:mlp (bf16_aoti casts Hugging Face models"),
    ({"objective": "latency_real"}, "stages.1.objective: latency_real times the eval split's "
                                    "sentences"),
    ({"candidates": ["onnx_fp32", "onnx_fp32"]}, "a candidate is listed twice"),
]


@pytest.mark.parametrize("options,message", BAD_SEARCHES)
def test_bad_search_options_are_one_line_exit_2(options, message, tmp_path, monkeypatch,
                                                capsys) -> None:
    search = {"kind": "search", "max_accuracy_drop": 0.5, **options}
    code, _, err = cli(monkeypatch, capsys, "validate", str(recipe_file(tmp_path, search)))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: ") and message in lines[0], lines


def test_search_of_a_quantized_model_is_refused(tmp_path, monkeypatch, capsys) -> None:
    path = recipe_file(tmp_path, {"kind": "quantize", "mode": "dynamic"},
                       {"kind": "search", "max_accuracy_drop": 1})
    code, _, err = cli(monkeypatch, capsys, "validate", str(path))
    assert code == 2 and "stages.2: a search stage cannot take the model of a quantize" in err


def test_search_without_max_drop_says_how(tmp_path, monkeypatch, capsys) -> None:
    code, _, err = cli(monkeypatch, capsys, "search", str(recipe_file(tmp_path)))
    assert code == 2 and err.strip() == (
        "error: the recipe has no search stage; give --max-drop POINTS (a classifier) or "
        "--min-fidelity COSINE (an embedding model) to add one")
    code, _, err = cli(monkeypatch, capsys, "search", str(recipe_file(tmp_path)),
                       "--max-drop", "-1")
    assert code == 2 and "-1" in err and "Traceback" not in err


def test_a_search_stage_is_added_before_the_package_and_packaged() -> None:
    from compress.recipe.schema import validate_raw

    raw = digits_recipe(Path("/tmp/unused"))
    raw["stages"].append({"kind": "package"})
    edited = add_search_stage(raw, {"max_accuracy_drop": 0.25})
    assert [s["kind"] for s in edited["stages"]] == ["finetune", "search", "package"]
    assert edited["stages"][1]["max_accuracy_drop"] == 0.25
    assert add_search_stage(edited, {"max_accuracy_drop": 3.0}) is edited  # one is enough
    recipe, problems = validate_raw(edited)
    assert problems == [] and recipe is not None
    from compress.recipe.kinds.package import export_stage_index

    assert export_stage_index(recipe, 2) == 1  # the package archives the winner


def points(max_drop: float) -> AccuracyDrop:
    """A classifier's quality rule with `max_drop` points of tolerance."""
    return AccuracyDrop(None, None, max_drop)


def trial(tid: str, accuracy: float, b8: float, drop: float, within: bool, **extra) -> dict:
    return {"id": tid, "candidate": tid, "status": "ok", "accuracy": accuracy,
            "latency_ms_b8": b8, "drop": drop, "shortfall": drop, "within": within,
            "float_layers": [], **extra}


def test_the_winner_is_the_fastest_trial_within_the_tolerance() -> None:
    trials = [trial("fast_but_lossy", 0.80, 10.0, 6.0, False),
              trial("within_slow", 0.86, 30.0, 0.0, True),
              trial("within_fast", 0.855, 20.0, 0.5, True),
              {"id": "broken", "candidate": "broken", "status": "failed", "error": "no",
               "float_layers": []}]
    outcome = decide(trials, "latency_ms_b8", points(0.5))
    assert outcome["winner"]["id"] == "within_fast"
    lost = {t["id"]: t.get("lost") for t in trials}
    assert lost["fast_but_lossy"] == "loses 6.00 pt > max_accuracy_drop 0.5"
    assert lost["within_slow"] == "slower: 30.00 ms against the winner's 20.00 ms"
    assert lost["broken"] == "failed: no"
    # re-timed finalists decide by their re-timed medians
    trials[1]["final_ms"], trials[2]["final_ms"] = 18.0, 21.0
    assert decide(trials, "latency_ms_b8", points(0.5))["winner"]["id"] == "within_slow"


def test_finalists_as_fast_within_noise_are_decided_by_accuracy() -> None:
    trials = [trial("distilled", 0.8589, 33.8, 0.92, True, final_ms=32.98),
              trial("direct", 0.8670, 28.0, 0.12, True, final_ms=33.44),  # 1.4% slower
              trial("other", 0.8700, 40.0, 0.0, True, final_ms=34.5)]  # 4.6% slower
    outcome = decide(trials, "latency_ms_b8", points(1.0))
    assert outcome["winner"]["id"] == "direct"
    lost = {t["id"]: t.get("lost") for t in trials}
    assert lost["distilled"] == ("as fast when re-timed (32.98 ms against 33.44 ms, within "
                                 "3%) and less accurate (85.89% against 86.70%)")
    assert lost["other"] == "slower when re-timed: 34.50 ms against the winner's 33.44 ms"
    trials[0]["final_ms"] = 30.0  # clearly faster: speed decides again
    assert decide(trials, "latency_ms_b8", points(1.0))["winner"]["id"] == "distilled"


def test_no_trial_within_names_the_closest() -> None:
    trials = [trial("a", 0.80, 10.0, 6.0, False), trial("b", 0.84, 12.0, 2.0, False)]
    outcome = decide(trials, "latency_ms_b8", points(0.1))
    assert outcome["winner"] is None
    assert outcome["verdict"].startswith(
        "no trial is within max_accuracy_drop 0.1 of the entering model; the closest is b at "
        "-2.00 pt (84.00%)")


class Fragile(nn.Module):
    """Three linear layers; `first` makes one output channel 1000 times larger and `middle`
    reads it 1000 times smaller (the float function is unchanged), so the one int8 scale
    of middle's input rounds every other channel of it to zero."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.middle, self.last = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        with torch.no_grad():
            self.first.weight[0] *= 1000
            self.first.bias[0] = 1000.0
            self.middle.weight[:, 0] /= 1000

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.middle(torch.relu(self.first(x)))))


def test_the_fragile_layer_ranks_first_and_the_fallback_keeps_it_float() -> None:
    from compress.algorithms.quantization import quantize
    from compress.algorithms.sensitivity import rank_layers
    from compress.data.datasets import Examples
    from compress.models.bundle import ModelBundle
    from compress.recipe.kinds.quantize import QuantizeConfig

    model = Fragile().eval()
    batches = [torch.randn(32, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    ranking = rank_layers(model, batches)
    assert [r["layer"] for r in ranking][0] == "middle"
    assert ranking[0]["score"] > 10 * ranking[1]["score"] > 0

    bundle = ModelBundle(model, "factory", ["a", "b", "c", "d"], input_shape=[16])
    reference = torch.cat([model(b) for b in batches])

    calibration = Examples(labels=[0] * 128, inputs=torch.cat(batches))

    def kl_with_float(layers: list[str]) -> float:
        cfg = QuantizeConfig(mode="static", compile=False, keep_float=layers)
        quantized, _ = quantize(bundle, cfg, calibration)
        with torch.no_grad():
            got = torch.cat([quantized.model(b) for b in batches])
        return float(nn.functional.kl_div(got.log_softmax(-1), reference.log_softmax(-1),
                                          log_target=True, reduction="batchmean"))

    all_int8, middle_float = kl_with_float([]), kl_with_float(["middle"])
    assert middle_float < all_int8 / 10  # keeping the ranked-first layer float is the fix
    from compress.algorithms.sensitivity import fallback_layers

    kept = fallback_layers([r["layer"] for r in ranking], lambda layers: kl_with_float(layers)
                           < middle_float * 2, limit=3)
    assert kept == ["middle"]
