"""Issue 71 item 1: one reader for every sentence-transformers layout. Folders are saved by
the installed sentence-transformers itself (v6 keys: `pooling_mode` a name or a list,
`embedding_dimension`, max_seq_length from the tokenizer) around a 2-layer, 32-wide random
BERT, one per pooling mode, a list of modes, with and without Normalize, with Dense heads;
a legacy folder is written as versions before 6 wrote it (a `0_Transformer` subfolder,
`pooling_mode_*` flags, `sentence_bert_config.json`'s max_seq_length, a Dense with
`pytorch_model.bin`). Each one's fp32 encoder equals `SentenceTransformer.encode` within 1e-5;
what a folder asks for and compress cannot do is one UserError naming the module."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from compress.errors import UserError
from compress.families.embedding.encoder import SentenceEncoder, load_encoder
from compress.families.embedding.layout import read_layout

st = pytest.importorskip("sentence_transformers")
from sentence_transformers.sentence_transformer import modules  # noqa: E402

TEXTS = ["the film was wonderful", "a dull, lifeless movie", "hi",
         "one of the best performances of the year, and a script to match it"]
WIDTH = 32


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer, 32-wide random BertModel with MiniLM's tokenizer (a Hugging Face folder)."""
    from builders import tiny_bert_folder

    folder = tiny_bert_folder(tmp_path_factory.mktemp("tiny_bert_model"), WIDTH)
    return folder


def saved(folder: Path, tiny_model: Path, pooling: Any, *after: Any, **options: Any) -> Any:
    """A SentenceTransformer of tiny_model, pooling and the modules `after`, saved by
    sentence-transformers into `folder` (the model returned encodes as the folder does, with
    no second load: the unit tier's time)."""
    torch.manual_seed(1)
    model = st.SentenceTransformer(
        modules=[modules.Transformer(str(tiny_model)), modules.Pooling(WIDTH, pooling), *after],
        device="cpu", **options)
    model.save(str(folder), create_model_card=False)
    return model


def ours(folder: Path | tuple[SentenceEncoder, Any], prompt_name: str | None = None
         ) -> tuple[torch.Tensor, SentenceEncoder]:
    """Our fp32 encoder's embeddings of TEXTS with the prompt, as encode puts it before each
    text (`folder`: a folder, or an encoder and its tokenizer already loaded)."""
    encoder, tokenizer = folder if isinstance(folder, tuple) else load_encoder(folder)[:2]
    texts = TEXTS
    prompt = encoder.prompt(prompt_name)
    inputs = tokenizer([prompt + t for t in texts], padding=True, truncation=True,
                       max_length=encoder.max_seq_length, return_tensors="pt")
    with torch.no_grad():
        return encoder(**inputs), encoder


def assert_encodes_alike(folder: Path, width: int, model: Any = None) -> SentenceEncoder:
    """Our encoder of `folder` equals sentence-transformers' encode (of `model`, else of the
    folder loaded by sentence-transformers) within 1e-5."""
    got, encoder = ours(folder)
    model = model or st.SentenceTransformer(str(folder), device="cpu")
    want = model.encode(TEXTS, convert_to_tensor=True).float()
    assert got.shape == want.shape == (len(TEXTS), width)
    assert encoder.dimensions == width
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    return encoder


@pytest.mark.parametrize("pooling", ["cls", "mean", "max", "mean_sqrt_len_tokens",
                                     "weightedmean", "lasttoken"])
def test_each_pooling_mode_of_a_v6_folder(pooling: str, tiny_model: Path, tmp_path: Path
                                          ) -> None:
    folder, model = tmp_path / "m", saved(tmp_path / "m", tiny_model, pooling)
    config = json.loads((folder / "1_Pooling/config.json").read_text())
    assert config["pooling_mode"] == pooling and "embedding_dimension" in config  # v6 keys
    layout = read_layout(folder)
    assert layout.pooling == ({"mean_sqrt_len_tokens": "mean_sqrt_len"}.get(pooling, pooling),)
    assert not layout.normalize and layout.dense == ()
    # v6 writes no max_seq_length: the tokenizer's bound, capped at the position table
    assert layout.max_seq_length == model.max_seq_length == 128
    if pooling == "mean":  # once: what sentence-transformers reads back from the folder
        assert st.SentenceTransformer(str(folder), device="cpu").max_seq_length == 128
    assert_encodes_alike(folder, WIDTH, model)


def test_a_list_of_modes_with_dense_heads_and_normalize(tiny_model: Path, tmp_path: Path
                                                        ) -> None:
    folder = tmp_path / "m"
    model = saved(folder, tiny_model, ["weightedmean", "max", "cls"],
                   modules.Dense(3 * WIDTH, 24, activation_function=torch.nn.GELU()),
                   modules.Dense(24, 16, bias=False, activation_function=torch.nn.Identity()),
                   modules.Normalize())
    layout = read_layout(folder)
    assert layout.pooling == ("weightedmean", "max", "cls") and layout.normalize
    assert [(d.in_features, d.out_features, d.bias, d.activation) for d in layout.dense] == [
        (96, 24, True, "GELU"), (24, 16, False, "Identity")]
    encoder = assert_encodes_alike(folder, 16, model)
    assert encoder.pooling == "weightedmean+max+cls"


