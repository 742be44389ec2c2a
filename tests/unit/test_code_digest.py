"""A stage's cache key holds the code it runs: the modules it imports (lazily too), read
from the sources without importing them. (That a change to that code runs the stage again,
and a change to code it cannot reach (the CLI) leaves it cached: tests/integration/
test_pipeline_runs.py.)"""

from __future__ import annotations

from pathlib import Path

from compress.runfolder import code_digest
from compress.runfolder.code_digest import module_closure


def test_the_closure_follows_lazy_and_relative_imports_within_the_project() -> None:
    closure = module_closure(["compress.stages.prune"])
    assert "compress.stages.prune" in closure and "compress.algorithms.pruning" in closure
    assert "compress" in closure and "compress.stages" in closure  # their __init__ run too
    assert "compress.cli.main" not in closure and "torch" not in closure
    assert module_closure(["not_a_project_module"]) == []


def test_a_kernel_source_a_module_builds_is_part_of_its_digest() -> None:
    from compress.runfolder.files import sha256_file
    from serve import encoder_attention

    digests = code_digest.code_digests(["serve.encoder_attention"])
    source = encoder_attention.SOURCE
    assert f"serve.encoder_attention:{source.name} {sha256_file(source)}" in digests
    assert code_digest.native_sources(Path(encoder_attention.__file__)) == sorted(
        encoder_attention.SOURCES)  # the attention and the norm kernels
