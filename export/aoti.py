"""AOTInductor: `torch.export` with dynamic batch and sequence, compiled ahead of time into
one `.pt2` package that `torch._inductor.aoti_load_package` runs with plain torch. Float,
pruned and PT2E int8 models alike (int8 compiles with Inductor freezing, where the x86
int8 kernels are chosen). With `autocast: bf16` the graph is captured under bfloat16
autocast: the float ops run in bf16 (int8-mixed-bf16 for a PT2E model). With
`attention: kernel` the encoder's attention calls compress's own operator
(export/attention_kernel.py), and in a PT2E int8 graph so do its add + LayerNorm + quantize
(export/fused_norm.py) and its GELU + SmoothQuant multiply + quantize (export/fused_gelu.py).
With `attention: packed` a sentence encoder computes the real tokens of its batch only, in
one sequence (its `packed()` copy, compress/families/embedding/packing.py); an int8 graph
must have been captured so (the search's packed candidate)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from export.attention_kernel import OPERATOR, use_attention_kernel
from export.errors import CaptureError
from export.flat_activations import flatten_activation_linears
from export.fused_gelu import fuse_gelus
from export.fused_norm import fuse_norms
from export.fused_projections import fuse_projections
from export.graph_edits import merge_repeats
from export.graphs import (
    Bundle,
    TextLogits,
    export_graph,
    export_inputs,
    graph_module,
    inductor_freezing,
    max_sequence,
)
from export.quantized_attention import quantize_attention_answers
from export.random_ops import fx_random_nodes, refuse_random_ops
from serve import encoder_attention

FILE = "model.aoti.pt2"


def export(bundle: Bundle, cfg, folder: Path, calibration=None,
           log: Callable[[str], None] = print) -> tuple[Path, dict[str, Any]]:
    """Export and AOT-compile the model into `model.aoti.pt2`."""
    attention = getattr(cfg, "attention", "sdpa")
    if bundle.kind == "pt2e":  # a GraphModel holding the converted int8 graph
        module, max_seq = bundle.model.graph, bundle.model.max_seq
    elif attention == "packed":
        module, max_seq = TextLogits(packed_model(bundle.model)), max_sequence(bundle.model)
    else:
        module, max_seq = graph_module(bundle).eval(), max_sequence(bundle.model)
    autocast = getattr(cfg, "autocast", None)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast == "bf16"):
        program = export_graph(module, export_inputs(bundle), bundle.is_text, max_seq)
    refuse_random_ops(fx_random_nodes(program.graph), "the aoti graph")
    if bundle.kind == "pt2e" and merge_repeats(program.graph_module.graph):
        program.graph_module.recompile()  # one multiply and quantize where SmoothQuant repeated
    flattened = flatten_activation_linears(program) if bundle.kind == "pt2e" else 0
    merged = fuse_projections(program) if bundle.kind == "pt2e" else 0
    kernel_calls = (packed_calls(program) if attention == "packed"
                    else use_attention_kernel(program) if attention == "kernel" else 0)
    # an int8 graph on the kernels: its add + LayerNorm + quantize, GELU + multiply +
    # quantize, and attention + multiply + quantize, too
    int8_on_kernels = bool(kernel_calls) and bundle.kind == "pt2e"
    norms = fuse_norms(program) if int8_on_kernels else 0
    gelus = fuse_gelus(program) if int8_on_kernels else 0
    answers = quantize_attention_answers(program) if int8_on_kernels else 0
    path = folder / FILE
    # Inductor freezes (constant-folds weights, picks the int8 kernels) only with grad off
    with inductor_freezing(True), torch.no_grad():
        torch._inductor.aoti_compile_and_package(program, package_path=str(path))
    meta: dict[str, Any] = {"aoti_max_seq": max_seq}
    if autocast:
        meta["aoti_autocast"] = autocast
    if flattened:
        meta["aoti_fused_activations"] = flattened
    if merged:
        meta["aoti_merged_linears"] = merged
    if norms:
        meta["aoti_fused_norms"] = norms
    if gelus:
        meta["aoti_fused_gelus"] = gelus
    if answers:
        meta["aoti_quantized_attention"] = answers
    if attention == "packed":
        meta["aoti_packed"] = True  # one pass a batch: a server need not split it by length
    if kernel_calls:  # the operator the serving process registers before it loads, and its
        # library for this CPU beside the file (an archive carries it; plain torch loads it
        # with torch.ops.load_library)
        library = encoder_attention.built_library()
        if library is not None:
            shutil.copy2(library, folder / library.name)
        meta.update(aoti_operators=[OPERATOR], aoti_attention_kernel_calls=kernel_calls)
    return path, meta


def packed_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model's packed copy (a sentence encoder's `packed()`); CaptureError else."""
    pack = getattr(model, "packed", None)
    if pack is None:
        raise CaptureError("attention: packed packs the texts of a batch for sentence "
                           "encoders (task: embedding), and this model is not one; use "
                           "attention: kernel")
    return pack()


def packed_calls(program: torch.export.ExportedProgram) -> int:
    """How many calls of the packed attention kernel the program makes; CaptureError where
    none (an int8 graph captured padded)."""
    kernel = getattr(torch.ops, OPERATOR).packed_attention.default
    calls = sum(node.op == "call_function" and node.target == kernel
                for node in program.graph.nodes)
    if not calls:
        raise CaptureError("attention: packed: this graph computes padded batches (it was "
                           "captured before packing); quantize the packed encoder (the "
                           "search's pt2e_static_packed_aoti candidate), or export with "
                           "attention: kernel")
    return calls