def test_the_example_folder_of_the_issue(tiny_model: Path, tmp_path: Path) -> None:
    """mean and max concatenated, a Tanh Dense, Normalize, prompts and truncate_dim."""
    folder = tmp_path / "m"
    model = saved(folder, tiny_model, ["mean", "max"],
                   modules.Dense(2 * WIDTH, 64, activation_function=torch.nn.Tanh()),
                   modules.Normalize(), prompts={"query": "query: ", "document": "passage: "},
                   default_prompt_name="query", truncate_dim=32)
    layout = read_layout(folder)
    assert (layout.prompts, layout.default_prompt_name, layout.truncate_dim) == (
        {"query": "query: ", "document": "passage: "}, "query", 32)
    loaded = load_encoder(folder)[:2]
    for name in ("query", "document"):
        got, encoder = ours(loaded, prompt_name=name)
        want = model.encode(TEXTS, prompt_name=name, convert_to_tensor=True,
                            truncate_dim=64).float()
        assert torch.allclose(got, want, atol=1e-5)
    plain = model.encode(TEXTS, prompt="", convert_to_tensor=True, truncate_dim=64).float()
    assert not torch.allclose(got, plain, atol=1e-3)  # the prompt changes the embedding
    # encode's default: the default prompt, cut at truncate_dim
    default, _ = ours(loaded)
    assert torch.allclose(default[:, :32], model.encode(TEXTS, convert_to_tensor=True),
                          atol=1e-5)
    assert encoder.dimensions == 64 and encoder.truncate_dim == 32


def test_a_legacy_folder_with_a_transformer_subfolder(tiny_model: Path, tmp_path: Path
                                                      ) -> None:
    """As sentence-transformers 2 wrote it: 0_Transformer, pooling flags (mean and max on:
    concatenated cls, max, mean order), a Dense in pytorch_model.bin, Normalize."""
    from builders import legacy_st_folder

    folder = legacy_st_folder(tmp_path / "legacy", tiny_model, WIDTH, 8, 16)
    layout = read_layout(folder)
    assert layout.pooling == ("max", "mean") and layout.max_seq_length == 16
    assert layout.transformer == folder / "0_Transformer"
    assert_encodes_alike(folder, 8)


def test_the_shipped_minilm_saved_again_by_sentence_transformers_6(tmp_path: Path) -> None:
    """The issue's first refusal: MiniLM built and saved again by sentence-transformers 6."""
    from conftest import minilm_folder

    folder = tmp_path / "minilm6"
    model = st.SentenceTransformer(modules=[modules.Transformer(minilm_folder()),
                                            modules.Pooling(384, pooling_mode="mean")])
    model.save(str(folder), create_model_card=False)
    assert not (folder / "sentence_bert_config.json").is_file() or "max_seq_length" not in \
        json.loads((folder / "sentence_bert_config.json").read_text())
    assert read_layout(folder).max_seq_length == model.max_seq_length == 512
    assert_encodes_alike(folder, 384, model)


def test_a_legacy_folder_with_no_mode_on_pools_by_mean(cls_bert_folder: Path,
                                                       tmp_path: Path) -> None:
    folder = shutil.copytree(cls_bert_folder, tmp_path / "none_on")
    (folder / "1_Pooling/config.json").write_text(json.dumps(
        {"word_embedding_dimension": WIDTH, "pooling_mode_cls_token": False}))
    assert read_layout(folder).pooling == ("mean",)
    assert_encodes_alike(folder, WIDTH)


def edited(source: Path, folder: Path, file: str, **changes: Any) -> Path:
    """A copy of `source` with `changes` merged into one of its JSON files."""
    shutil.copytree(source, folder)
    path = folder / file
    data = json.loads(path.read_text()) if path.is_file() else {}
    if isinstance(data, list):
        data[changes.pop("index")].update(changes)
    else:
        data.update(changes)
    path.write_text(json.dumps(data))
    return folder


def test_what_compress_cannot_do_is_one_line_naming_the_module(cls_bert_folder: Path,
                                                               tmp_path: Path) -> None:
    cases = [
        ("modules.json", {"index": 1, "type": "my_package.MyPooling"},
         r"1_Pooling: module my_package.MyPooling is not supported"),
        ("modules.json", {"index": 1, "type": "sentence_transformers.models.LSTM"},
         r"module sentence_transformers.models.LSTM is not supported"),
        ("1_Pooling/config.json", {"pooling_mode": "median"},
         r"1_Pooling/config.json: pooling_mode 'median' is not supported"),
        ("config_sentence_transformers.json", {"prompts": {"query": "q: "}},
         None),  # fine; include_prompt false is the one refused below
    ]
    for i, (file, change, message) in enumerate(cases):
        folder = edited(cls_bert_folder, tmp_path / str(i), file, **change)
        if message is None:
            assert read_layout(folder).prompts == {"query": "q: "}
            (folder / "1_Pooling/config.json").write_text(json.dumps(
                {"embedding_dimension": WIDTH, "pooling_mode": "cls", "include_prompt": False}))
            message = r"1_Pooling/config.json: include_prompt false .* is not supported"
        with pytest.raises(UserError, match=message) as refused:
            read_layout(folder)
        assert "\n" not in str(refused.value)


def test_a_dense_activation_outside_torch_nn_is_refused(tiny_model: Path, tmp_path: Path
                                                        ) -> None:
    folder = tmp_path / "m"
    saved(folder, tiny_model, "mean", modules.Dense(WIDTH, 8, activation_function=torch.nn.Tanh()))
    config = folder / "2_Dense/config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()),
                                  "activation_function": "my_package.Swish"}))
    with pytest.raises(UserError, match=r"2_Dense: Dense activation my_package.Swish is not "
                                        r"supported \(one of torch.nn's Tanh"):
        read_layout(folder)
