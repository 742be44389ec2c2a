"""int8 quantization through torch.export and torchao's PT2E flow for the x86 Inductor backend.

export (dynamic batch and sequence) -> prepare (observers or fake-quant) -> calibrate or
quantization-aware training -> convert -> torch.compile with Inductor freezing, where
torchao's x86 passes fuse the (de)quantize pairs into int8 kernels (oneDNN, VNNI).

A quantized model is kept as an `ExportedProgram` file (`model.pt2`), re-exported from the
converted graph, so it loads back without this process and without the original code.
Only `torchao.quantization.pt2e` is used, never the deprecated `torch.ao.quantization` flow.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fnmatch
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torchao.quantization.pt2e import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
)
from torchao.quantization.pt2e.fake_quantize import (
    FakeQuantizeBase,
    FusedMovingAvgObsFakeQuantize,
)
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e, prepare_qat_pt2e
from torchao.quantization.pt2e.quantizer.quantizer import QuantizationSpec
from torchao.quantization.pt2e.quantizer.utils import QuantizationConfig
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
    X86InductorQuantizer,
    get_default_x86_inductor_quantization_config,
)

from compress.algorithms.smoothing import input_statistics, smooth_linears
from compress.data.datasets import collate, iterate
from compress.errors import CompressError
from compress.measure.evaluate import logits_of
from compress.models.bundle import ModelBundle
from compress.models.graph_model import GraphModel, compile_graph
from export.graphs import (
    EXPORT_SEQ,
    example_inputs,
    export_graph,
    export_inputs,
    graph_module,
    max_sequence,
)
from serve import cpu_features

# --- export -----------------------------------------------------------------------------


def capture(bundle: ModelBundle, train: bool = False) -> nn.Module:
    """The bundle's model exported to a graph module (train-mode ops for QAT). A train-mode
    graph gets its own copy of the weights: the exported module shares the model's tensors,
    and QAT would otherwise train the bundle's float model in place."""
    bundle.model.train(train)
    try:
        program = export_graph(graph_module(bundle), export_inputs(bundle), bundle.is_text,
                               max_sequence(bundle.model))
    finally:
        bundle.model.eval()
    return copy.deepcopy(program.module()) if train else program.module()


# --- quantizer ----------------------------------------------------------------------------


def per_tensor_weights(config: QuantizationConfig, is_qat: bool) -> QuantizationConfig:
    """`config` with one symmetric scale per weight tensor instead of per output channel."""
    observer = MovingAverageMinMaxObserver if is_qat else MinMaxObserver
    ctr = (FusedMovingAvgObsFakeQuantize.with_args(observer=observer, eps=2**-12) if is_qat
           else observer.with_args(eps=2**-12))
    weight = QuantizationSpec(dtype=torch.int8, quant_min=-128, quant_max=127,
                              qscheme=torch.per_tensor_symmetric, is_dynamic=False,
                              observer_or_fake_quant_ctr=ctr)
    return QuantizationConfig(config.input_activation, config.output_activation, weight,
                              config.bias, is_qat)


def reduce_range(mode: str) -> bool:
    """Whether `mode`'s activations keep to 7 bits here (torchao's reduce_range, which it
    advises for CPUs without VNNI): static int8 where int8 products go through AVX2's
    vpmaddubsw, whose int16 sum of two u8 x s8 products saturates (serve/cpu_features.py).
    On a Zen 3, all-MiniLM-L6-v2's static int8 embeddings of SST-2 validation went from
    recall@10 0.877 to 0.887 with it; its dynamic int8 from 0.845 to 0.723 (a batch's own
    range is too coarse at 7 bits), and QAT at 7 bits stopped closing the distance to the
    float embeddings in tests/integration/test_embedding_runs.py (0.0265 before training,
    0.0292 after, against 0.8x at 8 bits), so dynamic and QAT keep 8 bits; so does ONNX
    Runtime's int8, whose reduce_range measured no better
    (benchmarks/results/int8_reduce_range.md)."""
    return mode == "static" and cpu_features.int8_products_saturate()


def make_quantizer(mode: str, per_channel: bool, float_modules: Iterable[str]
                   ) -> X86InductorQuantizer:
    """The x86 Inductor quantizer of `mode`, leaving `float_modules` (full names) in float.
    Static activations keep to 7 bits on a CPU whose int8 products saturate (AVX2 without
    VNNI: `reduce_range`)."""
    is_qat = mode == "qat"
    config = get_default_x86_inductor_quantization_config(
        is_qat=is_qat, is_dynamic=mode == "dynamic", reduce_range=reduce_range(mode))
    if not per_channel:
        config = per_tensor_weights(config, is_qat)
    quantizer = X86InductorQuantizer().set_global(config)
    for name in float_modules:
        quantizer.set_module_name_qconfig(name, None)
    return quantizer


