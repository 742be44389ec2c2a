"""A failed tensor-parallel comparison names the rank's error and keeps torchrun's output."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from compress.errors import CompressError
from compress.families.causal_lm.stages.export_parallel import run_comparison_script


def test_a_rank_that_raises_is_named_and_its_output_kept(tmp_path: Path) -> None:
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "broken_split.py").write_text(
        "print('rank starting')\nraise ValueError('the split went wrong here')\n")
    stage = tmp_path / "run/00-export"
    stage.mkdir(parents=True)
    recipe = SimpleNamespace(evaluation=SimpleNamespace(generation=SimpleNamespace(
        max_new_tokens=4)), data=SimpleNamespace(chat_template=False))
    ctx = SimpleNamespace(folder=stage, run_dir=tmp_path / "run", recipe=recipe,
                          name="export", log=lambda line: None)
    with pytest.raises(CompressError) as info:
        run_comparison_script(folder, "broken_split", "tensor_parallel", 1, ["hi"], ctx)
    message = str(info.value)
    assert "tensor-parallel check failed on 1 processes: ValueError: the split went wrong" \
        in message
    assert "00-export/tensor_parallel.log" in message
    log = (stage / "tensor_parallel.log").read_text()
    assert "rank starting" in log and "Traceback" in log
