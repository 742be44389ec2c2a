"""Pruning: magnitude (per layer, global, gradual), structured BERT and CNN, reload, the stage."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from builders import EXCLUDE, chosen, input_ids, logits, random_bert
from torch import nn

import compress.stages.prune as prune_stage
from compress.algorithms.pruning import (
    apply_masks,
    count_macs,
    cubic_sparsity,
    overall_sparsity,
    prune_magnitude,
    prune_structured,
    select_layers,
)
from compress.data.datasets import DataBundle, Examples
from compress.errors import CompressError
from compress.models.bundle import ModelBundle, count_params
from compress.models.folders import load_saved, save_model
from compress.models.loading import load_model
from compress.models.zoo import mlp, small_cnn
from compress.recipe.kinds.prune import PruneConfig
from compress.recipe.sources import resolve_model
from compress.stages.context import StageContext, State


def test_selection_follows_include_and_exclude() -> None:
    model = random_bert()
    names = set(chosen(model))
    assert len(names) == 12 and "bert.encoder.layer.1.output.dense" in names
    assert not any("classifier" in n or "pooler" in n for n in names)
    only_ffn = select_layers(model, ["*intermediate*"], EXCLUDE)
    assert set(only_ffn) == {f"bert.encoder.layer.{i}.intermediate.dense" for i in range(2)}
    assert select_layers(model, ["*nothing*"], []) == {}


def test_unstructured_prunes_every_chosen_layer_to_the_amount() -> None:
    model = random_bert()
    untouched = {k: v.clone() for k, v in model.state_dict().items()
                 if "embeddings" in k or "classifier" in k or "pooler" in k}
    layers = chosen(model)
    prune_magnitude(layers, 0.5, "unstructured")
    for name, module in layers.items():
        assert abs(float((module.weight == 0).float().mean()) - 0.5) <= 0.01, name
        assert isinstance(module.weight, nn.Parameter)
    keys = model.state_dict().keys()
    assert not any(k.endswith(("weight_orig", "weight_mask")) for k in keys)
    for key, value in untouched.items():
        assert torch.equal(model.state_dict()[key], value), key
    assert logits(model, input_ids()).shape == (3, 2)


def test_global_uses_one_threshold_across_layers() -> None:
    model = random_bert()
    layers = chosen(model)
    with torch.no_grad():
        layers["bert.encoder.layer.0.intermediate.dense"].weight.mul_(10)  # clearly larger
    before = {name: m.weight.detach().abs().clone() for name, m in layers.items()}
    prune_magnitude(layers, 0.5, "global")
    pruned = torch.cat([before[n][m.weight == 0] for n, m in layers.items()])
    kept = torch.cat([before[n][m.weight != 0] for n, m in layers.items()])
    assert pruned.max() <= kept.min()
    assert abs(overall_sparsity(layers) - 0.5) <= 0.01
    per_layer = [float((m.weight == 0).float().mean()) for m in layers.values()]
    assert max(per_layer) - min(per_layer) > 0.2
    assert float((layers["bert.encoder.layer.0.intermediate.dense"].weight == 0)
                 .float().mean()) < 0.15


def test_cubic_schedule_rises_from_zero_to_the_amount() -> None:
    values = [cubic_sparsity(step, 10, 0.8) for step in range(11)]
    assert values[0] == 0.0 and values[-1] == pytest.approx(0.8)
    assert all(a < b for a, b in zip(values, values[1:], strict=False))
    assert values[5] == pytest.approx(0.8 * (1 - 0.5 ** 3))


def test_structured_ffn_halves_the_intermediate_size() -> None:
    model = random_bert()
    params, macs = count_params(model), count_macs(model, {"input_ids": input_ids()})
    pruned, shapes = prune_structured(model, chosen(model), "ffn", 0.5)
    assert len(pruned) == 2
    for layer in model.bert.encoder.layer:
        assert layer.intermediate.dense.out_features == 32
        assert layer.output.dense.in_features == 32 and layer.output.dense.weight.shape == (32, 32)
        assert layer.attention.self.query.out_features == 32  # heads untouched
    assert shapes["modules"]["bert.encoder.layer.0.intermediate.dense"] == [32, 32]
    assert logits(model, input_ids()).shape == (3, 2)
    assert count_params(model) == params - 2 * (32 * 32 + 32 + 32 * 32)
    assert count_macs(model, {"input_ids": input_ids()}) < macs


def zero_heads_and_neurons(model: nn.Module, heads: dict[int, list[int]],
                           neurons: dict[int, list[int]]) -> None:
    """Zero every weight of the given heads and feed-forward neurons."""
    width = 8  # 32 hidden / 4 heads
    with torch.no_grad():
        for index, layer in enumerate(model.bert.encoder.layer):
            attention = layer.attention.self
            for head in heads[index]:
                rows = slice(head * width, (head + 1) * width)
                for projection in (attention.query, attention.key, attention.value):
                    projection.weight[rows] = 0
                    projection.bias[rows] = 0
                layer.attention.output.dense.weight[:, rows] = 0
            for neuron in neurons[index]:
                layer.intermediate.dense.weight[neuron] = 0
                layer.intermediate.dense.bias[neuron] = 0
                layer.output.dense.weight[:, neuron] = 0


def test_removing_zeroed_heads_and_neurons_keeps_the_logits() -> None:
    model = random_bert()
    zero_heads_and_neurons(model, {0: [1, 3], 1: [0, 2]},
                           {0: list(range(0, 64, 2)), 1: list(range(32, 64))})
    ids = input_ids()
    expected = logits(model, ids)
    prune_structured(model, chosen(model), "ffn+heads", 0.5)
    for layer in model.bert.encoder.layer:
        assert layer.attention.self.num_attention_heads == 2
        assert layer.attention.self.all_head_size == 16
        assert layer.attention.output.dense.in_features == 16
        assert layer.intermediate.dense.out_features == 32
    assert torch.allclose(logits(model, ids), expected, atol=1e-5)
    assert not torch.allclose(expected, torch.zeros_like(expected))


def test_structured_prunes_only_chosen_layers() -> None:
    model = random_bert()
    layers = select_layers(model, ["*layer.1.*"], EXCLUDE)
    prune_structured(model, layers, "heads", 0.5)
    heads = [layer.attention.self.num_attention_heads for layer in model.bert.encoder.layer]
    assert heads == [4, 2]


def test_cnn_channel_pruning_keeps_output_shape_and_shrinks() -> None:
    torch.manual_seed(0)
    model = small_cnn(channels=4).eval()
    images = torch.rand(5, 1, 8, 8)
    params, macs = count_params(model), count_macs(model, images)
    pruned, shapes = prune_structured(model, select_layers(model, ["*"], []), "channels", 0.5)
    assert pruned == ["0", "3"]
    assert (model[0].out_channels, model[3].in_channels, model[3].out_channels) == (2, 2, 4)
    assert model[1].num_features == 2 and model[4].running_mean.shape == (4,)
    assert model[8].in_features == 4 * 16
    assert shapes["modules"]["8"] == [128, 64]
    assert model(images).shape == (5, 10)
    assert count_params(model) < params and count_macs(model, images) < macs


def test_channel_pruning_keeps_the_strongest_filters() -> None:
    model = small_cnn(channels=4).eval()
    with torch.no_grad():
        model[0].weight.copy_(torch.arange(4.0).view(4, 1, 1, 1).expand(4, 1, 3, 3))
    prune_structured(model, select_layers(model, ["0"], []), "channels", 0.5)
    assert model[0].weight[:, 0, 0, 0].tolist() == [2.0, 3.0]
    assert model[3].in_channels == 2 and model[3].out_channels == 8


def test_channels_target_rejects_models_it_cannot_prune() -> None:
    with pytest.raises(ValueError, match="no chosen layer is a top-level Conv2d"):
        model = mlp()
        prune_structured(model, select_layers(model, ["*"], []), "channels", 0.5)
    with pytest.raises(ValueError, match="BERT-style encoder"):
        model = small_cnn(channels=4)
        prune_structured(model, select_layers(model, ["*"], []), "ffn", 0.5)


def test_count_macs_of_an_mlp() -> None:
    assert count_macs(mlp(hidden=32), torch.rand(1, 1, 8, 8)) == 64 * 32 + 32 * 10


def test_factory_structure_round_trips_through_save_and_load(tmp_path: Path) -> None:
    torch.manual_seed(0)
    bundle = load_model(resolve_model("compress.models.zoo:small_cnn"), [str(i) for i in range(10)],
                        [1, 8, 8], kwargs={"channels": 4})
    _, bundle.structure = prune_structured(bundle.model, select_layers(bundle.model, ["*"], []),
                                           "channels", 0.5)
    save_model(bundle, tmp_path / "model")
    assert json.loads((tmp_path / "model" / "structure.json").read_text()) == bundle.structure
    loaded = load_saved(tmp_path / "model")
    images = torch.rand(4, 1, 8, 8)
    assert count_params(loaded.model) == count_params(bundle.model)
    assert torch.equal(loaded.model.eval()(images), bundle.model.eval()(images))


# ---- the stage -------------------------------------------------------------------------------

def image_context(tmp_path: Path, n: int = 64) -> StageContext:
    generator = torch.Generator().manual_seed(0)
    train = Examples(labels=torch.randint(0, 10, (n,), generator=generator).tolist(),
                     inputs=torch.rand(n, 1, 8, 8, generator=generator))
    data = DataBundle("image", {"train": train}, [str(i) for i in range(10)],
                      input_shape=[1, 8, 8])
    folder = tmp_path / "00-prune"
    folder.mkdir(parents=True)
    return StageContext(0, "prune", folder, tmp_path, None, data, "key", 0, log=lambda _: None)


def mlp_state() -> State:
    torch.manual_seed(0)
    bundle = ModelBundle(mlp(hidden=32), "factory", [str(i) for i in range(10)],
                         factory="compress.models.zoo:mlp", kwargs={"hidden": 32},
                         input_shape=[1, 8, 8])
    return State(bundle)


def watch_training(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Record the layers' sparsity after every step and the weights when training ends."""
    seen: dict[str, list] = {"sparsity": [], "weights": []}
    import compress.train.loop as train_module

    real_train = train_module.train

    def watched(model, examples, opts, *, on_step, **kwargs):
        layers = select_layers(model, ["*"], EXCLUDE)

        def step(done: int) -> None:
            on_step(done)
            seen["sparsity"].append(overall_sparsity(layers))

        result = real_train(model, examples, opts, on_step=step, **kwargs)
        seen["weights"] = [m.weight.detach().clone() for m in layers.values()]
        return result

    monkeypatch.setattr(train_module, "train", watched)  # what TrainSetup.run calls
    return seen


