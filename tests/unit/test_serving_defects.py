"""Issue 31: serving's security and robustness defects, each checked in this process (no
TorchServe started): private tokens, bounded stop strings and texts, bad requests that
fail alone, stale server records, an inherited TS_CONFIG_FILE, changed archives, unsafe
model names and durable writes."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

from compress.errors import UserError
from compress.runfolder import files
from compress.runfolder.records import Manifest, StageRecord, artifact_record, write_manifest
from compress.serving import serve_folder, server
from compress.serving.torchserve import launch as torchserve_launch
from serve.causal_lm.server import requests as causal_lm_requests


def cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `compress ARGS` in this process (0 when it returns)."""
    from compress.cli.main import main

    monkeypatch.setattr(sys, "argv", ["compress", *args])
    try:
        main()
        code = 0
    except SystemExit as done:
        code = done.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def _mar(path: Path, name: str = "tiny") -> Path:
    """A minimal TorchServe archive named `name` (no model inside)."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": {"modelName": name}}))
        archive.writestr("model-config.yaml", "minWorkers: 1\nmaxWorkers: 1\nbatchSize: 1\n")
    return path


def _packaged_run(run_dir: Path, name: str = "tiny") -> Path:
    """A run folder whose manifest records a finished package stage and its .mar."""
    (run_dir / "01-package").mkdir(parents=True)
    mar = _mar(run_dir / "01-package" / f"{name}.mar", name)
    record = artifact_record(mar, run_dir, "mar", model_name=name)
    stage = StageRecord(index=1, name="package", kind="package", status="done",
                        outputs=[record])
    write_manifest(run_dir, Manifest(name="run", stages=[stage]))
    return mar


# 1. the inference token lives in files of mode 0600 only, and is never printed

def test_server_json_is_private(tmp_path: Path) -> None:
    serve_folder.write_info(tmp_path, {"token": "secret"})
    assert stat.S_IMODE((tmp_path / serve_folder.SERVER_INFO).stat().st_mode) == 0o600


def test_serve_prints_where_the_token_is_not_the_token(tmp_path, monkeypatch, capsys) -> None:
    mar = _mar(tmp_path / "tiny.mar")
    info = {"model_name": "tiny", "url": "http://127.0.0.1:8080/predictions/tiny",
            "serve_dir": str(tmp_path / "tiny.serve"), "token": "s3cr3t-token",
            "settings": {"maxWorkers": 1, "threads_per_worker": 1, "batchSize": 1,
                         "maxBatchDelay": 0, "task": "classification"}}
    monkeypatch.setattr(server, "start", lambda *a, **k: info)
    code, out, _ = cli(monkeypatch, capsys, "serve", str(mar))
    assert code == 0
    assert "s3cr3t-token" not in out
    assert str(tmp_path / "tiny.serve" / "server.json") in out and "$TOKEN" in out


# 2. stop strings: bounded length, and a per-token check that does not grow with the text

def test_a_long_stop_string_is_a_400() -> None:
    with pytest.raises(ValueError, match="at most 64 characters"):
        causal_lm_requests.parse({"prompt": "hi", "stop": ["x" * 65]}, lambda p: [1],
                                 causal_lm_requests.Limits())


class _Growing:
    """A tokenizer of two tokens, 0 "a" and 1 "b"."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("ab"[i] for i in ids)


def test_the_stop_check_per_token_does_not_grow_with_the_text() -> None:
    stops = [("ab" * 32)[:63] + str(i) for i in range(8)]  # 8 stops of 64 characters
    stream = causal_lm_requests.TextStream(_Growing(), stops)
    began = time.perf_counter()
    sent = "".join(stream.add(k % 2) for k in range(8000))
    assert time.perf_counter() - began < 0.5  # 0.04 s; 1.2 s when every token checked it all
    assert sent == stream.text[:len(sent)] and len(stream.text) - len(sent) == 62


