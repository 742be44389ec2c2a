"""recipes/llm_fsdp.yaml (SmolLM2-135M, FSDP on 2 processes) killed mid-way and resumed from
its sharded checkpoint, against an uninterrupted run, in one invocation:

- restart: `--nproc 2 --max-restarts 1`, rank 1 SIGKILLed after the step-25 checkpoint;
  torchrun restarts both ranks and the stage resumes by itself;
- 2 -> 1: the 2-process job killed after the step-25 checkpoint, then run again with one
  process, which reshards the checkpoint (torch.distributed.checkpoint) and goes on.

    COMPRESS_DATA_DIR=../shared/data python -m benchmarks.training.fsdp_resume --out /tmp/fsdp
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness.paths import REPO
from benchmarks.harness.provenance import header_text
from compress.distributed.launch import kill_rank

RECIPE = REPO / "recipes/llm_fsdp.yaml"
CHECKPOINT = "00-finetune/checkpoints/sharded/meta.json"


def compress(log: Path, *args: str) -> subprocess.Popen:
    """`compress run RECIPE ARGS` in its own process group, its stderr into `log` (a pipe
    nobody reads while the run goes on could fill and stall it)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        return subprocess.Popen([sys.executable, "-m", "compress", "run", str(RECIPE), *args],
                                stderr=handle, text=True, cwd=REPO, start_new_session=True)


def kill_after_checkpoint(process: subprocess.Popen, run: Path, rank: int | None) -> int:
    """SIGKILL rank `rank` (or the whole job when None) once the run has a checkpoint; the
    step of that checkpoint."""
    meta = run / CHECKPOINT
    while not meta.is_file():
        if process.poll() is not None:
            raise SystemExit(f"the run ended before its first checkpoint: see {run.parent}.log")
        time.sleep(0.2)
    step = json.loads(meta.read_text())["step"]
    if rank is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        while _alive(process.pid):  # the ranks hold the run folder's lock until they are gone
            time.sleep(0.2)
        return step
    kill_rank(str(run.parent), rank)
    return step


def _alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def finish(process: subprocess.Popen, log: Path, label: str) -> str:
    process.wait()
    err = log.read_text()
    if process.returncode:
        raise SystemExit(f"{label} failed ({process.returncode}):\n{err[-3000:]}")
    return err


def metrics(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())["stages"][0]["metrics"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    runs = {name: args.out / name for name in ("whole", "restart", "resize")}
    logs = {name: args.out / f"{name}.log" for name in runs}
    began = time.perf_counter()
    finish(compress(logs["whole"], "--nproc", "2", f"output_dir={runs['whole']}"),
           logs["whole"], "the uninterrupted run")
    print(f"uninterrupted: {time.perf_counter() - began:.0f} s", flush=True)

    began = time.perf_counter()
    job = compress(logs["restart"], "--nproc", "2", "--max-restarts", "1",
                   f"output_dir={runs['restart']}")
    killed_at = kill_after_checkpoint(job, runs["restart"] / "llm_fsdp", rank=1)
    log = finish(job, logs["restart"], "the restarted run")
    print(f"restart: rank 1 killed after the step-{killed_at} checkpoint; "
          f"{'restart 1: resuming the run' in log and 'torchrun restarted it' or 'no restart'}; "
          f"{time.perf_counter() - began:.0f} s", flush=True)

    job = compress(logs["resize"], "--nproc", "2", f"output_dir={runs['resize']}")
    resized_at = kill_after_checkpoint(job, runs["resize"] / "llm_fsdp", rank=None)
    resumed = args.out / "resize-1-process.log"
    log = finish(compress(resumed, f"output_dir={runs['resize']}"), resumed,
                 "the 1-process resume")
    said = [line for line in log.splitlines() if "resumes on" in line or "resuming" in line]
    print(f"2 -> 1: job killed after the step-{resized_at} checkpoint; {said[:1]}", flush=True)

    print("\n" + header_text("benchmarks.training.fsdp_resume", argv))
    print(f"{'run':<10}{'processes':>10}{'resumed at':>11}{'final loss':>12}{'perplexity':>12}"
          f"  param digest")
    for name, run in runs.items():
        m = metrics(run / "llm_fsdp")
        print(f"{name:<10}{m['train_processes']:>10}{m['resumed_from_step']:>11}"
              f"{m['train_loss']:>12.6f}{m['perplexity']:>12.4f}  {m.get('param_digest', '-')}")


if __name__ == "__main__":
    main()
