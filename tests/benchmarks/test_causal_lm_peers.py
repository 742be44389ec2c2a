"""benchmarks/causal_lm/peers.py and its modules: weight bytes a decode step reads (a
GGUF's tensors, a torch model's weights, tied or not, int8 grouped), the share of the
bandwidth bound, medians over rounds, each compress row paired with its llama.cpp file, the
tables, the llama.cpp child's perplexity arithmetic, the GGUF cache, and bad input as one
error line (no llama.cpp)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.causal_lm import child, table
from benchmarks.causal_lm import llama_child as llama
from benchmarks.causal_lm import llama_env as env
from benchmarks.causal_lm import peers as peers_llm
from benchmarks.harness.venv import PeerError
from compress.runfolder.files import sha256_file

# a results header's CPU (benchmarks/harness/provenance.py)
ZEN4 = {"cpu": "AMD EPYC", "family": "AuthenticAMD family 25 model 17 stepping 1",
        "microarchitecture": "Zen 4", "flags": "avx2 avx512_bf16", "cores": 2}

# the tiny model's weights: 1 layer, 32 wide, 4 query / 2 key-value heads (8 each), 64 in
# the MLP, 300 tokens; q, k, v, o, gate, up, down, three norms
LAYER = 32 * 32 + 2 * 16 * 32 + 32 * 32 + 3 * 64 * 32 + 3 * 32
EMBED = 300 * 32


def tiny(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).eval()


def test_a_tied_embedding_is_read_whole_an_untied_one_a_row_a_token() -> None:
    assert LAYER == 9312
    # tied: the table is the output projection, read whole every step
    assert child.weight_bytes_per_token(tiny(tied=True)) == 4 * (LAYER + EMBED) == 75648
    # untied: the head whole, one row of the embedding (32 floats)
    assert child.weight_bytes_per_token(tiny(tied=False)) == 4 * (LAYER + EMBED + 32) == 75776


def test_gguf_bytes_per_token_reads_the_file_tensor_sizes(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((300, 32), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.zeros(32, dtype=np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):
        step()
    got = env.gguf_bytes_per_token(path)
    assert got["tied_output"] is True
    assert got["bytes_per_token"] == 4 * (300 * 32 + 32 * 32 + 32) == 42624
    assert got["file_tensor_bytes"] == {"F32": 42624}


def test_an_output_tensor_leaves_one_embedding_row_a_token() -> None:
    tensors = [("token_embd.weight", "Q8_0", 34 * 49152 * 18, 49152),
               ("output.weight", "Q6_K", 5000, 49152), ("blk.0.ffn_up.weight", "Q4_1", 700, 1536)]
    got = env.bytes_per_token(tensors)
    assert got == {"bytes_per_token": 34 * 18 + 5000 + 700, "tied_output": False,
                   "file_tensor_bytes": {"Q8_0": 34 * 49152 * 18, "Q6_K": 5000, "Q4_1": 700}}


def test_bandwidth_share_medians_and_best_triad() -> None:
    # 100 MB a token at 200 tok/s is 20 GB/s: half of a 40 GB/s triad
    assert table.bandwidth_share(100e6, 200.0, 40.0) == pytest.approx(0.5)
    assert table.bandwidth_share(None, 200.0, 40.0) is None
    assert table.bandwidth_share(100e6, 200.0, None) is None
    assert table.best_bandwidth([{"triad_gbs": 30.5}, {"error": "x"}, {"triad_gbs": 31.25}]) \
        == 31.25
    assert table.best_bandwidth([{"error": "x"}]) is None
    rounds = [{"tok_s_b1": 100.0, "ttft_ms": 9.0, "perplexity": 12.5, "pid": 1},
              {"tok_s_b1": 140.0, "ttft_ms": 7.0, "pid": 2},
              {"tok_s_b1": 120.0, "ttft_ms": 8.0, "pid": 3}]
    assert table.median_over_rounds(rounds) == {"tok_s_b1": 120.0, "ttft_ms": 8.0,
                                                "perplexity": 12.5, "pid": 1}


def items() -> list[dict]:
    greedy = [[1, 2, 3, 4], [5, 6, 7, 8]]
    return [
        {"name": "llama.cpp Q4_1", "runtime": "llama.cpp", "weights": "Q4_1",
         "bytes_per_token": 96_000_000, "rounds": [
             {"tok_s_b1": 200.0, "tok_s_b8": 800.0, "ttft_ms": 20.0, "perplexity": 20.1,
              "greedy": [[1, 2, 3, 9], [5, 6, 7, 8]], "b8_rows": [[1, 2, 3, 9], [5, 6, 0, 0]]},
             {"tok_s_b1": 220.0, "tok_s_b8": 900.0, "ttft_ms": 22.0}]},
        {"name": "llama.cpp Q8_0", "runtime": "llama.cpp", "weights": "Q8_0",
         "bytes_per_token": 160_000_000, "rounds": [
             {"tok_s_b1": 100.0, "ttft_ms": 30.0, "b8_note": "not measured: no batch"}]},
        {"name": "compress float", "runtime": "compress", "weights": "float",
         "rounds": [{"tok_s_b1": 50.0, "tok_s_b8": 300.0, "bytes_per_token": 538_000_000,
                     "greedy": greedy}]},
        {"name": "compress int8_grouped", "runtime": "compress", "weights": "int8_grouped",
         "rounds": [{"tok_s_b1": 150.0, "tok_s_b8": 600.0, "bytes_per_token": 168_000_000,
                     "greedy": [[1, 2, 0, 0], [5, 6, 7, 8]]}]},
        {"name": "compress int4", "runtime": "compress", "weights": "int4", "rounds": [],
         "error": "the process exited with code 1: boom"},
    ]


def test_rows_pair_each_compress_row_with_its_llama_file() -> None:
    rows = {r["name"]: r for r in table.table_rows(items(), 40.0)}
    q41 = rows["llama.cpp Q4_1"]
    assert (q41["tok_s_b1"], q41["tok_s_b8"], q41["ttft_ms"]) == (210.0, 850.0, 21.0)
    assert q41["mb_per_token"] == 96.0
    assert q41["pct_bandwidth_b1"] == pytest.approx(100 * 96e6 * 210 / 40e9)  # 50.4
    assert q41["agreement"] == pytest.approx(7 / 8)  # one token of 8 differs from float's
    assert q41["x_peer_b1"] is None  # llama.cpp rows have no pair
    assert q41["b8_agreement"] == pytest.approx(6 / 8)  # batch 8 against its own batch 1
    assert rows["compress float"]["b8_agreement"] is None  # not measured
    grouped = rows["compress int8_grouped"]
    assert grouped["peer"] == "llama.cpp Q8_0"
    assert grouped["x_peer_b1"] == pytest.approx(1.5)  # 150 against Q8_0's 100
    assert grouped["x_peer_b8"] is None  # Q8_0 has no batch-8 figure
    assert grouped["agreement"] == pytest.approx(6 / 8)
    assert grouped["pct_bandwidth_b1"] == pytest.approx(100 * 168e6 * 150 / 40e9)  # 63.0
    assert rows["compress float"]["agreement"] == 1.0
    assert rows["compress float"]["x_peer_b1"] is None
    assert rows["compress int4"]["x_peer_b1"] is None  # failed: nothing to divide
    assert rows["compress int4"]["peer"] == "llama.cpp Q4_1"
    assert "greedy" not in grouped


def test_sparse24_and_moe_rows_are_paired_with_the_dense_grouped_rows() -> None:
    pruned = [{"name": f"compress 2:4 {scheme}", "runtime": "compress",
               "weights": f"{scheme} (2:4 pruned)",
               "rounds": [{"tok_s_b1": b1, "tok_s_b8": 4 * b1, "bytes_per_token": size}]}
              for scheme, b1, size in (("int8_grouped", 150.0, 151_000_000),
                                       ("int8_sparse24", 195.0, 105_000_000))]
    moe = {"name": "compress MoE int8_grouped", "runtime": "compress", "weights": "MoE",
           "rounds": [{"tok_s_b1": 225.0, "bytes_per_token": 90_000_000}]}
    rows = {r["name"]: r for r in table.table_rows([*items(), *pruned, moe], 40.0)}
    assert rows["compress MoE int8_grouped"]["peer"] == "compress int8_grouped"
    assert rows["compress MoE int8_grouped"]["x_peer_b1"] == pytest.approx(1.5)  # 225 / 150
    sparse = rows["compress 2:4 int8_sparse24"]
    assert sparse["peer"] == "compress 2:4 int8_grouped"
    assert sparse["x_peer_b1"] == pytest.approx(1.3) and sparse["x_peer_b8"] == pytest.approx(1.3)
    assert sparse["pct_bandwidth_b1"] == pytest.approx(100 * 105e6 * 195 / 40e9)
    assert rows["compress 2:4 int8_grouped"]["peer"] is None  # the dense kernel: no pair
    assert "compress 2:4 int8_sparse24 against compress 2:4 int8_grouped" in \
        table.render_markdown(list(rows.values()), {})


def test_tables_show_the_figures_and_say_what_failed() -> None:
    rows = table.table_rows(items(), 40.0)
    text = table.render_text(rows)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["row", "weights", "b1", "tok/s"]
    grouped = next(line for line in lines if line.startswith("compress int8_grouped"))
    # b8 = b1 tokens ("-": this row's b8 rows were not checked), ..., b8 / b1 last
    assert grouped.split()[3:] == ["150.0", "600.0", "-", "-", "0.750", "-", "168.0", "63.0",
                                   "1.50", "-", "-", "4.00"]
    assert "compress int4: failed: the process exited with code 1: boom" in lines
    assert "llama.cpp Q8_0: b8 not measured: no batch" in lines
    assert "llama.cpp Q4_1: b8 rows agree with its batch-1 greedy tokens at 0.750 of " \
        "positions" in lines
    header = {"date": "2026-11-25", "threads": 2, "cpu": ZEN4,
              "versions": {"compress": {"torch": "2.13.0"},
                           "llama.cpp's environment": {"llama-cpp-python": "0.3.36"}},
              "rounds": 2, "tokens": 64, "ttft_tokens": 128, "ppl_texts": 200, "prompts": 20,
              "greedy_tokens": 32, "bandwidth_gbs": 40.0,
              "command": "python -m benchmarks.causal_lm.peers",
              "llama_build": "CMAKE_ARGS=-DGGML_NATIVE=ON: CPU : AVX512_VNNI = 1 |"}
    markdown = table.render_markdown(rows, header)
    assert markdown.splitlines()[2] == "- command: `python -m benchmarks.causal_lm.peers`"
    assert "- CPU: AMD EPYC; microarchitecture Zen 4 (AuthenticAMD family 25 model 17 " \
        "stepping 1); 2 cores" in markdown and "- threads used: 2" in markdown
    assert "compress: torch 2.13.0; llama.cpp's environment: llama-cpp-python 0.3.36" \
        in markdown
    assert "- llama.cpp (CMAKE_ARGS=-DGGML_NATIVE=ON: CPU : AVX512_VNNI = 1 |)" in markdown
    assert "40.0 GB/s" in markdown and "rounds: 2" in markdown
    assert "| llama.cpp Q4_1 | Q4_1 | 210.0 | 850.0 | 21.0 | 20.100 | 0.875 | 0.750 | 96.0 " \
        "| 50.4 | - | - | - | 4.05 |" in markdown
    assert "| compress int4 | int4 | failed | - |" in markdown
    assert "compress int8_grouped against llama.cpp Q8_0" in markdown


def test_llama_child_nll_is_cross_entropy() -> None:
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    ids = [3, 7, 1, 10, 2]
    expected = torch.nn.functional.cross_entropy(logits[:4], torch.tensor(ids[1:]),
                                                 reduction="sum")
    assert llama.nll(logits.numpy(), ids) == pytest.approx(float(expected), rel=1e-6)
    assert math.isclose(llama.nll(np.zeros((3, 4), dtype=np.float32), [0, 1, 2]),
                        2 * math.log(4), rel_tol=1e-9)


def test_cached_ggufs_are_reused_until_the_source_changes(tmp_path: Path) -> None:
    source = tmp_path / "Model-135M.Q4_1.gguf"
    source.write_bytes(b"weights")
    folder = tmp_path / "made"
    folder.mkdir()
    for quant in env.TARGETS:
        assert env.target_path(folder, source, quant).name == f"Model-135M.{quant}.gguf"
        env.target_path(folder, source, quant).write_bytes(b"x")
    (folder / env.SOURCE_FILE).write_text(json.dumps({"sha256": sha256_file(source)}))
    said: list[str] = []
    paths = env.build_ggufs(source, tmp_path / "no-venv", folder, said.append)
    assert paths == {q: folder / f"Model-135M.{q}.gguf" for q in env.TARGETS}
    assert "cached" in said[0]
    source.write_bytes(b"other weights")  # a new source: quantized again (here: no venv)
    with pytest.raises(PeerError, match="quantize to Q8_0: cannot start"):
        env.build_ggufs(source, tmp_path / "no-venv", folder, said.append)
    assert not list(folder.glob(".build-*"))  # the temporary folder is gone


def test_venv_marker_and_a_folder_that_is_no_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    venv.mkdir()
    with pytest.raises(PeerError, match="not a virtual environment"):
        env.ensure_llama(venv, print)
    (venv / env.LLAMA.marker).write_text(json.dumps({"llama-cpp-python": "0.3.36"}))
    assert env.ensure_llama(venv, print) == {"llama-cpp-python": "0.3.36"}


@pytest.mark.parametrize("args, message", [
    (["--gguf", "/nowhere/model.gguf"], "error: /nowhere/model.gguf: no such GGUF file"),
    (["--gguf", "GGUF", "--variants", "float,int3", "--no-llama"],
     "error: unknown variant 'int3' (known: float, int8_grouped, int4_grouped, int4, "
     "int8_grouped_a8, int4_grouped_a8, int8_grouped_bf16, int4_grouped_bf16)"),
    (["--gguf", "GGUF", "--quants", "Q5_K"], "error: unknown llama.cpp file 'Q5_K'"),
    (["--gguf", "GGUF", "--pruned", "/nowhere"], "error: /nowhere: not a causal-LM folder"),
    (["--gguf", "GGUF", "--moe", "/", "--moe-variants", "int8_sparse24"],
     "error: unknown --moe-variants 'int8_sparse24' (known: int8_grouped, int4_grouped)"),
    (["--gguf", "GGUF", "--pruned", "/", "--pruned-variants", "int8_sparse24,int2"],
     "error: unknown --pruned-variants 'int2' (known: int8_grouped, int4_grouped, "
     "int8_sparse24, int4_sparse24)"),
])
def test_bad_input_is_one_error_line(args: list[str], message: str, capsys,
                                     tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert peers_llm.main([str(gguf) if a == "GGUF" else a for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and "Traceback" not in err


def _int4_items() -> list[dict]:
    """llama.cpp's two 4-bit files, compress float and int4_grouped (agreeing 7 of 8)."""
    def item(name: str, b1: float, b8: float, ttft: float, greedy: list, **more) -> dict:
        runtime = name.split()[0]
        return {"name": name, "runtime": runtime, "weights": name.split()[-1], "rounds": [
            {"tok_s_b1": b1, "tok_s_b8": b8, "ttft_ms": ttft, "greedy": greedy,
             "perplexity": 20.0, **more}]}
    float_tokens = [[1, 2, 3, 4], [5, 6, 7, 8]]
    return [item("llama.cpp Q4_1", 200.0, 800.0, 40.0, float_tokens),
            item("llama.cpp Q4_0", 250.0, 1000.0, 30.0, float_tokens),
            item("compress float", 50.0, 300.0, 90.0, float_tokens),
            item("compress int4_grouped", 300.0, 900.0, 60.0, [[1, 2, 3, 0], [5, 6, 7, 8]],
                 ttft_compiled_ms=20.0, served_prefill="eager")]


