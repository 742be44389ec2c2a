"""Compare two run folders of the same recipe: the same manifest keys, and the same quality
figures (accuracy, macro-F1, perplexity, agreement, parity), stage by stage.

Timings are left out: they move between runs. Use it to show that a change to compress's
code left its results alone:

    python -m benchmarks.headline.compare_runs runs_before/bert_int8 runs_after/bert_int8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

QUALITY = ("accuracy", "macro_f1", "perplexity", "agreement", "next_token_agreement",
           "parity_argmax_agreement", "parity_max_abs_diff", "params", "sparsity")


def keys(value: object, prefix: str = "") -> set[str]:
    """Every key path of a JSON value (list items by position)."""
    if isinstance(value, dict):
        return {f"{prefix}{k}" for k in value} | {
            path for k, v in value.items() for path in keys(v, f"{prefix}{k}.")}
    if isinstance(value, list):
        return {path for i, v in enumerate(value) for path in keys(v, f"{prefix}{i}.")}
    return set()


def figures(manifest: dict) -> dict[str, dict[str, object]]:
    """Quality figures of the baseline and each stage."""
    rows = {"baseline": manifest.get("baseline", {}).get("metrics", {})}
    rows.update({f"{s['index']}-{s['name']}": s.get("metrics", {})
                 for s in manifest.get("stages", [])})
    return {row: {k: v for k, v in metrics.items() if k in QUALITY}
            for row, metrics in rows.items()}


def compare(before: Path, after: Path, tolerance: float) -> list[str]:
    """One line per difference (empty when the two runs agree)."""
    a = json.loads((before / "manifest.json").read_text())
    b = json.loads((after / "manifest.json").read_text())
    ignored = ("created", "updated", "environment", "started", "finished")
    key_a = {k for k in keys(a) if not any(part in ignored for part in k.split("."))}
    key_b = {k for k in keys(b) if not any(part in ignored for part in k.split("."))}
    problems = [f"key only in {before}: {k}" for k in sorted(key_a - key_b)]
    problems += [f"key only in {after}: {k}" for k in sorted(key_b - key_a)]
    fig_a, fig_b = figures(a), figures(b)
    for row in fig_a:
        for name, value in fig_a[row].items():
            other = fig_b.get(row, {}).get(name)
            same = (abs(float(value) - float(other)) <= tolerance
                    if isinstance(value, int | float) and isinstance(other, int | float)
                    else value == other)
            if not same:
                problems.append(f"{row} {name}: {value} before, {other} after")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--tolerance", type=float, default=0.0,
                        help="largest absolute difference accepted in a figure (default 0)")
    args = parser.parse_args(argv)
    problems = compare(args.before, args.after, args.tolerance)
    rows = figures(json.loads((args.after / "manifest.json").read_text()))
    for row, values in rows.items():
        print(f"{row}: " + ", ".join(f"{k} {v}" for k, v in values.items()))
    print("\n".join(problems) if problems else
          f"same keys and same figures: {args.before} and {args.after}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
