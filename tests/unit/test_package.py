"""Package stage: the .mar's contents and settings, and the batching handler run in this
process with TorchServe's own Context (no server: tests/serving starts a real one)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("ts")


from serve.classifier.handler import worker_threads  # noqa: E402


def test_worker_threads_never_exceed_the_cores() -> None:
    cores = os.cpu_count() or 1
    assert worker_threads(None, 1) == cores
    assert worker_threads(64, 1) == cores
    assert worker_threads(1, 1) == 1
    assert worker_threads(None, cores * 2) == 1




def test_large_entries_are_stored_and_everything_else_kept(tmp_path) -> None:
    """The weights of an archive are stored, not deflated (`compress serve` unpacks the
    archive at every start): same names, order, contents and modes; smaller entries stay
    deflated; a second pass has nothing to do and nothing is left beside the archive."""
    import zipfile

    from compress.serving.archive import store_large_entries

    mar = tmp_path / "m.mar"
    weights = bytes(range(256)) * 64  # 16 KiB that deflate shrinks
    with zipfile.ZipFile(mar, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("MAR-INF/MANIFEST.json", '{"model": {}}')
        archive.writestr("serve/", b"")
        archive.writestr("model.pt", weights)
        info = zipfile.ZipInfo("handler.py", (2026, 12, 1, 12, 0, 0))
        info.external_attr = 0o100640 << 16
        archive.writestr(info, "class H: pass\n", zipfile.ZIP_DEFLATED)
    before = zipfile.ZipFile(mar).infolist()
    assert store_large_entries(mar, threshold=8 << 10) == 1
    with zipfile.ZipFile(mar) as archive:
        after = archive.infolist()
        assert [e.filename for e in after] == [e.filename for e in before]
        kinds = {e.filename: e.compress_type for e in after}
        assert kinds["model.pt"] == zipfile.ZIP_STORED
        assert kinds["handler.py"] == kinds["MAR-INF/MANIFEST.json"] == zipfile.ZIP_DEFLATED
        assert archive.read("model.pt") == weights
        assert archive.read("handler.py") == b"class H: pass\n"
        assert archive.getinfo("handler.py").external_attr == 0o100640 << 16
        assert archive.getinfo("serve/").is_dir()
        assert archive.testzip() is None
    assert store_large_entries(mar, threshold=8 << 10) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.mar"]