def test_stage_keeps_the_zeros_during_recovery(tmp_path, monkeypatch) -> None:
    seen = watch_training(monkeypatch)
    state = mlp_state()
    expected = copy.deepcopy(state.bundle.model)
    expected_layers = select_layers(expected, ["*"], EXCLUDE)
    masks = prune_magnitude(expected_layers, 0.5, "unstructured")
    cfg = PruneConfig(amount=0.5, recovery={"max_steps": 6, "batch_size": 16,
                                            "learning_rate": 0.05, "warmup_ratio": 0.0})
    ctx = image_context(tmp_path)
    prune_stage.run(state, cfg, ctx)
    assert all(s == pytest.approx(0.5, abs=0.01) for s in seen["sparsity"])
    for weight, mask in zip(seen["weights"], masks.values(), strict=True):
        assert torch.equal(weight != 0, mask)
    apply_masks(expected_layers, masks)  # training changed the kept weights
    assert not torch.equal(state.bundle.model[1].weight, expected[1].weight)
    m = ctx.metrics
    assert m["sparsity_target"] == 0.5 and m["sparsity_layers"] == pytest.approx(0.5, abs=0.01)
    assert set(m["sparsity_per_layer"]) == {"1", "3"} and m["pruned_layers"] == 2
    assert m["params_after"] == m["params_before"] and m["flops_after"] == m["flops_before"]
    assert m["train_steps"] == 6 and not any("speedup" in key for key in m)
    assert state.bundle.structure is None
    assert (ctx.folder / "model" / "model.safetensors").is_file() and ctx.outputs


