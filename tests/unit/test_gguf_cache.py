"""A GGUF converted once: a folder appears whole or not at all, a changed file converts
again, and the cache lives where COMPRESS_CACHE_DIR says (that the converted folder holds
the GGUF's own weights and token ids: tests/integration/test_llm_runs.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from compress.families.causal_lm import gguf_cache


def test_a_folder_is_written_once_and_read_after(tmp_path: Path) -> None:
    writes: list[Path] = []

    def write(folder: Path) -> None:
        writes.append(folder)
        (folder / "weights").write_text("w")

    final = tmp_path / "cache" / "model-float32"
    assert gguf_cache._converted(final, write) == final
    assert gguf_cache._converted(final, write) == final
    assert len(writes) == 1 and writes[0] != final
    assert sorted(p.name for p in final.iterdir()) == [gguf_cache.COMPLETE, "weights"]
    assert [p.name for p in final.parent.iterdir()] == ["model-float32"]  # no scratch left


def test_a_failed_conversion_leaves_nothing_and_a_half_folder_is_replaced(
        tmp_path: Path) -> None:
    final = tmp_path / "model-float32"

    def fail(folder: Path) -> None:
        (folder / "weights").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        gguf_cache._converted(final, fail)
    assert list(tmp_path.iterdir()) == []
    final.mkdir()  # a folder under the final name without its mark: an older cut-short copy
    (final / "weights").write_text("half")
    gguf_cache._converted(final, lambda folder: (folder / "weights").write_text("whole"))
    assert (final / "weights").read_text() == "whole" and (final / gguf_cache.COMPLETE).is_file()


def test_the_key_follows_the_file_and_the_root_follows_the_environment(
        tmp_path: Path, monkeypatch) -> None:
    gguf = tmp_path / "m.Q4_1.gguf"
    gguf.write_bytes(b"GGUF1")
    first = gguf_cache.cache_key(gguf)
    os.utime(gguf, ns=(1, 1))
    second = gguf_cache.cache_key(gguf)
    assert second != first and second == "m.Q4_1-5-1"
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "mine"))
    assert gguf_cache.cache_root() == tmp_path / "mine"
    monkeypatch.delenv("COMPRESS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_cache.cache_root() == tmp_path / "xdg" / "compress"
