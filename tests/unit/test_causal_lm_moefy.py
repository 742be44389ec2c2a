"""MoEfication of a tiny random Llama: a balanced split that covers every neuron once, a
Mixtral model equal to the dense one when every expert runs with equal weight, a trained
router that keeps more activation mass than a random one, a saved folder that loads as a
MixtralForCausalLM (the stage through the CLI with its three perplexities:
tests/integration/test_causal_lm_stages.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from builders import causal_lm_recipe
from conftest import cli

from compress.families.causal_lm.algorithms.moefy import (
    Routers,
    balanced_kmeans,
    capture,
    make_router_loss_fn,
    routing_quality,
    split_neurons,
)
from compress.families.causal_lm.algorithms.moefy_convert import to_mixtral
from compress.recipe.options import TrainOptions
from compress.train.loop import train


def _llama(width: int = 64, hidden: int = 32, layers: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=width,
                         num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, initializer_range=0.1)
    return LlamaForCausalLM(config).eval()


def _blocks(n: int = 16, length: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(seed))


def test_with_zero_routers_and_every_expert_chosen_the_moe_model_is_the_dense_model() -> None:
    dense = _llama()
    groups = [torch.randperm(64, generator=torch.Generator().manual_seed(i)).view(4, 16)
              for i in range(2)]
    moe = to_mixtral(dense, groups, top_k=4)
    assert type(moe).__name__ == "MixtralForCausalLM"
    assert moe.config.num_local_experts == 4 and moe.config.intermediate_size == 16
    assert moe.config.head_dim == dense.config.head_dim and moe.config.tie_word_embeddings
    assert moe.config.rope_parameters == dense.config.rope_parameters
    assert moe.lm_head.weight.data_ptr() == moe.model.embed_tokens.weight.data_ptr()
    ids = _blocks(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(moe(input_ids=ids).logits, dense(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)


def test_the_coactivation_split_is_balanced_and_covers_every_neuron_once() -> None:
    dense = _llama()
    groups = split_neurons(dense, list(_blocks().split(4)), 8, "coactivation", 128)
    assert len(groups) == 2
    for group in groups:
        assert group.shape == (8, 8)
        assert sorted(group.flatten().tolist()) == list(range(64))
    # neurons that fire together land together: two planted families of 8 identical rows
    features = torch.rand(16, 32) * 0.1
    features[:8, :16] += 1.0
    features[8:, 16:] += 1.0
    found = balanced_kmeans(features, 2)
    assert {frozenset(found[0].tolist()), frozenset(found[1].tolist())} == {
        frozenset(range(8)), frozenset(range(8, 16))}
    with pytest.raises(ValueError, match="do not divide"):
        balanced_kmeans(features, 3)


def test_a_trained_router_keeps_more_activation_mass_than_a_random_one(tmp_path: Path) -> None:
    dense = _llama()
    blocks = _blocks(48, 16)
    groups = split_neurons(dense, list(blocks.split(8)), 8, "coactivation", 512)
    routers = Routers(2, 32, 8)
    opts = TrainOptions(max_steps=20, batch_size=8, learning_rate=5e-2, weight_decay=0.0,
                        warmup_ratio=0.0)
    from compress.data.datasets import Examples

    train(routers, Examples(labels=[0] * 40, inputs=blocks[:40]), opts, seed=0,
          checkpoint_dir=tmp_path, key="t", loss_fn=make_router_loss_fn(dense, groups, 2))
    quality = routing_quality(dense, routers, groups, [blocks[40:]], 2)
    assert quality["trained"] > quality["random"] + 0.05, quality
    assert quality["oracle"] >= quality["trained"]
    with torch.no_grad(), capture(dense) as found:  # the MoE model follows these routers
        dense(input_ids=blocks[40:41])
    assert found[0]["x"].shape == (16, 32) and found[0]["score"].shape == (16, 64)


@pytest.mark.parametrize(("option", "message"), [
    ({"experts": 5}, "5 does not divide the feed-forward width 64"),
    ({"experts": 4, "top_k": 6}, "top_k 6 is more than experts 4"),
])
def test_a_bad_moefy_option_is_one_line_and_exit_2(tmp_path: Path, tiny_llama_folder: Path,
                                                   data_dir: Path, option: dict, message: str,
                                                   monkeypatch, capsys) -> None:
    path = causal_lm_recipe(tmp_path, tiny_llama_folder, [{"kind": "moefy", **option}])
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    code, _, err = cli(monkeypatch, capsys, "run", str(path))
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], err


def test_classifiers_and_embedding_models_refuse_moefy_in_one_line() -> None:
    from compress.recipe.family_specs import runner_of
    from compress.recipe.kinds.moefy import SPEC, MoefyConfig

    assert runner_of("moefy", "embedding") is None  # "does not take an embedding model yet"
    assert runner_of("moefy", "causal-lm").endswith("causal_lm.stages.moefy:run")
    assert SPEC.check_task(MoefyConfig(), "causal-lm", 0) == []
    (line,) = SPEC.check_task(MoefyConfig(), "classification", 2)
    assert line.startswith("stages.2 (moefy): ") and "remove the stage" in line


def test_a_curve_survives_a_resume_and_starts_afresh_when_the_stage_changes(
        tmp_path: Path) -> None:
    from compress.families.causal_lm.stages.moefy import CURVE_POINTS, Curve

    curve = Curve(tmp_path, "recovery", "key-1")
    noted = curve.wrap(lambda model, inputs, labels: torch.tensor(float(inputs)))
    for step in range(1, 21):
        noted(None, step, None), noted(None, step + 1, None)  # two micro-batches a step
        curve.on_step(step)
    assert curve.points()[-1] == [20, 20.5]
    resumed = Curve(tmp_path, "recovery", "key-1")  # a resumed try keeps the steps saved
    assert len(resumed.losses) == 20 and Curve(tmp_path, "router", "key-1").losses == {}
    assert Curve(tmp_path, "recovery", "key-2").losses == {}  # another config: afresh
    resumed.losses = {s: 1.0 for s in range(1, 1001)}
    points = resumed.points()
    assert len(points) <= CURVE_POINTS and points[-1][0] == 1000