def test_stage_gradual_global_sparsity_rises_to_the_amount(tmp_path, monkeypatch) -> None:
    seen = watch_training(monkeypatch)
    cfg = PruneConfig(method="global", amount=0.6, gradual=True,
                      recovery={"max_steps": 20, "batch_size": 16, "learning_rate": 0.01})
    ctx = image_context(tmp_path)
    state = prune_stage.run(mlp_state(), cfg, ctx)
    curve = seen["sparsity"]
    assert len(curve) == 20 and curve[0] < 0.1
    assert all(a <= b + 1e-6 for a, b in zip(curve, curve[1:], strict=False))
    assert 0.3 < curve[9] < 0.6 and curve[-1] == pytest.approx(0.6, abs=0.01)
    assert ctx.metrics["sparsity_layers"] == pytest.approx(0.6, abs=0.01)
    assert overall_sparsity(select_layers(state.bundle.model, ["*"], EXCLUDE)) == \
        pytest.approx(0.6, abs=0.01)


def test_stage_structured_records_smaller_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    bundle = ModelBundle(small_cnn(channels=4), "factory", [str(i) for i in range(10)],
                         factory="compress.models.zoo:small_cnn", kwargs={"channels": 4},
                         input_shape=[1, 8, 8])
    cfg = PruneConfig(method="structured", target="channels", amount=0.5)
    ctx = image_context(tmp_path)
    state = prune_stage.run(State(bundle), cfg, ctx)
    m = ctx.metrics
    assert m["params_after"] < m["params_before"] and m["flops_after"] < m["flops_before"]
    assert m["pruned_layers"] == 2 and state.bundle.structure["modules"]["0"] == [2, 1]
    reloaded = load_saved(ctx.folder / "model")
    assert count_params(reloaded.model) == m["params_after"]


