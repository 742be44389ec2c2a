"""A PT2E int8 model: the exported graph called like the original model (`GraphModel`),
compiled with Inductor, saved as `model.pt2` and read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.models.attention_dropout import switch_attention_dropout
from compress.models.bundle import ModelBundle
from compress.models.exported_mode import move_to_eval, move_to_train
from export.graphs import dynamic_shapes, export_inputs, inductor_freezing, positional_inputs
from export.random_ops import fx_random_nodes, refuse_random_ops

PROGRAM = "model.pt2"


META = "model.json"


class GraphModel(nn.Module):
    """An exported graph called like the original model (`logits_of` works on it).

    Text graphs take (input_ids, attention_mask, token_type_ids); missing masks and token
    types are filled in. `train()`/`eval()` switch a prepared (QAT) graph with
    `exported_mode` (torchao's helpers, their patterns exported once) and
    `switch_attention_dropout`; a converted graph has no train mode and only records the flag.
    `compiled` (when set) runs the forward; `graph` stays the plain module that can be
    re-exported.
    """

    def __init__(self, graph: nn.Module, text: bool, max_seq: int = 512,
                 trainable: bool = False):
        super().__init__()
        self.graph = graph
        self.text = text
        self.max_seq = max_seq
        self.trainable = trainable
        self.freezing = True
        self.__dict__["compiled"] = None  # not a submodule: no duplicate state_dict keys

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        graph_args = positional_inputs(self.text, args, kwargs)
        if self.compiled is None:
            return self.graph(*graph_args)
        with inductor_freezing(self.freezing):  # read when (re)compiling; see graphs.py
            return self.compiled(*graph_args)

    def train(self, mode: bool = True) -> GraphModel:
        if self.trainable and mode != self.training:
            (move_to_train if mode else move_to_eval)(self.graph)
            switch_attention_dropout(self.graph, mode)
        self.training = mode
        return self


def compile_graph(model: GraphModel, mode: str = "default", dynamic: bool | None = True,
                  freezing: bool = True) -> GraphModel:
    """Run `model` through torch.compile (Inductor) from now on; with `freezing`, its calls
    run under `inductor_freezing`, where torchao's x86 passes lower the int8 patterns.

    `dynamic=True` keeps one graph for every batch size and sequence length (batch 1 still
    gets its own, as size 1 is specialised)."""
    model.__dict__["compiled"] = torch.compile(model.graph, mode=mode, dynamic=dynamic)
    model.freezing = freezing
    return model


def save_quantized(bundle: ModelBundle, folder: Path) -> Path:
    """Write `model.pt2` (the re-exported int8 program), `model.json` and the tokenizer."""
    model: GraphModel = bundle.model
    folder.mkdir(parents=True, exist_ok=True)
    args = export_inputs(bundle)
    program = torch.export.export(model.graph, args,
                                  dynamic_shapes=dynamic_shapes(bundle.is_text, model.max_seq))
    refuse_random_ops(fx_random_nodes(program.graph), f"the quantized program {PROGRAM}")
    torch.export.save(program, folder / PROGRAM)
    meta = {"label_names": bundle.label_names, "input_shape": bundle.input_shape,
            "text": bundle.is_text, "max_seq": model.max_seq}
    (folder / META).write_text(json.dumps(meta, indent=2))
    if bundle.is_text:
        bundle.tokenizer.save_pretrained(folder)
    return folder / PROGRAM


def load_quantized(folder: Path, compile: bool = True) -> ModelBundle:
    """Read back a folder written by `save_quantized` (compiled for evaluation by default)."""
    meta = json.loads((folder / META).read_text())
    tokenizer = None
    if meta["text"]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
    graph = torch.export.load(folder / PROGRAM).module()
    model = GraphModel(graph, meta["text"], meta["max_seq"])
    if compile:
        compile_graph(model)
    return ModelBundle(model, "pt2e", meta["label_names"], tokenizer=tokenizer,
                       input_shape=meta["input_shape"])
