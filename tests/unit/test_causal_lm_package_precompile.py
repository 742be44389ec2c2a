"""The package stage's precompile child (compress/families/causal_lm/stages/package.py) is
handed absolute paths: it runs in the archive's code tree, so a run folder given relative
(`output_dir=runs`) once named an export the child could not find."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from compress.families.causal_lm.stages import package


class FakeChild:
    def __init__(self, command, cwd, env, **_):
        self.command, self.cwd, self.env = command, cwd, env
        self.stdout, self.returncode = ["precompile: done\n"], 0
        FakeChild.seen = self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_precompile_child_gets_absolute_paths(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(package.subprocess, "Popen", FakeChild)
    logged: list[str] = []
    ctx = SimpleNamespace(log=logged.append, metrics={})
    package.precompile(Path("runs/x/03-package/.archive_code/tree"),
                       Path("runs/x/02-export/transformers"), {"rows": 8}, ctx)
    child = FakeChild.seen
    export, out = Path(child.command[3]), Path(child.command[5])
    assert export == tmp_path / "runs/x/02-export/transformers"
    assert out.is_absolute() and Path(child.cwd).is_absolute()
    assert Path(child.env["PYTHONPATH"]) == tmp_path / "runs/x/03-package/.archive_code/tree"
    assert "precompile_s" in ctx.metrics and logged
    assert os.getcwd() == str(tmp_path)
