"""Stage `moefy` on a causal LM: MoEfication (`compress.families.causal_lm.algorithms.moefy`).
Each SwiGLU feed-forward layer's neurons are split into E equal experts (balanced k-means
of their activations on calibration text, or contiguous), a router per layer is trained
on the dense model's feed-forward inputs to pick each token's top-k experts by activation
mass, and the model becomes a standard `MixtralForCausalLM` (`algorithms/moefy_convert.py`).
An optional recovery then trains it (routers frozen) towards the dense model's next-token
distributions. Perplexity is recorded dense, right after moefication and after recovery,
with the loss curve of both trainings (`curves.json` in the stage folder, and the metrics).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from compress.data.datasets import Examples
from compress.errors import CompressError
from compress.families.causal_lm.algorithms.distill import (
    causal_lm_loss,
    make_causal_lm_kd_loss_fn,
    packed_examples,
)
from compress.families.causal_lm.algorithms.moefy import (
    Routers,
    capture,
    make_router_loss_fn,
    routing_quality,
    split_neurons,
)
from compress.families.causal_lm.algorithms.moefy_convert import (
    mixtral_config,
    scaled_routers,
    to_mixtral,
)
from compress.families.causal_lm.family import PPL_BATCH, calibration_blocks
from compress.families.causal_lm.model import perplexity
from compress.models.bundle import ModelBundle, count_params
from compress.recipe.kinds.moefy import MoefyConfig
from compress.recipe.options import TrainOptions
from compress.runfolder.files import atomic_write_text
from compress.stages.context import StageContext, State
from compress.train.loop import TrainSetup

ROUTING_FILE = "routing.safetensors"  # the split and the trained routers, for a resume
CURVES_FILE = "curves.json"
CURVE_POINTS = 50  # at most this many (step, loss) points of a curve in the metrics


def run(state: State, cfg: MoefyConfig, ctx: StageContext) -> State:
    """Split, route, convert, measure, recover, measure; save the MoE model."""
    bundle = state.bundle
    if (bundle.causal_lm_facts or {}).get("scheme"):
        raise CompressError("moefy needs a float model; moefy before quantize")
    dense = bundle.model.eval()
    try:
        mixtral_config(dense.config, cfg.experts, cfg.top_k)
    except ValueError as exc:
        raise CompressError(f"stages.{ctx.index}: {exc}") from None
    texts, length = ctx.data.splits["eval"].texts, ctx.data.max_length
    ppl = {"dense": perplexity(dense, bundle.tokenizer, texts, length, PPL_BATCH)["perplexity"]}
    train, held = calibration_batches(bundle, cfg, ctx)
    groups, weights = routing(dense, train, held, cfg, ctx)
    with torch.no_grad(), capture(dense) as found:
        dense(input_ids=held[0])
        inputs = [slot["x"] for slot in found]
    moe = to_mixtral(dense, groups, cfg.top_k, scaled_routers(weights, inputs))
    ppl["moefied"] = perplexity(moe, bundle.tokenizer, texts, length, PPL_BATCH)["perplexity"]
    ctx.log(f"{ctx.name}: {cfg.experts} experts of {groups[0].shape[1]} neurons, top-"
            f"{cfg.top_k}; perplexity dense {ppl['dense']:.2f}, moefied {ppl['moefied']:.2f}")
    moefied = ModelBundle(moe, "causal-lm", [], tokenizer=bundle.tokenizer,
                          causal_lm_facts={**(bundle.causal_lm_facts or {}), "scheme": None,
                                           "moefied": {"experts": cfg.experts,
                                                       "top_k": cfg.top_k}})
    if cfg.recovery is not None:
        recover(moefied, dense, cfg, ctx)
    after = perplexity(moe.eval(), bundle.tokenizer, texts, length, PPL_BATCH)
    ctx.metrics.update(
        experts=cfg.experts, top_k=cfg.top_k, split=cfg.split,
        expert_width=int(groups[0].shape[1]), params_dense=count_params(dense),
        params_moe=count_params(moe), params_active=active_params(moe, cfg),
        perplexity_dense=round(ppl["dense"], 4),
        perplexity_moefied=round(ppl["moefied"], 4),
        perplexity_recovered=after["perplexity"] if cfg.recovery else None, **after)
    ctx.save_model(moefied)
    return State(moefied)


def active_params(moe: torch.nn.Module, cfg: MoefyConfig) -> int:
    """Parameters a token runs through: all but the experts', and top_k / experts of
    theirs (the routers included)."""
    experts = sum(p.numel() for name, p in moe.named_parameters() if ".experts." in name)
    return count_params(moe) - experts + experts * cfg.top_k // cfg.experts


def calibration_batches(bundle: ModelBundle, cfg: MoefyConfig, ctx: StageContext
                        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The calibration text packed into blocks: those the routers train on, and a held-out
    batch or more (an eighth, at least one batch) that measures them."""
    blocks = calibration_blocks(bundle.tokenizer, ctx.data, "moefy")[:cfg.calibration.samples]
    hold = max(1, min(len(blocks) // 8, 4 * cfg.calibration.batch_size))
    if len(blocks) < 2:
        raise CompressError(f"data.calibration: {len(blocks)} block of {ctx.data.max_length} "
                            "tokens; moefy needs at least 2 (raise data.calibration.max_samples "
                            f"or stages.{ctx.index}.calibration.samples)")
    return blocks[:-hold], list(blocks[-hold:].split(cfg.calibration.batch_size))


def routing(dense: torch.nn.Module, train: torch.Tensor, held: list[torch.Tensor],
            cfg: MoefyConfig, ctx: StageContext) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The experts' neuron indexes and the trained router weights per layer (read back from
    the stage folder when a resumed run already made them with the same key)."""
    saved = ctx.folder / ROUTING_FILE
    if saved.is_file():
        from safetensors import safe_open

        with safe_open(str(saved), "pt") as handle:
            key = (handle.metadata() or {}).get("key")
        if key == ctx.key:
            tensors = load_file(str(saved))
            layers = len([k for k in tensors if k.startswith("groups.")])
            ctx.log(f"{ctx.name}: the split and routers of an earlier try, read back")
            ctx.metrics.update(json.loads((ctx.folder / "routing.json").read_text()))
            return ([tensors[f"groups.{i}"] for i in range(layers)],
                    [tensors[f"router.{i}"] for i in range(layers)])
    groups = split_neurons(dense, list(train.split(cfg.calibration.batch_size)), cfg.experts,
                           cfg.split, cfg.cluster_tokens, ctx.seed)
    routers = Routers(len(groups), dense.config.hidden_size, cfg.experts, ctx.seed)
    opts = TrainOptions(max_steps=cfg.router_steps, batch_size=cfg.router_batch_size,
                        learning_rate=cfg.router_learning_rate, weight_decay=0.0,
                        warmup_ratio=0.05, checkpoint_every=50)
    setup = TrainSetup(Examples(labels=[0] * len(train), inputs=train), ctx.data.max_length,
                       ctx.seed, ctx.checkpoint_dir / "router", f"{ctx.key}:router",
                       f"{ctx.name} routers")
    curve = Curve(ctx.folder, "router", ctx.key)
    result = setup.run(routers, opts, None, loss_fn=curve.wrap(
        make_router_loss_fn(dense, groups, cfg.top_k)), on_step=curve.on_step)
    quality = routing_quality(dense, routers.eval(), groups, held, cfg.top_k, ctx.seed)
    figures = {"router_steps": result.steps, "router_loss": result.final_loss,
               "router_wall_s": result.wall_s, "router_curve": curve.points(),
               "mass_selected_router": quality["trained"],
               "mass_selected_random": quality["random"],
               "mass_selected_best": quality["oracle"]}
    ctx.log(f"{ctx.name}: top-{cfg.top_k} experts keep {quality['trained']:.1%} of the "
            f"activation mass (random router {quality['random']:.1%}, best "
            f"{quality['oracle']:.1%})")
    weights = [linear.weight.detach().clone() for linear in routers.linears]
    tensors = {**{f"groups.{i}": g.contiguous() for i, g in enumerate(groups)},
               **{f"router.{i}": w.contiguous() for i, w in enumerate(weights)}}
    save_file(tensors, str(ctx.folder / f".{ROUTING_FILE}"), metadata={"key": ctx.key})
    atomic_write_text(ctx.folder / "routing.json", json.dumps(figures))
    (ctx.folder / f".{ROUTING_FILE}").replace(saved)
    ctx.metrics.update(figures)
    return groups, weights


def recover(moefied: ModelBundle, dense: torch.nn.Module, cfg: MoefyConfig,
            ctx: StageContext) -> None:
    """Train the MoE model on the packed train text (routers frozen: their scaled logits
    keep each chosen expert's weight at 1/k), towards `dense`'s next-token distributions
    with recovery_distill, else on the next-token loss."""
    setup = ctx.training(desc=f"{ctx.name} recovery")
    setup.examples = packed_examples(moefied.tokenizer, setup.examples.texts,
                                     ctx.data.max_length)
    for name, p in moefied.model.named_parameters():
        p.requires_grad_(not name.endswith("mlp.gate.weight"))
    teacher = dense if cfg.recovery_distill else None  # frozen by the loss; not used after
    loss_fn = causal_lm_loss if teacher is None else make_causal_lm_kd_loss_fn(
        teacher, cfg.temperature, cfg.alpha)
    curve = Curve(ctx.folder, "recovery", ctx.key)
    result = setup.run(moefied.model, cfg.recovery, None, loss_fn=curve.wrap(loss_fn),
                       on_step=curve.on_step)
    for p in moefied.model.parameters():
        p.requires_grad_(True)
    ctx.metrics.update({**result.figures(), **result.parallel_metrics(),
                        "recovery_curve": curve.points()})


class Curve:
    """The loss of each optimizer step of one training (the mean over its micro-batches),
    kept in `<stage folder>/curves.json` under `name` with the stage's cache key, so a
    resumed run keeps the steps it had done (and a changed stage starts afresh)."""

    def __init__(self, folder: Path, name: str, key: str):
        self.file, self.name, self.key = folder / CURVES_FILE, name, key
        self.losses: dict[int, float] = {int(s): v for s, v in self._all().get(name, [])}
        self.pending: list[float] = []

    def _all(self) -> dict[str, Any]:
        saved = json.loads(self.file.read_text()) if self.file.is_file() else {}
        return saved if saved.get("key") == self.key else {"key": self.key}

    def wrap(self, loss_fn):
        """`loss_fn` that also notes each micro-batch's loss."""
        def noted(model, inputs, labels):
            loss = loss_fn(model, inputs, labels)
            self.pending.append(float(loss.detach()))
            return loss

        return noted

    def on_step(self, step: int) -> None:
        if self.pending:
            self.losses[step] = round(sum(self.pending) / len(self.pending), 5)
        self.pending = []
        if step % 10 == 0:
            self.save()

    def save(self) -> None:
        everything = self._all()
        everything[self.name] = sorted(self.losses.items())
        atomic_write_text(self.file, json.dumps(everything))

    def points(self) -> list[list[float]]:
        """Every step's loss saved; at most CURVE_POINTS evenly spaced (step, loss) pairs,
        the last step included, for the metrics."""
        self.save()
        steps = sorted(self.losses)
        stride = max(1, -(-len(steps) // CURVE_POINTS))
        chosen = steps[::-1][::stride][::-1]
        return [[s, self.losses[s]] for s in chosen]
