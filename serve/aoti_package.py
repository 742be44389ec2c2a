"""An AOTInductor package loaded by its C++ loader alone (torch only: shipped in every
archive beside its handler).

`torch._inductor.aoti_load_package` asks Inductor which vector instruction set this CPU
builds before it loads a package, only to warn where the package's differs, and Inductor
answers by compiling and loading a test library with g++ for each of the CPU's AVX-512
extensions: on an Emerald Rapids (AVX512-BF16 and VNNI) three compiles and three Python
processes, 1.3 s of a served worker's start with an empty Inductor cache, and the import of
Inductor itself. Where the two differ, that loader only warns and loads the package all the
same (a causal-LM worker refuses a package built for another CPU's flags or torch before
loading it: `compiled_graphs.use_shipped`), so `load` goes to the C++ loader directly, with
the same extraction (into this process's temporary folder, `worker_temp`), and `Package`
calls it as the Python loader's model does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from serve import worker_temp

MODEL = "model"  # the name AOTInductor gives the one model of a package it compiled


class Package:
    """A loaded package, called as `aoti_load_package`'s `AOTICompiledModel` is (whose module
    imports torch.export's serializer, and with it Dynamo and Inductor): positional
    arguments, any nesting of lists and tuples of tensors; the package's call spec read
    once, not at every call."""

    def __init__(self, loader: Any):
        self.loader = loader
        _, out_spec = loader.get_call_spec()
        self.out_spec = pytree.treespec_loads(out_spec)

    def __call__(self, *args: Any) -> Any:
        flat = [x for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
        return pytree.tree_unflatten(self.loader.boxed_run(flat), self.out_spec)

    def get_constant_fqns(self) -> list[str]:
        return self.loader.get_constant_fqns()

    def load_constants(self, constants: dict[str, torch.Tensor], *, check_full_update: bool,
                       user_managed: bool = False) -> None:
        """Hand the package its weights by name (`user_managed`: the tensors themselves,
        which the caller keeps alive, not copies)."""
        self.loader.load_constants(constants, False, check_full_update, user_managed, False)


def load(path: Path) -> Package:
    """The package at `path`, its files extracted into this process's own folder. Raises
    RuntimeError where it does not load."""
    with worker_temp.extracting():
        return Package(torch._C._aoti.AOTIModelPackageLoader(str(path), MODEL, False, 1, -1))
