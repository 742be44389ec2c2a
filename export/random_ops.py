"""Random ops left in an exported graph: dropout in train mode, attention with a nonzero
`dropout_p`, sampling (bernoulli, rand*, normal, multinomial...). Such a graph gives other
outputs on every call, so every export refuses it (DESIGN: an artifact is deterministic).

An op is random when PyTorch tags it `nondeterministic_seeded`, unless its arguments turn
the randomness off: `train=False` (dropout, RNNs in eval) or a drop probability of exactly 0
(`dropout_p`, `p`, `dropout`). A probability that is not a constant counts as random.
"""

from __future__ import annotations

from typing import Any

import torch

from export.errors import RandomOpError

PROBABILITY_ARGS = ("dropout_p", "p", "dropout")
UNKNOWN = object()  # an argument whose value is not a constant of the graph
# ONNX ops that draw random numbers whatever their inputs (Dropout is checked on its own)
ONNX_SAMPLING = ("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                 "Bernoulli", "Multinomial")


def op_arguments(op: torch._ops.OpOverload, args: tuple | list, kwargs: dict[str, Any]
                 ) -> dict[str, Any]:
    """`op`'s arguments by schema name, defaults filled in."""
    values: dict[str, Any] = {}
    for i, arg in enumerate(op._schema.arguments):
        if i < len(args):
            values[arg.name] = args[i]
        elif arg.name in kwargs:
            values[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            values[arg.name] = arg.default_value
    return values


def is_random(op: Any, values: dict[str, Any]) -> bool:
    """Whether a call of `op` with these argument values draws random numbers."""
    if not isinstance(op, torch._ops.OpOverload) or \
            torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    if values.get("train", True) is False:
        return False
    probability = next((values[name] for name in PROBABILITY_ARGS if name in values), None)
    return not (isinstance(probability, int | float) and probability == 0)


def describe(name: str, op: Any, values: dict[str, Any]) -> str:
    """`name (op, p=...)`: the node and the argument that makes it random."""
    shown = [f"{key}={values[key]}" for key in (*PROBABILITY_ARGS, "train")
             if key in values and values[key] is not UNKNOWN]
    return f"{name} ({op}{', ' if shown else ''}{', '.join(shown)})"


def fx_random_nodes(graph: torch.fx.Graph) -> list[str]:
    """The random nodes of an FX graph (torch.export, PT2E, torch-tensorrt)."""
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            values = op_arguments(node.target, node.args, node.kwargs)
            if is_random(node.target, values):
                found.append(describe(node.name, node.target, values))
    return found


def script_random_nodes(graph: torch._C.Graph) -> list[str]:
    """The random nodes of a TorchScript graph (pass `module.inlined_graph`)."""
    found = []
    for index, node in enumerate(graph.nodes()):
        op = _script_op(node)
        if op is None:
            continue
        constants = [value.toIValue() if value.node().kind() == "prim::Constant" else UNKNOWN
                     for value in node.inputs()]
        values = op_arguments(op, constants, {})
        if is_random(op, values):
            found.append(describe(f"{node.kind()}#{index}", op, values))
    return found


def _script_op(node: torch._C.Node) -> torch._ops.OpOverload | None:
    """The operator overload a TorchScript node calls (None for prim nodes and the like)."""
    try:
        schema = torch._C.parse_schema(node.schema())
        namespace, name = schema.name.split("::")
        packet = getattr(getattr(torch.ops, namespace), name)
        return getattr(packet, schema.overload_name or "default")
    except (RuntimeError, ValueError, AttributeError):  # "(no schema)", prim::, unknown op
        return None


def onnx_random_nodes(model: Any) -> list[str]:
    """The random nodes of an ONNX model: sampling ops, and a Dropout whose training_mode
    input is not a constant False (without it, Dropout is the identity at inference)."""
    from onnx import numpy_helper

    constants = {init.name: init for init in model.graph.initializer}
    constants.update({node.output[0]: attr.t for node in model.graph.node
                      if node.op_type == "Constant" for attr in node.attribute
                      if attr.name == "value"})
    found = []
    for node in model.graph.node:
        mode = node.input[2] if node.op_type == "Dropout" and len(node.input) > 2 else ""
        training = bool(mode) and (mode not in constants
                                   or numpy_helper.to_array(constants[mode]).any())
        if node.op_type in ONNX_SAMPLING or training:
            found.append(f"{node.name or node.output[0]} ({node.op_type})")
    return found


def refuse_random_ops(found: list[str], what: str) -> None:
    """Raise a one-line RandomOpError naming the first random node of `what`, if any."""
    if not found:
        return
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    raise RandomOpError(f"{what} holds a random op, so its outputs would change from call to "
                        f"call: {found[0]}{more}; export a model in eval mode (dropout off, "
                        f"no sampling)")
