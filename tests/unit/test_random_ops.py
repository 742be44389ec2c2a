"""Exports refuse a graph that still holds a random op, in one line naming the node; a QAT
graph switched to eval holds none (attention dropout once survived there as SDPA's
`dropout_p`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import cli, digits_recipe, write_recipe
from torch import nn

from compress.errors import RandomOpError
from compress.models.bundle import ModelBundle
from compress.recipe.kinds.export import ExportConfig
from compress.stages.export import export
from export.random_ops import fx_random_nodes

NOISY_MODULE = '''
import torch
from torch import nn


class AlwaysDropout(nn.Module):
    """An MLP on 8x8 digits whose dropout stays on in eval mode."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x):
        return nn.functional.dropout(self.linear(x.flatten(1)), 0.5, training=True)


def model():
    return AlwaysDropout()
'''


@pytest.fixture
def noisy_module(tmp_path: Path, monkeypatch) -> str:
    """The import path (`module:factory`) of a model whose dropout is on in eval mode."""
    (tmp_path / "noisy_digits.py").write_text(NOISY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "noisy_digits:model"


def _bundle(source: str) -> ModelBundle:
    import importlib

    module, _, factory = source.partition(":")
    model = getattr(importlib.import_module(module), factory)().eval()
    return ModelBundle(model, "factory", [str(i) for i in range(10)], factory=source,
                       input_shape=[1, 8, 8])


@pytest.mark.parametrize("fmt", ["torchscript", "onnx", "aoti"])
def test_every_export_refuses_dropout_left_on_naming_the_node(
        fmt: str, noisy_module: str, tmp_path: Path) -> None:
    with pytest.raises(RandomOpError) as info:
        export(_bundle(noisy_module), ExportConfig(format=fmt), tmp_path / fmt)
    message = str(info.value)
    assert message.startswith(f"the {fmt} graph holds a random op") and "\n" not in message
    node = {"torchscript": "aten::dropout#", "onnx": "(Dropout)",
            "aoti": "dropout (aten.dropout.default, p=0.5, train=True)"}[fmt]
    assert node in message, message
    assert not (tmp_path / fmt).exists()  # nothing half-written is left as the export


def test_a_random_op_fails_the_run_in_one_line_without_traceback(
        noisy_module: str, tmp_path: Path, monkeypatch, capsys) -> None:
    raw = digits_recipe(tmp_path / "runs")
    raw["model"] = {"source": noisy_module}
    raw["stages"] = [{"kind": "export", "format": "torchscript"}]
    raw["evaluation"]["latency"]["enabled"] = False
    code, _, err = cli(monkeypatch, capsys, "run", str(write_recipe(tmp_path / "r.yaml", raw)))
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and "Traceback" not in err
    assert errors == [line for line in err.splitlines() if "random op" in line]
    assert len(errors) == 1 and errors[0].startswith(
        "error: stage export failed: the torchscript graph holds a random op"), err


def test_eval_and_sampling_ops_are_told_apart() -> None:
    class Mixed(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = x.view(2, 1, 4, 8)
            y = nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
            y = nn.functional.dropout(y, 0.1, training=False)  # the identity
            return y.flatten(1) + torch.rand_like(x)

    graph = torch.export.export(Mixed().eval(), (torch.randn(2, 32),)).graph
    assert [name.split(" ")[0] for name in fx_random_nodes(graph)] == ["rand_like"]