def test_int4_rows_are_paired_with_q4_1_and_also_divided_by_q4_0() -> None:
    """Q4_1 holds the same weights (like for like), Q4_0 is llama.cpp's fastest 4-bit file:
    an int4 row's x peer is against Q4_1, and both ratios are kept beside its quality."""
    assert "Q4_1" in peers_llm.parse_args([]).quants  # the default --quants includes it
    assert peers_llm.parse_args([]).quants[0] == "Q4_1"
    rows = {r["name"]: r for r in table.table_rows(_int4_items(), 40.0)}
    int4 = rows["compress int4_grouped"]
    assert int4["peer"] == "llama.cpp Q4_1"
    assert int4["x_peer_b1"] == pytest.approx(1.5) and int4["x_q4_1_b1"] == pytest.approx(1.5)
    assert int4["x_q4_0_b1"] == pytest.approx(1.2) and int4["x_q4_0_b8"] == pytest.approx(0.9)
    assert int4["x_q4_1_ttft"] == pytest.approx(1.5) and int4["x_q4_0_ttft"] == 2.0
    assert int4["agreement"] == pytest.approx(7 / 8)
    assert "x_q4_0_b1" not in rows["compress float"]
    text = table.render_text(list(rows.values()))
    assert "int4 rows against llama.cpp's two 4-bit files:" in text
    line = [x for x in text.splitlines() if x.startswith("compress int4_grouped")][-1]
    assert line.split()[2:] == ["20.000", "0.875", "1.50", "1.12", "1.50", "1.20", "0.90",
                                "2.00"]
    markdown = table.render_markdown(list(rows.values()), {})
    assert "| compress int4_grouped | 20.000 | 0.875 | 1.50 | 1.12 | 1.50 | 1.20 | 0.90 | " \
        "2.00 |" in markdown
    assert "Q4_1 is the shipped file and holds the same weights (like for like)" in markdown
    assert "compress int4_grouped against llama.cpp Q4_1 or llama.cpp Q4_0" in markdown
    # without Q4_1 the int4 rows fall back on Q4_0, and a note says what is missing
    fallback = table.table_rows(_int4_items()[1:], 40.0)
    assert fallback[-1]["peer"] == "llama.cpp Q4_0"
    assert "no llama.cpp Q4_1 row (not in --quants): the int4 rows have no ratio to it (the " \
        "same weights: the like-for-like ratio)" in table.render_text(fallback)


