"""MTEB scores of an embedding run, every way compress gives them: each stage's (a recipe run
with `evaluation.mteb`), its archive's export folder scored offline (`compress mteb FOLDER`),
and the same archive served by each engine (`compress mteb URL`), with the largest
difference between a served score and the folder's.

    python -m benchmarks.embedding.mteb_agreement runs/embed_int8 --markdown out.md

The folder is the export the run's last package stage packed (its `artifact`); each engine
serves the run folder on `--port` (`compress serve RUN --engine E`) and is stopped after.
COMPRESS_DATA_DIR points at the SST-2 mirror (the local tasks' data).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness.cli import exit_code
from benchmarks.harness.provenance import header_text, shown
from benchmarks.harness.runs import check_finished
from compress.errors import UserError

ENGINES = ("torchserve", "litserve")
TASKS = ("SST2LocalClassification", "SST2KnownItemRetrieval")
PREFIX = "mteb_"


def stage_scores(run_dir: Path) -> tuple[list[tuple[str, dict[str, float]]], Path]:
    """Each measured model's MTEB scores (baseline first; stages without them left out) and
    the export folder the last package stage packed."""
    check_finished(run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    rows = [("baseline", manifest.get("baseline", {}).get("metrics") or {})]
    rows += [(stage.get("name") or stage["kind"], stage.get("metrics") or {})
             for stage in manifest["stages"]]
    scored = [(name, {k: v for k, v in m.items() if k.startswith(PREFIX)}) for name, m in rows]
    def first_output(stage: dict[str, Any]) -> dict[str, Any]:
        return (stage.get("outputs") or [{}])[0]

    archives = [s for s in manifest["stages"] if first_output(s).get("path", "").endswith(".mar")]
    if not archives:
        raise UserError(f"{run_dir}: no package stage (nothing to serve)")
    artifact = (archives[-1].get("config") or {}).get("artifact")
    exports = {s.get("name"): s for s in manifest["stages"] if first_output(s).get("export_dir")}
    if artifact not in exports:
        raise UserError(f"{run_dir}: the package stage packs {artifact!r}, which is no export "
                        "stage of this run")
    folder = run_dir / exports[artifact]["outputs"][0]["export_dir"]
    return [(name, m) for name, m in scored if m], folder


def served_scores(run_dir: Path, engine: str, port: int, tasks: list[str],
                  limit: int | None) -> dict[str, float]:
    """The scores through `engine` serving the run folder (started here, stopped after)."""
    from compress.families.embedding.evaluation_harness import EndpointEmbedder, task_scores
    from compress.serving.serve_folder import token_of

    compress = [sys.executable, "-m", "compress", "serve"]
    subprocess.run(compress + [str(run_dir), "--engine", engine, "--port", str(port)],
                   check=True, stdout=subprocess.DEVNULL)
    try:
        name = json.loads((run_dir / "serve" / "server.json").read_text())["model_name"]
        url = f"http://127.0.0.1:{port}/predictions/{name}/1.0/v1"
        return task_scores(EndpointEmbedder(url, token_of(run_dir)), tasks, limit)
    finally:
        subprocess.run(compress + ["--stop", str(run_dir)], stdout=subprocess.DEVNULL)


def table(rows: list[tuple[str, dict[str, float]]], tasks: list[str]) -> list[str]:
    keys = sorted({k for _, m in rows for k in m if k.startswith(PREFIX)},
                  key=lambda k: next((i for i, t in enumerate(tasks) if t in k), len(tasks)))
    lines = ["| model | " + " | ".join(k.removeprefix(PREFIX) for k in keys) + " |",
             "|---|" + "---:|" * len(keys)]
    lines += [f"| {name} | " + " | ".join(f"{m[k]:.6f}" if k in m else "-" for k in keys)
              + " |" for name, m in rows]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a finished embedding run with a package stage")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated MTEB tasks")
    parser.add_argument("--limit", type=int, help="local tasks: the first N sentences")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--port", type=int, default=8093)
    parser.add_argument("--markdown", type=Path, help="also write the report here")
    args = parser.parse_args(argv)

    def body() -> int:
        from compress.families.embedding.evaluation_harness import ExportEmbedder, task_scores

        tasks = [t for t in args.tasks.split(",") if t]
        stages, folder = stage_scores(args.run)
        offline = task_scores(ExportEmbedder(folder), tasks, args.limit)
        served = [(f"served by {engine} (`compress mteb URL`)",
                   served_scores(args.run, engine, args.port, tasks, args.limit))
                  for engine in args.engines.split(",") if engine]
        widest = max((abs(m[k] - offline[k]) for _, m in served for k in offline), default=0)
        lines = [header_text("benchmarks.embedding.mteb_agreement", argv or sys.argv[1:]), "",
                 f"Run `{shown(args.run)}`; tasks {', '.join(tasks)}"
                 f"{f', limit {args.limit}' if args.limit else ' (every validation sentence)'}."
                 " Stage rows: the recipe's `evaluation.mteb` (each stage's model as it left "
                 "the stage); the folder and served rows: the archive's export "
                 f"`{shown(folder)}`.", ""]
        lines += table(stages + [("export folder (`compress mteb FOLDER`)", offline)] + served,
                       tasks)
        lines += ["", f"Largest |served - folder| over every score: {widest:.6f}"]
        text = "\n".join(lines) + "\n"
        print(text)
        if args.markdown:
            args.markdown.write_text(text)
        return 0

    return exit_code(body)


if __name__ == "__main__":
    sys.exit(main())