class _Pieces:
    """A tokenizer of fixed pieces: token i decodes to pieces[i]."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


def test_a_stop_string_split_over_tokens_is_held_back_then_cut_or_released() -> None:
    stream = causal_lm_requests.TextStream(_Pieces(["the ", "EN", "D", "ENx", "\ufffd", "é"]),
                                           ["END", "xyz"])
    assert [stream.add(t) for t in (0, 1)] == ["the ", ""]
    assert stream.add(2) == "" and stream.stopped and stream.text == "the "
    stream = causal_lm_requests.TextStream(_Pieces(["the ", "EN", "D", "ENx", "\ufffd", "é"]),
                                           ["END", "xyz"])
    # "x" waits while half a character follows it (it could have begun "x" + that one)
    assert [stream.add(t) for t in (0, 3, 4, 5)] == ["the ", "EN", "", "x\ufffdé"]
    assert not stream.stopped


# 3. the classifier handler bounds how many texts one request sends

def test_too_many_texts_in_one_request_is_a_400() -> None:
    pytest.importorskip("ts")
    from serve.classifier.handler import CompressHandler

    handler = CompressHandler()
    handler.text, handler.max_chars = True, 100
    assert handler.parse_text({"texts": ["good"] * 64}) == (["good"] * 64, True)
    with pytest.raises(ValueError, match="too many texts: 65, at most 64"):
        handler.parse_text({"texts": ["good"] * 65})


# 4. every bad LM request is a ValueError (a 400 for it alone), never another error

def test_deeply_nested_json_is_a_400() -> None:
    with pytest.raises(ValueError, match="nested too deeply"):
        causal_lm_requests.read_body({"body": b"[" * 100_000 + b"]" * 100_000})


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt": "hi", "seed": 2**64}, "seed: an integer from 0 to"),
    ({"prompt": "hi", "temperature": 1e-40}, "temperature: 0 (greedy) or from 0.001"),
])
def test_seeds_and_temperatures_torch_cannot_use_are_a_400(body, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        causal_lm_requests.parse(body, lambda p: [1], causal_lm_requests.Limits())
    assert causal_lm_requests.parse({"prompt": "hi", "seed": 2**64 - 1, "temperature": 0.001},
                                    lambda p: [1], causal_lm_requests.Limits()).seed == 2**64 - 1


def test_an_error_of_the_chat_template_is_a_400() -> None:
    def encode(prompt):
        raise RuntimeError("Conversation roles must alternate user/assistant")

    body = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    with pytest.raises(ValueError, match="could not be encoded: Conversation roles must"):
        causal_lm_requests.parse(body, encode, causal_lm_requests.Limits())


# 5. --stop signals only the TorchServe it started

def _sleeper(*marker: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *marker],
                            start_new_session=True)


def _record(serve_dir: Path, proc: subprocess.Popen, **extra) -> None:
    serve_dir.mkdir(parents=True, exist_ok=True)
    serve_folder.write_info(serve_dir, {"pid": proc.pid, "pgid": proc.pid,
                                        "serve_dir": str(serve_dir), **extra})


def test_stop_leaves_another_process_alone(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("COMPRESS_STATE_DIR", str(tmp_path / "state"))
    other = _sleeper()  # a stale record: its pid now belongs to another program
    try:
        _record(tmp_path / "run" / "serve", other)
        code, out, _ = cli(monkeypatch, capsys, "serve", "--stop", str(tmp_path / "run"))
        time.sleep(0.2)
        assert other.poll() is None, "--stop killed a process it did not start"
        assert code == 0 and "stale" in out
        assert not (tmp_path / "run" / "serve" / serve_folder.SERVER_INFO).exists()
    finally:
        other.kill()
        other.wait()


def test_stop_checks_the_recorded_start_time_and_boot(tmp_path: Path, monkeypatch) -> None:
    from compress.serving import server_process

    monkeypatch.setenv("COMPRESS_STATE_DIR", str(tmp_path / "state"))
    ours = _sleeper(server_process.MARKERS[0], "-f", str(tmp_path / "serve/config.properties"))
    try:
        identity = server_process.identity(ours.pid)
        for wrong in ({"pid_start": identity["pid_start"] + 1},
                      {"boot_id": "another-boot"}):
            _record(tmp_path / "serve", ours, **{**identity, **wrong})
            assert server.stop(tmp_path / "serve") is False
            assert ours.poll() is None and not server.read_info(tmp_path / "serve")
        _record(tmp_path / "serve", ours, **identity)
        assert server.stop(tmp_path / "serve", grace_s=5) is True
        assert ours.wait(timeout=5) is not None
    finally:
        ours.kill()
        ours.wait()


def test_stop_removes_what_the_workers_unpacked(tmp_path: Path, monkeypatch) -> None:
    from compress.serving import server_process

    monkeypatch.setenv("COMPRESS_STATE_DIR", str(tmp_path / "state"))
    serve_dir = tmp_path / "serve"
    ours = _sleeper(server_process.MARKERS[1], str(serve_dir))
    try:
        temp = serve_folder.server_temp()
        _record(serve_dir, ours, temp_dir=str(temp), **server_process.identity(ours.pid))
        unpacked = temp / "aotinductor_x1Yz" / "model.so"
        unpacked.parent.mkdir()
        unpacked.write_bytes(b"\0" * 1024)  # what a killed worker's AOTI loader leaves
        (serve_dir / "logs").mkdir()
        (serve_dir / "logs" / "litserve.out").write_text("kept")
        assert server.stop(serve_dir, grace_s=5) is True
        assert not temp.exists()
        assert (serve_dir / "logs" / "litserve.out").read_text() == "kept"
        elsewhere = tmp_path / f"{serve_folder.TEMP_PREFIX}not-made-by-us"
        elsewhere.mkdir()  # a record naming another folder: it is not removed
        _record(serve_dir, ours, temp_dir=str(elsewhere), **server_process.identity(ours.pid))
        server.stop(serve_dir, grace_s=5)
        assert elsewhere.is_dir()
    finally:
        ours.kill()
        ours.wait()


# 6. compress's own TorchServe config wins; no auth with the model API is refused

def test_an_inherited_ts_config_file_is_overridden(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TS_CONFIG_FILE", str(tmp_path / "evil.properties"))
    monkeypatch.setattr(torchserve_launch, "check_installed", lambda: None)
    seen: dict = {}
    java = _sleeper()  # what TorchServe's launcher leaves running, in the launcher's group

    class Launcher:
        pid = java.pid

        def __init__(self, command, env, **kwargs) -> None:
            seen.update(env=env, command=command)

        def wait(self, timeout=None) -> int:
            return 0

    monkeypatch.setattr(torchserve_launch.subprocess, "Popen", Launcher)
    target = server.resolve_target(_mar(tmp_path / "tiny.mar"))
    (port,) = server.free_ports(1)
    with pytest.raises(UserError, match="TorchServe did not start"):
        server.start(target, port=port, echo=lambda _: None)
    assert seen["env"].get("TS_CONFIG_FILE") in (None, str(target.serve_dir /
                                                           "config.properties"))
    temp = Path(seen["env"]["TMPDIR"])  # short: LitServe's sockets are made there
    assert temp.parent == Path(tempfile.gettempdir()) and not temp.exists()
    assert seen["env"]["TEMP"] == str(temp)  # java.io.tmpdir: where the workers' sockets go
    assert java.wait(timeout=10) == -signal.SIGKILL  # a failed start leaves nothing running


def test_no_auth_with_the_model_api_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    def reached() -> None:
        raise UserError("prerequisites reached")

    monkeypatch.setattr(torchserve_launch, "check_installed", reached)
    code, _, err = cli(monkeypatch, capsys, "serve", str(_mar(tmp_path / "tiny.mar")),
                       "--no-auth", "--enable-model-api")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--no-auth" in err and "--enable-model-api" in err


# 7. the served archive is the one the run made; artifacts are on disk before the manifest

def test_a_changed_archive_is_refused(tmp_path: Path) -> None:
    mar = _packaged_run(tmp_path)
    assert server.resolve_target(tmp_path).mar == mar.resolve()
    with zipfile.ZipFile(mar, "a") as archive:
        archive.writestr("handler.py", "import os  # not what the run packaged\n")
    with pytest.raises(UserError, match="changed since the run packaged it") as error:
        server.resolve_target(tmp_path)
    assert "--from-stage 1" in str(error.value) and "\n" not in str(error.value)


def _fsynced(monkeypatch) -> list[os.stat_result]:
    synced: list[os.stat_result] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.fstat(fd))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def test_atomic_writes_fsync_the_file_and_its_folder(tmp_path: Path, monkeypatch) -> None:
    synced = _fsynced(monkeypatch)
    files.atomic_write_text(tmp_path / "a.json", "{}")
    assert any(stat.S_ISREG(s.st_mode) for s in synced)
    assert any(stat.S_ISDIR(s.st_mode) and s.st_ino == tmp_path.stat().st_ino for s in synced)


def test_an_artifact_is_fsynced_when_recorded(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.bin").write_bytes(b"weights")
    (tmp_path / "out" / "export.json").write_text("{}")
    synced = _fsynced(monkeypatch)
    artifact_record(tmp_path / "out" / "model.bin", tmp_path, "bin", export_dir="out")
    inodes = {s.st_ino for s in synced}
    assert {(tmp_path / "out" / n).stat().st_ino for n in ("model.bin", "export.json")} <= inodes
    assert (tmp_path / "out").stat().st_ino in inodes


# 8. a model name is a plain file name before it becomes a path

@pytest.mark.parametrize("name", ["../evil", "a/b", "..", ".", "", "name with space"])
def test_an_unsafe_model_name_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(UserError, match="model name") as error:
        server.resolve_target(_mar(tmp_path / "x.mar", name))
    assert "\n" not in str(error.value)


def test_a_reason_phrase_is_one_line_of_ascii() -> None:
    """TorchServe frames the phrase by characters and writes UTF-8 bytes: a non-ASCII phrase
    broke the worker's socket frame (found by fuzzing the served LM)."""
    from serve.http_answers import MAX_PHRASE, reason_phrase

    phrase = reason_phrase("unknown field 'é\u00ff'\nnext line" + "x" * 500)
    assert phrase.isascii() and len(phrase.encode()) == len(phrase) <= MAX_PHRASE
    assert "\n" not in phrase and phrase.startswith("unknown field '\\xe9\\xff' next line")


# 9. issue 39: a body is read alone (any failure a ValueError: a 400), answers strict JSON

def test_reading_a_body_raises_only_value_errors_and_answers_are_strict_json() -> None:
    from serve.http_answers import check_unicode, json_answer, load_json

    for body, message in (("[" * 100_000 + "]" * 100_000, "malformed JSON: nested too deeply"),
                          ("9" * 5000, "malformed JSON: Exceeds the limit"),
                          ('{"text": ', "malformed JSON: Expecting value")):
        with pytest.raises(ValueError, match=message):
            load_json(body)
    assert load_json(" \n") is None and load_json('"\\ud83d\\ude00"') == "\U0001f600"
    with pytest.raises(ValueError, match=r"lone surrogate \\ud800 at character 3"):
        check_unicode("ok " + load_json('"\\ud800"'))
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        json_answer({"probabilities": {"a": float("nan")}})
    assert json_answer({"score": 0.5}) == '{"score": 0.5}'