def test_the_ttft_column_is_the_served_prefill_and_a_compiled_one_says_it_is_not() -> None:
    rows = table.table_rows(_int4_items(), 40.0)
    header = {"served_prefill": "eager (the handler's default prefill_compile: false)"}
    markdown = table.render_markdown(rows, header)
    head = next(line for line in markdown.splitlines() if line.startswith("| row |"))
    cells = [c.strip() for c in head.strip("|").split("|")]
    at = cells.index("TTFT ms")
    assert cells[at + 1] == "TTFT ms, compiled prefill (not the served default)"
    int4 = next(line for line in markdown.splitlines()
                if line.startswith("| compress int4_grouped | int4_grouped"))
    assert [c.strip() for c in int4.strip("|").split("|")][at:at + 2] == ["60.0", "20.0"]
    assert "- compress's TTFT: the prefill a served archive runs by default, eager (the " \
        "handler's default prefill_compile: false); the compiled prefill (not the served " \
        "default) in a column of its own" in markdown
    assert "compress's through the prefill a served archive runs by default" in markdown
    assert "TTFT: the compiled prefill a served worker runs" not in markdown
    # no compiled figure: no such column
    plain = [{**i, "rounds": [{k: v for k, v in r.items() if k != "ttft_compiled_ms"}
                              for r in i["rounds"]]} for i in _int4_items()]
    assert "compiled prefill" not in table.render_text(table.table_rows(plain, 40.0))
    # the compiled figure is a median over the rounds like TTFT
    assert table.median_over_rounds([{"ttft_compiled_ms": 9.0}, {"ttft_compiled_ms": 7.0},
                                     {"ttft_compiled_ms": 8.0}]) == {"ttft_compiled_ms": 8.0}