def float_module_names(model: nn.Module, patterns: list[str], prefix: str) -> list[str]:
    """Names (as seen in the exported graph) of the modules matching any fnmatch pattern."""
    return [prefix + name for name, _ in model.named_modules()
            if name and any(fnmatch.fnmatchcase(name, p) for p in patterns)]


# --- calibration and QAT --------------------------------------------------------------------


@torch.no_grad()
def calibrate(model: GraphModel, examples, samples: int, batch_size: int, tokenizer,
              max_length: int) -> int:
    """Run the first `samples` examples through the observers; return how many were seen."""
    order = list(range(min(samples, len(examples))))
    for inputs, _ in iterate(examples, batch_size, tokenizer, max_length, order):
        logits_of(model, inputs)
    return len(order)




def smoothed(bundle: ModelBundle, cfg, calibration, max_length: int
             ) -> tuple[ModelBundle, int]:
    """A copy of `bundle` whose Linears outside `cfg.keep_float` are smoothed with alpha
    `cfg.smoothing` (`compress.algorithms.smoothing`), observed on the calibration examples
    the static pass reads next; and how many Linears were smoothed."""
    model = copy.deepcopy(bundle.model).eval()
    calib = cfg.calibration
    absmax, groups = input_statistics(model, lambda: calibrate(
        model, calibration, calib.samples, calib.batch_size, bundle.tokenizer, max_length))
    count = smooth_linears(model, absmax, groups, cfg.smoothing, cfg.keep_float)
    return dataclasses.replace(bundle, model=model), count


def qat_probe(setup, batch_size: int, tokenizer) -> tuple[Any, torch.Tensor]:
    """The first `batch_size` training examples, collated: the batch QAT's figures are
    measured on."""
    idx = list(range(min(batch_size, len(setup.examples))))
    return collate(setup.examples, idx, tokenizer, setup.max_length)


@torch.no_grad()
def observed_copy(prepared: GraphModel, probe: tuple[Any, torch.Tensor]) -> GraphModel:
    """A copy of the fake-quantized model before any training step, its observers set by
    one forward pass over `probe` (the no-training control; the model trained is untouched)."""
    untrained = copy.deepcopy(prepared)
    untrained.train()
    logits_of(untrained, probe[0])
    return untrained.eval()


@torch.no_grad()
def qat_figures(untrained: GraphModel, trained: GraphModel, probe: tuple[Any, torch.Tensor],
                loss_fn) -> dict[str, float]:
    """How far training moved the weights (`qat_weight_change`: the norm of the change over
    the norm of the weights) and the training loss on `probe` (towards the float model's
    outputs where the loss is a distillation) of the fake-quantized model without training
    (`qat_loss_before_training`) and after it (`qat_loss_after_training`), both in eval mode."""
    trained.eval()
    before = dict(untrained.named_parameters())
    change = sum(float((p - before[n]).pow(2).sum()) for n, p in trained.named_parameters())
    size = sum(float(p.pow(2).sum()) for p in before.values())
    with observers_frozen(untrained), observers_frozen(trained):
        losses = [float(f"{float(loss_fn(m, *probe)):.6g}") for m in (untrained, trained)]
    return {"qat_weight_change": round((change / size) ** 0.5, 8) if size else 0.0,
            "qat_loss_before_training": losses[0], "qat_loss_after_training": losses[1]}


def label_loss(model: nn.Module, inputs: Any, labels: torch.Tensor) -> torch.Tensor:
    """The labels' cross-entropy: what QAT trains by where the stage gives no loss."""
    return nn.functional.cross_entropy(logits_of(model, inputs), labels)


@contextlib.contextmanager
def observers_frozen(model: nn.Module) -> Iterator[None]:
    """`model`'s fake-quantize observers off for the block (a measuring pass leaves the
    scales as training left them), then as they were."""
    quants = [m for m in model.modules() if isinstance(m, FakeQuantizeBase)]
    flags = [bool(m.observer_enabled[0]) for m in quants]
    for m in quants:
        m.disable_observer()
    try:
        yield
    finally:
        for m, flag in zip(quants, flags, strict=True):
            m.enable_observer(flag)


# --- compile --------------------------------------------------------------------------------


