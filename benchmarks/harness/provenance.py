"""Where and how a results file was made: the header every results file a harness writes
begins with (standard library only).

`results_header` gathers the facts (the command as a user reruns it, the date in UTC, the
CPU's vendor, family, model, stepping and the microarchitecture named from them, its SIMD
flags and cores, the package versions of every side measured, the GEMM peaks where the
harness measured them in the same invocation); `header_lines` writes them as the Markdown
lines under the file's title, and the JSON beside it keeps the dict. `shown` is how a path
appears in a results file: relative to the working folder where it lies under it, else by
its name, never absolute (a results file is read on other machines)."""

from __future__ import annotations

import os
import re
import shlex
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.harness.machine import cpu_facts

# compress's own side: the packages whose versions every header names (those installed)
OURS = ("torch", "torchao", "transformers", "onnxruntime")
OWN_SIDE = "compress"

# the GEMM peaks' keys (gemm.peaks, cpu_peak.peaks) as a header says them
PEAKS = {"fp32_gflops": ("fp32", "GFLOP/s"), "bf16_gflops": ("bf16", "GFLOP/s"),
         "int8_gops": ("int8 (the better kernel)", "GOP/s"),
         "int8_torch_gops": ("int8 torch._int_mm", "GOP/s"),
         "int8_ort_gops": ("int8 ONNX Runtime MatMulInteger", "GOP/s"),
         "fp32": ("fp32 FMA", "GFLOP/s"), "bf16": ("vdpbf16ps", "GFLOP/s")}


def shown(path: str | os.PathLike[str], cwd: Path | None = None) -> str:
    """`path` as a results file shows it: as given where it is relative; from its package
    on where it lies in an environment's site-packages; else relative to `cwd` (default:
    the working folder) where it lies under it; else `~/...` under the home folder; else
    its name alone."""
    text = os.fspath(path)
    if not os.path.isabs(text):
        return text
    full = Path(os.path.normpath(text))
    if "site-packages" in full.parts[:-1]:
        return str(Path(*full.parts[full.parts.index("site-packages") + 1:]))
    for base in ((cwd or Path.cwd()).resolve(), (cwd or Path.cwd())):
        if full == base or base in full.parents:
            return str(full.relative_to(base)) or "."
    home = Path.home()
    if home != Path("/") and home in full.parents:
        return f"~/{full.relative_to(home)}"
    return full.name or text


# an absolute path of at least two parts inside a text: at its start or after a space,
# a bracket, a quote or "="
ABSOLUTE = re.compile(r"""(?:(?<=^)|(?<=[\s(\[`'"=]))/[\w.+@-]+/[^\s)\]`'",;|]*""")


def scrubbed(value: Any, cwd: Path | None = None) -> Any:
    """`value` (a text, or a JSON-able dict or list of them) with every absolute path in
    its texts `shown`: what a harness writes to a results file."""
    if isinstance(value, str):
        return ABSOLUTE.sub(lambda m: shown(m.group(0), cwd), value)
    if isinstance(value, dict):
        return {k: scrubbed(v, cwd) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrubbed(v, cwd) for v in value]
    return value


def _argument(arg: str, cwd: Path | None) -> str:
    """One command-line argument with any absolute path in it shown (`--out=/x/y` too)."""
    option, equals, value = arg.partition("=")
    if equals and option.startswith("-") and os.path.isabs(value):
        return f"{option}={shown(value, cwd)}"
    return shown(arg, cwd) if os.path.isabs(arg) else arg


def command(module: str, argv: list[str] | None = None, cwd: Path | None = None) -> str:
    """The command a user reruns: `python -m <module>` and its arguments (default: this
    process's), each absolute path shown relative to `cwd` or by name."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", "-m", module, *(_argument(str(a), cwd) for a in args)])


def versions_of(packages: tuple[str, ...] | list[str] = OURS) -> dict[str, str]:
    """The installed versions of `packages` in this process's environment (those not
    installed left out)."""
    found: dict[str, str] = {}
    for name in packages:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def results_header(module: str, argv: list[str] | None = None, *,
                   peers: dict[str, dict[str, Any]] | None = None,
                   ours: tuple[str, ...] | list[str] | None = OURS,
                   peaks: dict[str, Any] | None = None,
                   cwd: Path | None = None) -> dict[str, Any]:
    """The facts a results file begins with: `command` (`python -m <module>` and `argv`,
    default this process's arguments), `date` (UTC), `cpu` (model name, vendor / family /
    model / stepping, microarchitecture, SIMD flags, cores), `versions` (a side each:
    compress's packages `ours` read here, None for none, then each peer's as its own
    environment reports them, `peers`), and `gemm`, the peaks measured in this invocation
    (None where the harness does not measure them)."""
    versions: dict[str, dict[str, Any]] = {}
    if ours:
        versions[OWN_SIDE] = versions_of(ours)
    for side, facts in (peers or {}).items():
        versions[side] = {k: v for k, v in (facts or {}).items() if isinstance(v, str)}
    return {"command": command(module, argv, cwd),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "cpu": {**cpu_facts(), "cores": os.cpu_count()},
            "versions": versions,
            "gemm": dict(peaks) if peaks else None}


def _peaks_said(peaks: dict[str, Any]) -> str:
    said = []
    for key, value in peaks.items():
        name, unit = PEAKS.get(key, (key, ""))
        figure = "-" if value is None else f"{value:.1f}" if isinstance(value, float) else value
        said.append(f"{name} {figure} {unit}".rstrip())
    return ", ".join(said)


def header_lines(header: dict[str, Any]) -> list[str]:
    """`results_header`'s facts as the Markdown lines under a results file's title."""
    cpu = header.get("cpu") or {}
    versions = header.get("versions") or {}
    lines = [
        f"- command: `{header.get('command', '?')}`",
        f"- date: {header.get('date', '?')} (UTC)",
        f"- CPU: {cpu.get('cpu', 'unknown')}; microarchitecture "
        f"{cpu.get('microarchitecture', 'unknown')} ({cpu.get('family', 'unknown')}); "
        f"{cpu.get('cores', '?')} cores",
        f"- flags: {cpu.get('flags', 'unknown')}",
        "- versions: " + ("; ".join(
            f"{side}: " + (", ".join(f"{k} {v}" for k, v in facts.items()) or "none found")
            for side, facts in versions.items()) or "none recorded"),
    ]
    if header.get("gemm"):
        lines.append("- GEMM peaks on all cores, this invocation: " + _peaks_said(header["gemm"]))
    return lines


def header_text(module: str, argv: list[str] | None = None, **facts: Any) -> str:
    """The results header as lines of text, for a harness that prints its report (which
    the user keeps as the results file): `results_header`'s arguments."""
    return "\n".join(header_lines(results_header(module, argv, **facts)))
