"""Semi-structured n:m pruning: exactly n non-zeros in every group of m inputs, by magnitude
or Wanda, the masks holding through recovery (labels or distillation), the figures the
report shows, the recipe's one-line errors, and the causal-LM path."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from builders import EXCLUDE, chosen, input_ids, logits, random_bert
from pydantic import ValidationError
from torch import nn

import compress.stages.prune as prune_stage
from compress.algorithms.semi_structured import (
    check_n_m,
    group_nonzeros,
    input_norms,
    n_m_mask,
    prune_n_m,
)
from compress.data.datasets import DataBundle, Examples
from compress.measure.evaluate import logits_of
from compress.models.bundle import ModelBundle
from compress.models.zoo import mlp
from compress.recipe.kinds.prune import PruneConfig, _check_task, _runtime, _splits
from compress.stages.context import StageContext, State


def assert_exactly(layer: nn.Linear, n: int, m: int) -> None:
    assert bool((group_nonzeros(layer.weight, m) == n).all()), "a group lost its pattern"


@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 4), (3, 8)])
def test_every_group_of_m_inputs_keeps_exactly_its_n_largest(n: int, m: int) -> None:
    model = random_bert()
    layers = chosen(model)
    before = {name: layer.weight.detach().clone() for name, layer in layers.items()}
    masks, pruned, skipped = prune_n_m(layers, n, m)
    assert set(pruned) == set(layers) and skipped == []
    for name, layer in pruned.items():
        assert_exactly(layer, n, m)
        groups = before[name].abs().reshape(layer.out_features, -1, m)
        kept = (layer.weight != 0).reshape_as(groups)
        assert torch.equal(masks[name].reshape_as(groups), kept)
        assert (groups.masked_fill(~kept, float("inf")).amin(-1)  # smallest kept >= largest
                >= groups.masked_fill(kept, -1).amax(-1)).all()   # pruned, in every group
        assert isinstance(layer.weight, nn.Parameter)
    assert check_n_m(model, n, m, exclude=EXCLUDE) == []
    assert check_n_m(model, n, m) == ["bert.pooler.dense", "classifier"]  # left dense
    assert logits(model, input_ids()).shape == (3, 2)


def test_a_refilled_weight_breaks_the_pattern_and_check_n_m_names_its_linear() -> None:
    model = random_bert()
    prune_n_m(chosen(model), 2, 4)
    with torch.no_grad():
        weight = model.bert.encoder.layer[1].output.dense.weight
        column = int((weight[0, :4] == 0).nonzero()[0])
        weight[0, column] = 0.5
    assert check_n_m(model, 2, 4, exclude=EXCLUDE) == ["bert.encoder.layer.1.output.dense"]


def test_linears_whose_inputs_are_not_whole_groups_are_skipped() -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    layers = {"0": model[0], "2": model[2]}
    dense = model[0].weight.detach().clone()
    _, pruned, skipped = prune_n_m(layers, 2, 4)
    assert list(pruned) == ["2"] and skipped == ["0"]
    assert torch.equal(model[0].weight, dense)
    assert_exactly(model[2], 2, 4)
    with pytest.raises(ValueError, match="6 inputs are not a whole number of groups of 4"):
        n_m_mask(dense, 2, 4)


def test_wanda_weighs_each_weight_by_its_input_norm_and_magnitude_does_not() -> None:
    linear = nn.Linear(4, 2, bias=False)
    with torch.no_grad():  # large weights on inputs 0 and 1, which are almost always silent
        linear.weight.copy_(torch.tensor([[1.0, 0.9, 0.1, 0.2], [0.8, 1.0, 0.3, 0.1]]))
    x = torch.tensor([[0.01, 0.0, 5.0, 4.0], [0.0, 0.02, 3.0, 6.0]])
    norms = input_norms(linear, {"l": linear}, [x], logits_of)
    torch.testing.assert_close(norms["l"], x.norm(dim=0))
    by_magnitude = copy.deepcopy(linear)
    prune_n_m({"l": by_magnitude}, 2, 4)
    prune_n_m({"l": linear}, 2, 4, norms)
    assert (by_magnitude.weight != 0).tolist() == [[True, True, False, False]] * 2
    assert (linear.weight != 0).tolist() == [[False, False, True, True]] * 2
    assert linear(x).abs().sum() > 10 * by_magnitude(x).abs().sum()  # what Wanda keeps


def test_wanda_norms_count_real_tokens_not_padding() -> None:
    """A BERT batch padded to its longest row gives the same input norms as its rows run
    alone: the padded positions' activations do not count."""
    model, ids = random_bert(), input_ids()
    layers = chosen(model)
    lengths = [12, 7, 3]
    mask = torch.tensor([[1] * n + [0] * (12 - n) for n in lengths])
    padded = {"input_ids": ids * mask, "attention_mask": mask}
    alone = [{"input_ids": ids[i:i + 1, :n], "attention_mask": mask[i:i + 1, :n]}
             for i, n in enumerate(lengths)]
    batched = input_norms(model, layers, [padded], logits_of)
    separately = input_norms(model, layers, alone, logits_of)
    counted_padding = input_norms(model, layers, [padded], logits_of, tokens=lambda _: None)
    for name in layers:
        torch.testing.assert_close(batched[name], separately[name], rtol=1e-4, atol=1e-5)
    assert any(not torch.allclose(counted_padding[n], separately[n], rtol=1e-3)
               for n in layers)


