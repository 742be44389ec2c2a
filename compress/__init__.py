"""compress: a model compression and deployment pipeline driven by YAML recipes.

The Python API beside the CLI (imported lazily: `import compress` loads no torch):

- `load_recipe(path, overrides)`, `run(recipe)`: the whole pipeline, as `compress run` does.
- `load_model(folder_or_id, label_names)`: a saved stage model, a Hugging Face folder or id.
- `prune(model, config, setup)`, `distill(teacher, config, setup)`,
  `quantize(model, config, calibration)`: the algorithms, on plain arguments; each returns
  the figures it measured (`prune` changes the model in place).
- `export(model, config, folder)`, `load_export(folder)`: write a deployable file and load
  it back in its own runtime.
- Config classes (`PruneConfig`, `QuantizeConfig`, `ExportConfig`...) and `TrainSetup`.

Algorithms raise `CompressError` (`CaptureError`, `ParityError`, `ExportError`) with one
line saying what went wrong; recipe problems raise `UserError`.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_API = {
    "load_recipe": "compress.recipe.schema:load_recipe",
    "run": "compress.api:run",
    "load_model": "compress.api:load_model",
    "load_data": "compress.api:load_data",
    "prune": "compress.stages.prune:prune",
    "distill": "compress.stages.distill:distill",
    "quantize": "compress.algorithms.quantization:quantize",
    "export": "compress.stages.export:export",
    "load_export": "compress.models.folders:load_export",
    "score": "compress.api:score",
    "TrainSetup": "compress.train.loop:TrainSetup",
    "FinetuneConfig": "compress.recipe.kinds.finetune:FinetuneConfig",
    "DistillConfig": "compress.recipe.kinds.distill:DistillConfig",
    "PruneConfig": "compress.recipe.kinds.prune:PruneConfig",
    "QuantizeConfig": "compress.recipe.kinds.quantize:QuantizeConfig",
    "CompileConfig": "compress.recipe.kinds.compile:CompileConfig",
    "ExportConfig": "compress.recipe.kinds.export:ExportConfig",
    "PackageConfig": "compress.recipe.kinds.package:PackageConfig",
    "CompressError": "compress.errors:CompressError",
    "CaptureError": "compress.errors:CaptureError",
    "ParityError": "compress.errors:ParityError",
    "ExportError": "compress.errors:ExportError",
    "UserError": "compress.errors:UserError",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'compress' has no attribute {name!r}")
    module, attr = _API[name].split(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
