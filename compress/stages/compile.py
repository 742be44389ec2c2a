"""Stage `compile`: torch.compile of the current model, timed on one real batch.

A compiled model cannot be serialised, so the stage saves the plain model and hands on a
`CompiledModel` wrapper for the measurements that follow. A later stage receiving it keeps
working: the wrapper runs the compiled graph only for inference (eval mode, no grad) while
the weights are unchanged since compiling, and the eager model otherwise (training, or
after a stage changed weights, where frozen constants would be stale). Attributes such as
`config` or `save_pretrained` and the state dict are those of the wrapped model, so saving
the wrapper writes the same files as saving the model. Quantized ("pt2e") bundles get a
fresh `GraphModel` compiled with this stage's options instead.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.data.datasets import iterate
from compress.measure.evaluate import logits_of
from compress.models.bundle import ModelBundle
from compress.models.graph_model import GraphModel, compile_graph
from compress.recipe.kinds.compile import CompileConfig
from compress.stages.context import StageContext, State
from export.graphs import inductor_freezing


class CompiledModel(nn.Module):
    """`model` called through torch.compile for inference, eagerly otherwise."""

    def __init__(self, model: nn.Module, cfg: CompileConfig):
        super().__init__()
        self.model = model
        self.freezing = cfg.freezing
        self.__dict__["compiled"] = torch.compile(model, mode=cfg.mode, dynamic=cfg.dynamic)
        self.__dict__["versions"] = weight_versions(model)

    def use_compiled(self) -> bool:
        """Inference with the weights the compiled (possibly frozen) graph was built from."""
        return (not self.training and not torch.is_grad_enabled()
                and weight_versions(self.model) == self.versions)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.use_compiled():
            return self.model(*args, **kwargs)
        with inductor_freezing(self.freezing):
            return self.compiled(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("model"), name)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.load_state_dict(*args, **kwargs)


def weight_versions(model: nn.Module) -> tuple[int, ...]:
    """In-place modification counters of the parameters and buffers (inference tensors,
    which keep none, count as -1)."""
    return tuple(-1 if t.is_inference() else t._version
                 for t in (*model.parameters(), *model.buffers()))


def plain_model(model: nn.Module) -> nn.Module:
    """The model under any `CompiledModel` wrappers."""
    while isinstance(model, CompiledModel):
        model = model.model
    return model


def compiled_bundle(bundle: ModelBundle, cfg: CompileConfig) -> ModelBundle:
    """`bundle` with its model compiled per `cfg`."""
    model = plain_model(bundle.model)
    if isinstance(model, GraphModel):
        fresh = GraphModel(model.graph, model.text, model.max_seq)
        return replace(bundle, model=compile_graph(fresh, cfg.mode, cfg.dynamic, cfg.freezing))
    return replace(bundle, model=CompiledModel(model.eval(), cfg))


def first_batch(ctx: StageContext, bundle: ModelBundle) -> Any:
    """Inputs of the first evaluation batch."""
    batch_size = ctx.recipe.evaluation.batch_size
    inputs, _ = next(iterate(ctx.data.splits["eval"], batch_size, bundle.tokenizer,
                             ctx.data.max_length))
    return inputs


def run(state: State, cfg: CompileConfig, ctx: StageContext) -> State:
    """Compile the current model, time the first (compiling) call, save the plain model."""
    bundle = state.bundle
    plain = replace(bundle, model=plain_model(bundle.model))
    compiled = compiled_bundle(bundle, cfg)
    inputs = first_batch(ctx, bundle)
    began = time.perf_counter()
    with torch.inference_mode():
        logits_of(compiled.model.eval(), inputs)
    ctx.metrics["compile_s"] = round(time.perf_counter() - began, 3)
    ctx.save_model(plain)
    return State(compiled)


def reload(folder: Path, config: dict[str, Any], threads: int | None,
           override: int | None = None) -> ModelBundle:
    """The saved model compiled with the stage's options, its first (compiling) call made."""
    from compress.algorithms.quantization import warm_up
    from compress.models.folders import load_saved

    bundle = compiled_bundle(load_saved(folder), CompileConfig.model_validate(config))
    warm_up(bundle.model.eval(), bundle)
    return bundle