# ---- the recipe --------------------------------------------------------------------------------

@pytest.mark.parametrize(("options", "message"), [
    ({"method": "semi_structured", "pattern": "4:4"}, "pattern 4:4: needs 0 < n < m <= 32"),
    ({"method": "semi_structured", "pattern": "0:4"}, "pattern 0:4: needs 0 < n < m <= 32"),
    ({"method": "semi_structured", "pattern": "2:64"}, "pattern 2:64: needs 0 < n < m <= 32"),
    ({"method": "semi_structured", "pattern": "2/4"}, "pattern '2/4' is not n:m"),
    ({"method": "semi_structured", "amount": 0.5}, "amount: not an option of method "
     "semi_structured (pattern 2:4 sets the sparsity"),
    ({"method": "semi_structured", "gradual": True, "recovery": {"max_steps": 2}},
     "gradual: not an option of method semi_structured"),
    ({"method": "semi_structured", "target": "heads"}, "target: not an option of method"),
    ({"pattern": "2:4"}, "pattern: an option of method semi_structured only (method is "
     "unstructured)"),
    ({"method": "global", "scoring": "wanda"}, "scoring: an option of method semi_structured"),
    ({"method": "semi_structured", "calibration": {"samples": 8}},
     "calibration: only scoring wanda reads calibration examples"),
    ({"method": "semi_structured", "recovery_distill": True},
     "recovery_distill: true needs recovery"),
    ({"method": "semi_structured", "alpha": 0.2}, "alpha: options of recovery_distill: true"),
])
def test_a_bad_pattern_or_combination_is_one_line(options: dict, message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        PruneConfig(**options)
    assert len(caught.value.errors()) == 1 and message in caught.value.errors()[0]["msg"]


def test_a_pattern_yaml_read_as_base_60_is_taken_back_and_the_splits_follow_scoring() -> None:
    cfg = PruneConfig(method="semi_structured", pattern=124)  # YAML 1.1: 2:4 -> 2*60 + 4
    assert cfg.pattern == "2:4" and cfg.n_m == (2, 4)
    assert PruneConfig(method="semi_structured", pattern=" 3:8").n_m == (3, 8)
    assert _splits(cfg) == ()
    wanda = PruneConfig(method="semi_structured", scoring="wanda", recovery={"max_steps": 1})
    assert _splits(wanda) == ("train", "calibration")
    assert _check_task(wanda, "causal-lm", 0) == []
    assert "method: a causal LM is pruned with method: structured" in \
        _check_task(PruneConfig(), "causal-lm", 0)[0]
    assert _check_task(wanda, "embedding", 2)[0].startswith("stages.2.scoring: not an option")
    assert _runtime({"method": "semi_structured", "pattern": "2:4"},
                    {"sparsity_layers": 0.5}) == "PyTorch eager (2:4 pruned, 50.0% of " \
                                                 "pruned weights zero)"


# ---- the classifier stage ------------------------------------------------------------------------

def image_context(tmp_path: Path, n: int = 64) -> StageContext:
    generator = torch.Generator().manual_seed(0)
    examples = Examples(labels=torch.randint(0, 10, (n,), generator=generator).tolist(),
                        inputs=torch.rand(n, 1, 8, 8, generator=generator))
    data = DataBundle("image", {"train": examples, "calibration": examples, "eval": examples},
                      [str(i) for i in range(10)], input_shape=[1, 8, 8])
    folder = tmp_path / "00-prune"
    folder.mkdir(parents=True)
    return StageContext(0, "prune", folder, tmp_path, None, data, "key", 0, log=lambda _: None)


def mlp_state() -> State:
    torch.manual_seed(0)
    return State(ModelBundle(mlp(hidden=32), "factory", [str(i) for i in range(10)],
                             factory="compress.models.zoo:mlp", kwargs={"hidden": 32},
                             input_shape=[1, 8, 8]))


def watch_steps(monkeypatch: pytest.MonkeyPatch) -> list:
    """The recovery's loss function, then the Linears' non-zero positions after every
    optimizer step."""
    seen: list = []
    import compress.train.loop as train_module

    real_train = train_module.train

    def watched(model, examples, opts, *, on_step, **kwargs):
        seen.append(kwargs.get("loss_fn"))

        def step(done: int) -> None:
            on_step(done)
            seen.append({name: layer.weight.detach() != 0 for name, layer
                         in model.named_modules() if isinstance(layer, nn.Linear)})

        return real_train(model, examples, opts, on_step=step, **kwargs)

    monkeypatch.setattr(train_module, "train", watched)
    return seen


@pytest.mark.parametrize("distill", [False, True])
def test_the_mask_holds_through_recovery_and_the_figures_show_the_pattern(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, distill: bool) -> None:
    seen = watch_steps(monkeypatch)
    state = mlp_state()
    expected = copy.deepcopy(state.bundle.model)
    masks, _, _ = prune_n_m({"1": expected[1], "3": expected[3]}, 2, 4)
    cfg = PruneConfig(method="semi_structured", recovery_distill=distill,
                      recovery={"max_steps": 6, "batch_size": 16, "learning_rate": 0.05,
                                "warmup_ratio": 0.0})
    ctx = image_context(tmp_path)
    prune_stage.run(state, cfg, ctx)
    model = state.bundle.model
    loss_fn, *steps = seen
    assert len(steps) == 6
    for positions in steps:  # after every step: the very positions pruning kept, no refill
        assert torch.equal(positions["1"], masks["1"]) and torch.equal(positions["3"], masks["3"])
    for name in ("1", "3"):
        assert torch.equal(model[int(name)].weight != 0, masks[name])
        assert_exactly(model[int(name)], 2, 4)
        assert not torch.equal(model[int(name)].weight, expected[int(name)].weight)  # trained
    assert check_n_m(model, 2, 4) == []
    m = ctx.metrics
    assert m["pattern"] == "2:4" and m["scoring"] == "magnitude"
    assert m["sparsity_layers"] == 0.5 and m["sparsity_target"] == 0.5
    assert m["sparsity_per_layer"] == {"1": 0.5, "3": 0.5}
    assert m["pruned_layers"] == 2 and m["skipped_layers"] == 0 and m["pattern_violations"] == 0
    assert 0 <= m["accuracy_pruned"] <= 1 and m["train_steps"] == 6  # before and after
    assert state.bundle.structure is None and (ctx.folder / "model" / "model.safetensors").is_file()
    assert (loss_fn is not None and "teacher_loss_fn" in loss_fn.__qualname__) == distill


def test_wanda_in_the_stage_reads_the_calibration_split(tmp_path: Path) -> None:
    ctx = image_context(tmp_path)
    state = mlp_state()
    magnitude = copy.deepcopy(state.bundle.model)
    with torch.no_grad():  # input pixel 0 never lights up in the calibration images
        ctx.data.splits["calibration"].inputs[:, 0, 0, 0] = 0
        state.bundle.model[1].weight[:, :4] = torch.tensor([5.0, 0.1, 0.1, 0.1])
        magnitude[1].weight[:, :4] = torch.tensor([5.0, 0.1, 0.1, 0.1])
    prune_stage.run(state, PruneConfig(method="semi_structured", scoring="wanda"), ctx)
    prune_n_m({"1": magnitude[1]}, 2, 4)
    assert (magnitude[1].weight[:, 0] != 0).all()  # magnitude keeps the silent input's weight
    assert (state.bundle.model[1].weight[:, 0] == 0).all()  # Wanda drops it
    assert check_n_m(state.bundle.model, 2, 4) == [] and ctx.metrics["scoring"] == "wanda"
    no_calibration = image_context(tmp_path / "again")
    del no_calibration.data.splits["calibration"]
    with pytest.raises(Exception, match="scoring wanda needs calibration examples"):
        prune_stage.run(mlp_state(), PruneConfig(method="semi_structured", scoring="wanda"),
                        no_calibration)


# ---- causal LMs ----------------------------------------------------------------------------------

def causal_lm_context(tmp_path: Path, texts: list[str]) -> StageContext:
    data = DataBundle("causal-lm", {name: Examples(labels=[], texts=texts)
                                    for name in ("train", "eval", "calibration")}, [], None, 16)
    folder = tmp_path / "00-prune"
    folder.mkdir(parents=True)
    return StageContext(0, "prune", folder, tmp_path, None, data, "key", 0, log=lambda _: None)


@pytest.mark.parametrize("scoring", ["magnitude", "wanda"])
def test_a_causal_lm_prunes_every_decoder_linear_and_keeps_the_mask_through_recovery(
        tmp_path: Path, tiny_llama_folder: Path, scoring: str) -> None:
    import compress.families.causal_lm.stages.prune as causal_lm_prune_stage
    from compress.families.causal_lm.folder import load_causal_lm_folder, load_recipe_causal_lm

    bundle = load_recipe_causal_lm(str(tiny_llama_folder))
    reference = copy.deepcopy(bundle.model)
    linears = causal_lm_prune_stage.decoder_linears(bundle.model)
    assert len(linears) == 14 and "model.layers.1.mlp.down_proj" in linears
    texts = ["a good movie with a warm and happy story that ends well"] * 24
    ctx = causal_lm_context(tmp_path, texts)
    if scoring == "magnitude":
        masks, _, _ = prune_n_m(causal_lm_prune_stage.decoder_linears(reference), 2, 4)
    cfg = PruneConfig(method="semi_structured", scoring=scoring, recovery_distill=True,
                      recovery={"max_steps": 3, "batch_size": 4, "learning_rate": 1e-2,
                                "warmup_ratio": 0.0})
    state = causal_lm_prune_stage.run(State(bundle), cfg, ctx)
    model = state.bundle.model
    for name, layer in causal_lm_prune_stage.decoder_linears(model).items():
        assert_exactly(layer, 2, 4)
        if scoring == "magnitude":  # the positions magnitude chose, none refilled in training
            assert torch.equal(layer.weight != 0, masks[name]), name
    assert check_n_m(model, 2, 4, include=["model.layers.*"]) == []
    assert int((model.model.embed_tokens.weight == 0).sum()) == 0  # dense, and the tied head
    m = ctx.metrics
    assert m["pattern"] == "2:4" and m["scoring"] == scoring and m["sparsity_layers"] == 0.5
    assert m["pruned_layers"] == 14 and m["skipped_layers"] == 0
    assert m["perplexity_pruned"] > 0 and m["train_steps"] == 3
    saved = load_causal_lm_folder(ctx.folder / "model")
    assert saved.causal_lm_facts["sparsity_pattern"] == "2:4"
    assert check_n_m(saved.model, 2, 4, include=["model.layers.*"]) == []