def test_ttft_goes_through_the_prefill_a_served_archive_builds_by_default(monkeypatch,
                                                                           tmp_path) -> None:
    """The served default (the handler's prefill_compile) decides which prefiller compress's
    TTFT times: the prefill compiled ahead of time beside ahead-of-time steps, as the package
    stage ships it (exported once into the row's folder), else eager; torch.compile's
    prefill is timed besides only when asked."""
    from serve.causal_lm.server import aot_steps
    from serve.handler_settings import HandlerSettings

    assert HandlerSettings.prefill_compile is True  # as shipped
    model = tiny(tied=True)
    exported: list[Path] = []
    monkeypatch.setattr(aot_steps, "export_prefill", lambda m, rows, cache_len, mode, out,
                        last_only: (exported.append(out),
                                    (out / aot_steps.PREFILL).write_bytes(b"")))
    monkeypatch.setattr(aot_steps, "load_prefill", lambda folder, m: {1: "package"})
    served = child.served_prefiller(model, 64, tmp_path)
    assert served.kind == "ahead of time" and served.run.packages == {1: "package"}
    assert served.prefix_cache is None  # a repeated prompt is prefilled every time
    assert exported == [tmp_path / "prefill"]
    child.served_prefiller(model, 64, tmp_path)
    assert exported == [tmp_path / "prefill"]  # once: the next round loads it
    assert child.served_prefiller(model, 64, None).kind == "eager"  # steps not shipped
    timed: list[str] = []
    monkeypatch.setattr(child, "ttft_ms", lambda m, prefiller, prompt, repeats: (
        timed.append(prefiller.kind) or {"eager": 10.0, "compiled": 15.0,
                                         "ahead of time": 8.0}[prefiller.kind]))
    assert child.ttft_figures(model, 64, [1, 2, 3], 1, tmp_path, True, also_compiled=True) == {
        "ttft_ms": 8.0, "served_prefill": "ahead of time", "ttft_compiled_ms": 15.0}
    assert child.ttft_figures(model, 64, [1, 2, 3], 1, None, True, also_compiled=False) == {
        "ttft_ms": 10.0, "served_prefill": "eager"}
    assert child.ttft_figures(model, 64, [1, 2, 3], 1, None, False, also_compiled=True) == {
        "ttft_ms": 10.0, "served_prefill": "eager"}  # an eager step: nothing to compile
    assert peers_llm.served_prefill("max-autotune", "aoti").startswith("ahead of time (the "
                                                                      "handler's default "
                                                                      "prefill_compile: true")
    assert peers_llm.served_prefill("none", "aoti").startswith("eager")
    assert peers_llm.served_prefill("max-autotune", "cpp").startswith("eager")
    assert peers_llm.parse_args(["--ttft-compiled"]).ttft_compiled is True


def test_ours_gguf_names_llama_cpp_rows_on_compress_exports(tmp_path: Path, capsys) -> None:
    """--ours-gguf: a missing file is one error line (exit 2), and it needs llama.cpp."""
    assert peers_llm.main(["--ours-gguf", str(tmp_path / "none.gguf")]) == 2
    err = capsys.readouterr().err
    assert "none.gguf: no such GGUF file (--ours-gguf" in err
    with pytest.raises(SystemExit):
        peers_llm.parse_args(["--ours-gguf", "a.gguf", "--no-llama"])
    args = peers_llm.parse_args(["--ours-gguf", "a.gguf,b.gguf"])
    assert args.ours_gguf == [Path("a.gguf"), Path("b.gguf")]