def test_prune_errors_are_one_clear_line(tmp_path: Path) -> None:
    ctx = image_context(tmp_path)
    nothing = PruneConfig(include=["encoder.*"])
    with pytest.raises(CompressError, match=r"no layer matches include \['encoder.\*'\] minus"):
        prune_stage.run(mlp_state(), nothing, ctx)
    with pytest.raises(ValueError, match="gradual: true works with unstructured and global"):
        PruneConfig(method="structured", target="channels", gradual=True,
                    recovery={"max_steps": 2})  # refused by validation, before any work
    wrong_target = PruneConfig(method="structured", target="heads")
    with pytest.raises(CompressError, match="needs a BERT-style encoder"):
        prune_stage.run(mlp_state(), wrong_target, ctx)




def test_the_api_loads_a_pruned_classifier_folder_at_its_pruned_shapes(tmp_path: Path) -> None:
    """compress.load_model on a prune stage's folder (config.json and structure.json, no
    model.json) rebuilds the pruned shapes and its weights, not the unpruned config with
    freshly initialised feed-forward layers."""
    from conftest import minilm_folder
    from transformers import AutoTokenizer

    from compress.api import load_model as api_load_model

    torch.manual_seed(0)
    model = random_bert(vocab_size=AutoTokenizer.from_pretrained(minilm_folder()).vocab_size)
    _, structure = prune_structured(model, chosen(model), "ffn", 0.5)
    bundle = ModelBundle(model.eval(), "hf", ["negative", "positive"],
                         tokenizer=AutoTokenizer.from_pretrained(minilm_folder()),
                         structure=structure)
    save_model(bundle, tmp_path / "model")
    loaded = api_load_model(tmp_path / "model")
    assert loaded.model.bert.encoder.layer[0].intermediate.dense.out_features == 32
    assert torch.equal(logits(loaded.model.eval(), input_ids()), logits(model, input_ids()))