def warm_up(model: nn.Module, bundle: ModelBundle) -> float:
    """Seconds of the first inference call (where torch.compile compiles)."""
    began = time.perf_counter()
    with torch.inference_mode():  # inputs made here are inference tensors, as evaluation's
        inputs = example_inputs(bundle.tokenizer, bundle.input_shape, 2, EXPORT_SEQ)
        logits_of(model, inputs)  # (a tensor made outside would compile a second graph)
    return time.perf_counter() - began


# --- the stage's work -------------------------------------------------------------------------


def quantize(bundle: ModelBundle, cfg, calibration=None, *, setup=None,
             max_length: int = 128, loss_fn=None) -> tuple[ModelBundle, dict[str, Any]]:
    """The quantized bundle (kind "pt2e") of `bundle` per `cfg` (a QuantizeConfig) and the
    figures of the run. Static mode observes `calibration` (Examples); QAT trains on
    `setup` (a TrainSetup), by `loss_fn(model, inputs, labels)` where given (else the
    labels' cross-entropy). CompressError (CaptureError) when it cannot be done."""
    if bundle.kind == "pt2e":
        raise CompressError("the model is already quantized (kind pt2e); quantize a float "
                            "model")
    if cfg.mode == "static" and calibration is None:
        raise CompressError("static quantization needs calibration examples")
    if cfg.mode == "qat" and setup is None:
        raise CompressError("quantization-aware training needs training examples "
                            "(a TrainSetup)")
    metrics: dict[str, Any] = {"quant_mode": cfg.mode,  # 7-bit activations: make_quantizer
                               "int8_reduce_range": reduce_range(cfg.mode)}
    began = time.perf_counter()
    if getattr(cfg, "smoothing", None) is not None and cfg.mode == "static":
        bundle, metrics["smoothed_linears"] = smoothed(bundle, cfg, calibration, max_length)
        metrics["smoothing_alpha"] = cfg.smoothing
    graph = capture(bundle, train=cfg.mode == "qat")
    max_seq = max_sequence(bundle.model)
    prefix = "model." if bundle.is_text else ""
    quantizer = make_quantizer(cfg.mode, cfg.per_channel,
                               float_module_names(bundle.model, cfg.keep_float, prefix))
    if cfg.mode == "qat":
        prepared = GraphModel(prepare_qat_pt2e(graph, quantizer), bundle.is_text, max_seq,
                              trainable=True)
        prepared.training = True
        probe = qat_probe(setup, cfg.qat.batch_size, bundle.tokenizer)
        untrained = observed_copy(prepared, probe)
        result = setup.run(prepared, cfg.qat, bundle.tokenizer,
                           **({"loss_fn": loss_fn} if loss_fn is not None else {}))
        prepared.eval()
        metrics["qat_steps"] = result.steps
        metrics.update(qat_figures(untrained, prepared, probe, loss_fn or label_loss))
    else:
        prepared = GraphModel(prepare_pt2e(graph, quantizer), bundle.is_text, max_seq)
        if cfg.mode == "static":
            calib = cfg.calibration
            metrics["calibration_samples"] = calibrate(
                prepared, calibration, calib.samples, calib.batch_size, bundle.tokenizer,
                max_length)
        else:  # dynamic: one pass so every placeholder observer has run
            prepared(*export_inputs(bundle))
    converted = GraphModel(drop_unused_weights(convert_pt2e(prepared.graph)), bundle.is_text,
                           max_seq)
    metrics["quantize_s"] = round(time.perf_counter() - began, 3)
    result_bundle = pt2e_bundle(converted, bundle)
    if cfg.compile:
        compile_graph(converted)
        metrics["compile_s"] = round(warm_up(converted, result_bundle), 3)
    return result_bundle, metrics


def drop_unused_weights(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Remove parameters and buffers no node reads any more: after `convert_pt2e` the float
    copies of quantized weights stay attached and would be saved beside the int8 ones."""
    used = {node.target for node in graph.graph.nodes if node.op == "get_attr"}
    for name, _ in [*graph.named_parameters(), *graph.named_buffers()]:
        if name not in used:
            owner, _, attr = name.rpartition(".")
            delattr(graph.get_submodule(owner) if owner else graph, attr)
    return graph


def pt2e_bundle(model: GraphModel, like: ModelBundle) -> ModelBundle:
    """A "pt2e" bundle of `model` with the tokenizer, labels and input shape of `like`."""
    return ModelBundle(model, "pt2e", list(like.label_names), tokenizer=like.tokenizer,
                       input_shape=list(like.input_shape))


# --- save and load ------------------------------------------------------------------------------




