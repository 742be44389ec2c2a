"""benchmarks/embedding/peers.py's and served.py's pure parts: the tables (spread,
ratios to sentence-transformers' ONNX int8 by median and by best, the int8 peak share; the
served rows and their ratios to infinity), row selection, which exports are embedding
exports, the CPU's quantize config, the child's timing loop, the calls' texts and the
arguments. No environment is built, no server started and nothing timed for real."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.embedding import child
from benchmarks.embedding import peers as peers_embed
from benchmarks.embedding import served as serve_peers_embed
from benchmarks.embedding import served_load as load
from benchmarks.embedding import served_servers as serve_servers
from benchmarks.embedding import served_sweep as serve_sweep
from benchmarks.embedding import served_table as serve_table
from benchmarks.embedding.items import is_embedding_export, quantize_config
from benchmarks.embedding.table import (
    peak_share,
    render_markdown,
    render_text,
    select,
    table_rows,
)
from benchmarks.harness.spread import ratios, spread

# a results header's CPU (benchmarks/harness/provenance.py)
ZEN4 = {"cpu": "AMD EPYC", "family": "AuthenticAMD family 25 model 17 stepping 1",
        "microarchitecture": "Zen 4", "flags": "avx2 avx512_bf16", "cores": 2}


def _item(name: str, rates: list[float], **extra) -> dict:
    return {"name": name, "runtime": f"runtime of {name}", "size_mb": 22.5,
            "rounds": [{"items_per_s": r} for r in rates], **extra}


def test_spread_is_min_median_max_of_the_rounds():
    assert spread([300.0, 100.0, 200.0], "sps") == {"sps_min": 100.0, "sps_median": 200.0,
                                                    "sps_max": 300.0}
    assert spread([], "sps") == {"sps_min": None, "sps_median": None, "sps_max": None}


def test_a_rate_ratio_is_the_row_over_the_reference_by_median_and_by_max():
    row, reference = spread([300.0, 330.0, 360.0], "sps"), spread([100.0, 200.0, 400.0], "sps")
    assert ratios(row, reference, "sps", lower_is_better=False) == (1.65, 0.9)
    assert ratios(row, {}, "sps", lower_is_better=False) == (None, None)


def test_ratios_are_against_the_st_onnx_int8_row_by_median_and_by_best():
    rows = table_rows([_item("st_onnx_int8", [100.0, 200.0, 400.0]),
                       _item("int8_aoti", [300.0, 330.0, 360.0],
                             quality={"fidelity": 0.99, "fidelity_p1": 0.98,
                                      "recall_at_10": 0.9})])
    ours = rows[1]
    assert ours["ratio_median"] == pytest.approx(330 / 200)
    assert ours["ratio_best"] == pytest.approx(360 / 400)
    assert rows[0]["ratio_median"] == 1.0
    assert (ours["fidelity"], ours["fidelity_p1"], ours["recall_at_10"]) == (0.99, 0.98, 0.9)


def test_without_the_reference_row_there_are_no_ratios():
    rows = table_rows([_item("int8_aoti", [300.0])])
    assert rows[0]["ratio_median"] is None and rows[0]["ratio_best"] is None


def test_a_failed_row_keeps_its_place_and_says_why():
    rows = table_rows([_item("st_onnx_int8", [100.0]),
                       _item("fastembed_fp32", [], error="cannot load the model")])
    assert rows[1]["sps_median"] is None and rows[1]["ratio_median"] is None
    text = render_text(rows)
    assert "fastembed_fp32: failed: cannot load the model" in text
    assert text.splitlines()[2].split()[-1] == "-"  # the failed row's cells


def test_peak_share_is_the_pass_flops_over_its_time_over_the_peak():
    # 872 texts at 436 sentences/s take 2 s; 2e12 FLOPs in 2 s is 1e12/s, 10% of 1e4 GOP/s
    assert peak_share(2e12, 436.0, 872, 1e4) == pytest.approx(10.0)
    assert peak_share(None, 436.0, 872, 1e4) is None
    assert peak_share(2e12, 436.0, 872, None) is None
    rows = table_rows([_item("st_onnx_int8", [436.0])], flops=2e12, count=872, peak_gops=1e4)
    assert rows[0]["pct_int8_peak"] == pytest.approx(10.0)


def test_select_keeps_table_order_and_names_unknown_rows():
    names = ["st_fp32", "st_onnx_int8", "int8_aoti"]
    assert select(names, None) == (names, [])
    assert select(names, ["int8_aoti", "st_fp32"]) == (["st_fp32", "int8_aoti"], [])
    assert select(names, ["int8_aotl"]) == ([], ["int8_aotl"])


def test_markdown_has_the_header_the_table_and_the_failures():
    rows = table_rows([_item("st_onnx_int8", [100.0, 120.0]),
                       _item("st_openvino_int8", [], error="no calibration")])
    text = render_markdown(rows, {"date": "2026-11-26", "cpu": ZEN4,
                                  "rounds": 2, "passes": 3, "warmup": 3, "texts": 872,
                                  "batch": 32, "versions": {"compress": {"torch": "2.13.0"}},
                                  "notes": ["a note"]})
    assert "- CPU: AMD EPYC; microarchitecture Zen 4" in text
    assert "- versions: compress: torch 2.13.0" in text
    assert "| st_onnx_int8 | runtime of st_onnx_int8 | - | - | - | 110.0 | 100.0 | 120.0 |" \
        in text
    assert "- a note" in text and "- st_openvino_int8: failed: no calibration" in text


def test_quantize_config_follows_the_cpu():
    assert quantize_config({"avx2", "avx512_vnni"}, "x86_64") == "avx512_vnni"
    assert quantize_config({"avx2"}, "x86_64") == "avx2"
    assert quantize_config(set(), "aarch64") == "arm64"


def test_only_embedding_exports_are_rows(tmp_path):
    embedding, block, classifier, broken = (tmp_path / n for n in "abcd")
    for folder, meta in ((embedding, {"outputs": ["embedding"]}),
                         (block, {"outputs": ["logits"], "embedding": {"pooling": "mean"}}),
                         (classifier, {"outputs": ["logits"]})):
        folder.mkdir()
        (folder / "export.json").write_text(json.dumps({"file": "model.onnx", **meta}))
    broken.mkdir()
    (broken / "export.json").write_text("{not json")
    assert is_embedding_export(embedding)["file"] == "model.onnx"
    assert is_embedding_export(block) is not None  # an AOTI package naming "logits"
    assert is_embedding_export(classifier) is None
    assert is_embedding_export(broken) is None
    assert is_embedding_export(tmp_path / "missing") is None


def test_the_timing_loop_pads_nothing_itself_and_keeps_the_first_pass():
    seen = []

    def encode(texts):
        seen.append(len(texts))
        return np.ones((len(texts), 4), dtype=np.float32) * len(seen)

    figures, first = child.time_passes(encode, [f"t{i}" for i in range(70)], 32, 1, 2)
    assert seen == [32, 32, 32, 6, 32, 32, 6]  # 1 warm-up batch, then 2 passes of 3
    assert first.shape == (70, 4) and first[0, 0] == 2.0  # the first timed pass
    assert len(figures["items_per_s_passes"]) == 2 and figures["items_per_s"] > 0


def test_the_fixed_shape_is_timed_on_texts_of_that_many_tokens_and_shared_by_the_peak():
    from transformers import AutoTokenizer

    from compress.recipe.sources import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(
        resolve_model("sentence-transformers/all-MiniLM-L6-v2", None).location)
    seen = []

    def encode(texts):
        seen.append(texts)
        return np.ones((len(texts), 4), dtype=np.float32)

    figures = child.time_fixed(encode, 8, 128, warmup=2, iters=5)
    assert len(seen) == 7 and all(len(t) == 8 for t in seen)
    assert len(tokenizer(seen[0][0])["input_ids"]) == 128  # [CLS] 126 words [SEP]
    assert figures["fixed_shape"] == [8, 128] and figures["fixed_ms"] >= 0
    # 10 ms a call of 1e10 FLOPs is 1e12/s: 10% of 1e4 GOP/s; the median over the rounds
    item = _item("search", [900.0, 1000.0, 1100.0])
    for r, ms in zip(item["rounds"], [12.0, 10.0, 30.0], strict=True):
        r["fixed_ms"] = ms
    row = table_rows([item], peak_gops=1e4, fixed_flops=1e10)[0]
    assert row["fixed_ms"] == 12.0
    assert row["pct_int8_peak_fixed"] == pytest.approx(100 / 12, abs=0.01)
    assert row["fixed_model_ms"] is None and row["pct_int8_peak_fixed_model"] is None
    assert table_rows([_item("st_onnx_int8", [436.0])])[0]["fixed_ms"] is None


def test_the_model_alone_is_timed_on_the_fixed_batch_tokenized_once():
    """Where a row's library can call its model on tokens, the fixed batch is prepared once
    (`model_call` gets the texts) and only the model's call is timed; its median over the
    rounds and its share of the peak are columns of their own."""
    prepared, calls = [], []

    def encode(texts):
        return np.ones((len(texts), 4), dtype=np.float32)

    def model_call(texts):
        prepared.append(texts)
        return lambda: calls.append(len(texts))

    encode.model_call = model_call
    figures = child.time_fixed(encode, 8, 128, warmup=2, iters=5)
    assert len(prepared) == 1 and len(prepared[0]) == 8 and calls == [8] * 7
    assert figures["fixed_model_ms"] >= 0
    item = _item("search", [900.0, 1000.0, 1100.0])
    for r, ms, model_ms in zip(item["rounds"], [12.0, 10.0, 30.0], [9.0, 8.0, 20.0],
                               strict=True):
        r["fixed_ms"], r["fixed_model_ms"] = ms, model_ms
    row = table_rows([item], peak_gops=1e4, fixed_flops=1e10)[0]
    assert row["fixed_model_ms"] == 9.0
    assert row["pct_int8_peak_fixed_model"] == pytest.approx(100 / 9, abs=0.01)


@pytest.mark.parametrize("argv, message", [
    (["RUN", "--rounds", "0"], "--rounds must be at least 1"),
    (["RUN", "--limit", "0"], "--limit must be at least 1"),
    (["RUN", "--warmup", "-1"], "--warmup must be at least 0"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        peers_embed.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_run_folder_is_a_user_error(tmp_path, capsys):
    assert peers_embed.main([str(tmp_path / "nowhere"), "--no-peers"]) == 2
    assert "error:" in capsys.readouterr().err


# ---------------------------------------------------------------- served.py


def _server(key: str, kind: str, rates: list[float], p50: float = 10.0) -> dict:
    return {"key": key, "name": key.replace("-", " "), "kind": kind, "rounds": [
        {"cold_start_s": 5.0 + i, "rss_peak_bytes": (100 + i) * 2**20,
         "runs": [{"concurrency": 8, "embeddings_per_s": rate, "latency_ms_p50": p50,
                   "latency_ms_p99": 2 * p50, "errors": 1}]}
        for i, rate in enumerate(rates)]}


def test_serve_rows_are_medians_over_rounds_with_errors_summed():
    rows = serve_table.table_rows([_server("compress-torchserve", "compress", [90, 110, 100])],
                                  [8, 32])
    at8, at32 = rows
    assert (at8["embeddings_per_s"], at8["errors"], at8["rounds"]) == (100, 3, 3)
    assert at8["rss_mb"] == 102 and at8["cold_start_s"] == 6.0
    assert at32["rounds"] == 0 and at32["embeddings_per_s"] is None and at32["errors"] is None


def test_serve_ratios_name_the_fastest_infinity_and_divide_by_each():
    rows = serve_table.table_rows([_server("compress-torchserve", "compress", [300], p50=20),
                                   _server("infinity-torch", "infinity", [100]),
                                   _server("infinity-optimum-int8", "infinity", [200], p50=40)],
                                  [8])
    lines = serve_table.ratios(rows, [8])
    assert lines[0] == "c8: the fastest infinity is infinity optimum int8 (200 emb/s)"
    assert lines[1] == ("c8: compress torchserve emb/s / infinity torch 3.00x, / infinity "
                        "optimum int8 1.50x, p50 latency / the fastest's 0.50x")
    text = serve_table.render_text(rows, lines)
    assert "compress torchserve" in text and lines[1] in text


def test_calls_cycle_through_the_texts():
    assert load.batches_of(["a", "b", "c"], 2, 3) == [["a", "b"], ["c", "a"], ["b", "c"]]
    assert load.batches_of(["a", "b", "c"], 1, 2, start=2) == [["c"], ["a"]]
    figures = load.level_figures([10.0, 30.0, 20.0], 3, ["HTTP 500"], 8, 4, 0.5)
    assert figures["embeddings_per_s"] == 6.0 and figures["latency_ms_p50"] == 20.0
    assert figures["errors"] == 1 and figures["ok"] == 3


@pytest.mark.parametrize("argv, message", [
    (["RUN", "--concurrency", "1,x"], "--concurrency"),
    (["RUN", "--infinity", "tensorrt"], "unknown infinity variant 'tensorrt'"),
    (["RUN", "--engines", "triton"], "unknown engine 'triton'"),
    (["RUN", "--no-compress", "--infinity", ""], "no server to measure"),
    (["RUN", "--batch", "16,x"], "--batch"),
    (["RUN", "--batch", "0", "--no-sweep"], "--batch: give sizes of at least 1"),
    (["RUN", "--batch", "16"], "--batch is for --no-sweep"),
    (["RUN", "--sweep-threads", "0"], "--sweep-batches, --sweep-threads"),
    (["RUN", "--sweep-requests", "0"], "--sweep-requests must be at least 1"),
])
def test_serve_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        serve_peers_embed.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_serve_quick_fills_only_what_was_not_given():
    args = serve_peers_embed.parse_args(["RUN", "--quick", "--requests", "5"])
    assert (args.rounds, args.levels, args.requests) == (1, [1, 8], 5)
    assert serve_peers_embed.parse_args(["RUN"]).levels == [1, 8, 32]


def test_serve_several_infinity_batches_are_a_server_each(tmp_path, monkeypatch):
    monkeypatch.setattr(serve_peers_embed, "ensure_venv", lambda venv, echo: {})  # no venv built
    args = serve_peers_embed.parse_args(["RUN", "--infinity", "torch", "--batch", "16,32",
                                         "--no-compress", "--no-sweep"])
    assert args.batches == [16, 32]
    items, _ = serve_peers_embed.server_items(args, tmp_path, tmp_path)
    assert [(i["key"], i["name"], i["batch"]) for i in items] == [
        ("infinity-torch-b16", "infinity torch b16", 16),
        ("infinity-torch-b32", "infinity torch b32", 32)]


def _trial(batch: int, threads: int, rate: float | None, errors: int = 0, **extra) -> dict:
    return {"batch": batch, "threads": threads, "embeddings_per_s": rate, "errors": errors,
            "latency_ms_p50": 10.0, **extra}


def test_the_sweep_chooses_the_fastest_setting_that_answered_every_call():
    trials = [_trial(8, 1, 100.0), _trial(8, 2, 500.0, errors=3),  # fastest, but calls failed
              _trial(16, 1, None, error="did not start"), _trial(16, 2, 180.0),
              _trial(32, 1, 150.0), _trial(32, 2, 180.0)]
    best = serve_sweep.choose(trials)
    assert (best["batch"], best["threads"]) == (16, 2)  # a tie: the smaller batch
    assert serve_sweep.choose([_trial(8, 2, 90.0), _trial(16, 1, 90.0)])["threads"] == 1
    assert serve_sweep.choose([_trial(8, 1, 50.0, errors=1), _trial(8, 2, None)]) is None


def test_the_sweeps_choice_sets_the_items_setting_or_says_why_none():
    item = {"name": "infinity torch", "batch": None, "threads": None}
    serve_sweep.apply_choice(item, [_trial(8, 1, 100.0), _trial(32, 2, 300.0)])
    assert (item["batch"], item["threads"]) == (32, 2) and "error" not in item
    assert item["sweep"]["chosen"] == {"batch": 32, "threads": 2, "embeddings_per_s": 300.0}
    failed = {"name": "compress torchserve"}
    serve_sweep.apply_choice(failed, [_trial(8, 1, 10.0, errors=4)])
    assert failed["error"] == "sweep: no setting answered every call (4 failed calls)"
    assert failed["sweep"]["chosen"] is None


def test_the_sweep_tries_every_server_at_every_setting_and_skips_failed_ones():
    items = [{"name": "compress torchserve", "rounds": []},
             {"name": "infinity optimum", "error": "no ONNX files", "rounds": []}]
    tried = []

    def trial(item, setting):
        tried.append((item["name"], setting["batch"], setting["threads"]))
        return {"embeddings_per_s": 100.0 * setting["batch"] / setting["threads"], "errors": 0}

    settings = serve_sweep.grid([8, 16], [1, 2])
    assert settings[:2] == [{"batch": 8, "threads": 1}, {"batch": 8, "threads": 2}]
    serve_sweep.run_sweep(items, settings, trial, lambda _: None)
    assert tried == [("compress torchserve", b, t) for b in (8, 16) for t in (1, 2)]
    assert (items[0]["batch"], items[0]["threads"]) == (16, 1)
    assert "sweep" not in items[1]
    rows = serve_sweep.sweep_rows(items)
    assert [r["chosen"] for r in rows] == ["", "", "yes", ""]
    markdown = serve_sweep.sweep_markdown(rows, "how it was swept")
    assert "## Sweep" in markdown and "how it was swept" in markdown
    assert "| compress torchserve | 16 | 1 | 1600.0 | 10.0 | 0 | yes |" not in markdown  # p50
    assert "| compress torchserve | 16 | 1 | 1600.0 | - | 0 | yes |" in markdown
    assert "yes" in serve_sweep.sweep_text(rows)
    assert serve_sweep.sweep_markdown([], "x") == serve_sweep.sweep_text([]) == ""


def test_the_sweeps_threads_follow_the_cores():
    assert serve_sweep.default_threads(1) == [1]
    assert serve_sweep.default_threads(2) == [1, 2]
    assert serve_sweep.default_threads(12) == [1, 2, 4, 8, 12]


def test_the_served_table_shows_each_servers_setting():
    item = _server("compress-torchserve", "compress", [300])
    item.update(batch=16, threads=2)
    rows = serve_table.table_rows([item], [8])
    assert (rows[0]["batch"], rows[0]["threads"]) == (16, 2)
    text = serve_table.render_text(rows, [])
    assert text.splitlines()[0].split()[:4] == ["server", "batch", "threads", "conc"]
    markdown = serve_table.render_markdown(rows, [], {
        "title": "T", "facts": {"settings": "chosen by the sweep below"}, "notes": ["n"],
        "command": "python -m benchmarks.embedding.served RUN", "cpu": ZEN4})
    assert "| compress torchserve | 16 | 2 | 8 | 300 |" in markdown


def test_the_sweeps_settings_reach_each_servers_command(tmp_path):
    compress = {"key": "compress-torchserve", "kind": "compress", "target": "RUN",
                "engine": "torchserve", "model_name": "m", "version": "1.0",
                "serve_dir": str(tmp_path)}
    command = serve_servers.Server(compress, tmp_path, 16, 2).command()
    assert command[-4:] == ["--batch-size", "16", "--threads", "2"]
    assert "--batch-size" not in serve_servers.Server(compress, tmp_path).command()
    infinity = {"key": "infinity-torch", "kind": "infinity", "binary": "infinity_emb",
                "folder": str(tmp_path), "variant": "torch"}
    command = serve_servers.Server(infinity, tmp_path, 8, 1).command()
    assert command[command.index("--batch-size") + 1] == "8"


def test_infinitys_optimization_outcome_comes_from_its_file_or_its_log():
    wrapped = ("INFO  Optimizing model\nWARNING  Optimization failed with\n         "
               "OptimizationConfig.__init__() got an unexpected\n         keyword argument "
               "'optimize_with_onnxruntime_only'.\n         Going to use the unoptimized "
               "model.\n")
    assert serve_servers.optimization_outcome([], wrapped) == (
        "not optimized: OptimizationConfig.__init__() got an unexpected keyword argument "
        "'optimize_with_onnxruntime_only'")
    assert serve_servers.optimization_outcome(["model_optimized.onnx"], wrapped) == (
        "optimized (model_optimized.onnx)")
    assert "gives no reason" in serve_servers.optimization_outcome([], "")
    facts = serve_peers_embed.optimization_facts([
        {"name": "infinity optimum", "onnx_optimization": "optimized (model_optimized.onnx)"},
        {"name": "infinity torch"}])
    assert facts == {"infinity's ONNX optimization":
                     "infinity optimum: optimized (model_optimized.onnx)"}


def test_serve_sweep_arguments():
    args = serve_peers_embed.parse_args(["RUN", "--sweep-batches", "8,32",
                                         "--sweep-threads", "1"])
    assert args.sweep and args.sweep_grid == [{"batch": 8, "threads": 1},
                                              {"batch": 32, "threads": 1}]
    assert args.sweep_requests == serve_peers_embed.FULL["sweep_requests"]
    assert not serve_peers_embed.parse_args(["RUN", "--no-sweep"]).sweep


def test_compress_rows_run_a_batch_in_passes_of_similar_length(tiny_bert, tmp_path,
                                                               monkeypatch):
    """The child times compress's exports as the handlers run them: a batch's texts in
    passes of similar length, each padded to its longest (one pass with `length_buckets`
    false), the embeddings in the texts' order either way."""
    from builders import stand_in_embedding_export
    from transformers import AutoTokenizer

    folder = tmp_path / "export"
    shapes = stand_in_embedding_export(tiny_bert, folder, monkeypatch)  # rows embed their length
    texts = ["good", "a long and winding review of a film that goes on and on " * 3,
             "bad", "fine film", "dull"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    lengths = [len(tokenizer(t)["input_ids"]) for t in texts]
    for buckets, passes in ((True, [(4, 4), (1, max(lengths))]), (False, [(5, max(lengths))])):
        shapes.clear()
        spec = {"folder": str(folder), "threads": 1, "length_buckets": buckets}
        encode = child.load_compress(spec)
        out = encode(texts)
        assert out[:, 0].tolist() == lengths  # in the texts' order
        assert shapes == passes
    # the model alone: the texts tokenized and padded once, one pass a call
    shapes.clear()
    call = encode.model_call(texts)
    assert shapes == []
    assert call()[:, 0].tolist() == lengths and call()[:, 0].tolist() == lengths
    assert shapes == [(5, max(lengths))] * 2


def test_a_packed_file_is_one_pass_and_counts_each_texts_own_flops():
    """Compress's padded rows are cut by length; a packed file's (export.json aoti_packed)
    batch is one pass of its real tokens, its FLOPs those of each text alone."""
    from benchmarks.embedding import quality

    batches = [[5, 30, 7], [12]]
    assert quality.pass_shapes(batches) == [(3, 30), (1, 12)]
    assert quality.pass_shapes(batches, packed=True) == [(1, 5), (1, 30), (1, 7), (1, 12)]
    assert len(quality.pass_shapes(batches, bucketed=True)) >= 2
