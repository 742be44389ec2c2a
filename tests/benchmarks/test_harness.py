"""benchmarks/harness/: one way to make a peer's environment (the steps, the pins, the
marker, a half-made one), one exit ladder, the rounds' order, the served tables' Markdown
(no environment is built, nothing is timed)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.harness import cli, servers
from benchmarks.harness import venv as venvs
from benchmarks.harness.rounds import alternating
from benchmarks.harness.venv import PeerError, Venv, ensure_venv
from compress.errors import UserError

PLAIN = Venv("plain", "~/nowhere", ".ready", (("torch==2.13.0",), ("peer==1.0", "other")),
             facts=("peer",))
HELD = Venv("held", "~/nowhere", ".ready", (("torch==2.13.0",), ("peer==1.0",)), hold=True,
            remove=("torchvision",), reuse=True, settings=("CMAKE_ARGS=-DX=ON",))


@pytest.fixture
def calls(monkeypatch) -> list[list[str]]:
    """Every command `ensure_venv` runs, none of them run: `python -m venv` makes the
    folder (and its pyvenv.cfg), a version query answers 1.0."""
    seen: list[list[str]] = []

    def call(command: list[str], what: str, log: Path | None = None) -> str:
        seen.append(command)
        if command[1:3] == ["-m", "venv"]:
            Path(command[3]).mkdir(parents=True)
            (Path(command[3]) / "pyvenv.cfg").write_text("")
        return "1.0\n" if what.endswith(" version") else ""

    monkeypatch.setattr(venvs, "call", call)
    return seen


def test_an_environment_is_made_once_then_read_from_its_marker(tmp_path, calls) -> None:
    said: list[str] = []
    folder = tmp_path / "plain"
    assert ensure_venv(PLAIN, said.append, folder) == {"peer": "1.0"}
    pips = [c for c in calls if c[0].endswith("/pip")]
    assert [c[2:] for c in pips] == [["torch==2.13.0"], ["peer==1.0", "other"]]  # torch first
    assert json.loads((folder / ".ready").read_text()) == {"peer": "1.0"}
    assert "making the plain environment" in said[0] and "pip's output in" in said[0]
    calls.clear()
    assert ensure_venv(PLAIN, said.append, folder) == {"peer": "1.0"} and calls == []


def test_pins_held_settings_and_wheels_removed(tmp_path, calls) -> None:
    folder = tmp_path / "held"
    facts = ensure_venv(HELD, print, folder, facts=lambda f: {"built": str(f)})
    assert facts == {"built": str(folder)}
    pip = ["env", "CMAKE_ARGS=-DX=ON", str(folder / "bin" / "pip"), "install"]
    assert calls[1] == [*pip, "torch==2.13.0"]
    assert calls[2] == [*pip, "-c", str(folder / "constraints.txt"), "peer==1.0"]
    assert calls[3] == [str(folder / "bin" / "pip"), "uninstall", "-y", "torchvision"]
    assert (folder / "constraints.txt").read_text() == "torch==2.13.0\n"


def test_a_half_made_environment_is_made_again_or_installed_into(tmp_path, calls) -> None:
    for spec, made_again in ((PLAIN, True), (HELD, False)):
        folder = tmp_path / spec.name
        folder.mkdir()
        (folder / "pyvenv.cfg").write_text("")
        (folder / "kept").write_text("")
        said: list[str] = []
        calls.clear()
        ensure_venv(spec, said.append, folder, facts=lambda f: {})
        assert any(c[1:3] == ["-m", "venv"] for c in calls) == made_again
        assert (folder / "kept").exists() != made_again
        assert ("half-made" in " ".join(said)) == made_again


def test_a_pinned_environment_is_made_again_when_its_list_changes(tmp_path, calls) -> None:
    pinned = Venv("pinned", "~/nowhere", ".ready", (("a==1",),), pinned=True)
    folder = tmp_path / "pinned"
    assert ensure_venv(pinned, print, folder, facts=lambda f: {"v": 1}) == {
        "v": 1, "install": ["a==1"]}
    calls.clear()
    assert ensure_venv(pinned, print, folder, facts=lambda f: {"v": 2})["v"] == 1
    newer = Venv("pinned", "~/nowhere", ".ready", (("a==2",),), pinned=True)
    assert ensure_venv(newer, print, folder, facts=lambda f: {"v": 2}) == {
        "v": 2, "install": ["a==2"]}
    assert any(c[1:3] == ["-m", "venv"] for c in calls)


def test_a_folder_that_is_no_environment_is_refused(tmp_path) -> None:
    (tmp_path / "plain").mkdir()
    named = Venv("x", "~/nowhere", ".ready", (), variable="PEER_X_VENV")
    with pytest.raises(PeerError, match="not a virtual environment; remove it or set "
                                        "PEER_X_VENV to another folder"):
        ensure_venv(named, print, tmp_path / "plain")
    with pytest.raises(PeerError, match="not a virtual environment; remove it$"):
        ensure_venv(PLAIN, print, tmp_path / "plain")


def test_a_failed_command_is_one_line_naming_its_log(tmp_path) -> None:
    log = tmp_path / "x.log"
    with pytest.raises(PeerError) as failed:
        venvs.call(["sh", "-c", "echo fine; echo 'ERROR: no wheel' >&2; exit 3"], "pip x", log)
    assert str(failed.value) == (f"pip x failed with exit code 3: ERROR: no wheel (full output "
                                 f"in {log})")
    with pytest.raises(PeerError, match="cannot start /nowhere/python"):
        venvs.call(["/nowhere/python"], "python")


def test_the_exit_ladder(capsys) -> None:
    def fails(exc: BaseException):
        def body() -> int:
            raise exc
        return body

    assert cli.exit_code(lambda: 0) == 0
    assert cli.exit_code(fails(UserError(["one", "two"]))) == 2
    assert capsys.readouterr().err == "error: one\nerror: two\n"
    assert cli.exit_code(fails(ValueError("bad\nmore")), user=(ValueError,)) == 2
    assert capsys.readouterr().err == "error: ValueError: bad\n"
    assert cli.exit_code(fails(PeerError("no wheel")), peer="llama.cpp peer: ") == 1
    assert capsys.readouterr().err == "error: llama.cpp peer: no wheel\n"
    assert cli.exit_code(fails(RuntimeError("boom"))) == 1
    assert capsys.readouterr().err == "error: RuntimeError: boom\n"
    assert cli.exit_code(fails(KeyboardInterrupt())) == 130


def test_options_quick_defaults_and_numbers(capsys) -> None:
    parser = cli.Parser()
    args = argparse.Namespace(rounds=None, requests=5)
    cli.fill(args, {"rounds": 1, "requests": 8})
    assert (args.rounds, args.requests) == (1, 5)
    assert cli.numbers(parser, "--concurrency", "1, 8,", "1,8") == [1, 8]
    with pytest.raises(SystemExit) as done:
        cli.numbers(parser, "--concurrency", "1,x", "1,8")
    assert done.value.code == 2
    assert capsys.readouterr().err == "error: --concurrency '1,x': expected numbers like 1,8\n"


def test_rounds_alternate_the_order() -> None:
    assert list(alternating(["a", "b", "c"], 3)) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"), (2, "a"), (2, "b"),
        (2, "c")]


def test_served_tables_share_their_markdown() -> None:
    rows = [{"name": "a", "x": 1.5, "y": None}]
    header = {"title": "T", "date": "d", "cpu": {"cpu": "C", "cores": 2, "flags": "avx2"},
              "command": "python -m x", "facts": {"k": "v"}, "notes": ["n"]}
    text = servers.markdown(rows, (("name", "name"), ("x", "x"), ("y", "y")), 1, ["r"], header)
    assert "| name | x | y |\n|---|---:|---:|\n| a | 1.5 | - |" in text
    assert text.endswith("Ratios:\n\n- r\n\nNotes:\n\n- n\n")
    assert text.splitlines()[2] == "- command: `python -m x`" and "- flags: avx2" in text
    section = servers.markdown(rows, (("name", "name"),), 1, [], {**header, "section": True})
    assert "- command:" not in section and "- k: v" in section
    assert servers.median([None, 3.0, 1.0]) == 2.0 and servers.shown(None) == "n/a"
