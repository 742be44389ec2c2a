"""Small models, data and stage contexts that the unit and integration tests share."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from compress.algorithms.pruning import select_layers
from compress.data.datasets import DataBundle, Examples
from compress.models.bundle import ModelBundle
from compress.pipeline.loop import run_recipe
from compress.recipe.schema import load_recipe
from compress.stages.context import StageContext

SENTENCES = ["a good movie", "an awful, dull and boring film that never ends at all",
             "superb", "warm and happy and brilliant, a lovely story", "cold",
             "fine", "the plot is poor but the actors are great", "sad"]
EXCLUDE = ["*embeddings*", "*classifier*", "*pooler*"]  # what structured pruning leaves


SST2 = "stanfordnlp/sst2"
GENERATION = {"prompts": 3, "max_new_tokens": 6, "batch_sizes": [1, 2], "compile": "none"}


def run_in_process(recipe_path: Path) -> dict:
    """Run a recipe file in this process (quietly); return its manifest."""
    run_dir = run_recipe(load_recipe(recipe_path), echo=lambda _: None)
    return json.loads((run_dir / "manifest.json").read_text())


def export_text_recipe(model: Path, sentiment_dir: Path, out: Path, exports: list[dict]) -> dict:
    """A tiny BERT fine-tuned on a sentiment table, then the given export stages."""
    return {
        "name": "tiny_export",
        "model": {"source": str(model)},
        "data": {"source": str(sentiment_dir), "text_column": "sentence", "max_length": 32,
                 "calibration": {"split": "train", "max_samples": 64}},
        "stages": [{"kind": "finetune", "epochs": 6, "batch_size": 16, "learning_rate": 1e-3},
                   *exports],
        "evaluation": {"latency": {"batch_sizes": [1, 8], "seq_len": 16, "iters": 2,
                                   "warmup": 1}},
        "output_dir": str(out),
    }


# ---- quantization ----------------------------------------------------------------------------

def stage_quantize(bundle: ModelBundle, cfg, ctx: StageContext):
    """The library call as the quantize stage makes it, from a stage context (torchao
    imported here, not by every test that loads this module)."""
    from compress.algorithms.quantization import quantize

    return quantize(bundle, cfg, ctx.data.splits.get("calibration"),
                    setup=ctx.training() if cfg.mode == "qat" else None,
                    max_length=ctx.data.max_length)


def stage_context(tmp_path: Path, data: DataBundle, kind: str = "quantize") -> StageContext:
    """A quiet context for stage 0 of a run in `tmp_path`."""
    return StageContext(0, kind, tmp_path / "stage", tmp_path, None, data, "key", 0,
                        log=lambda _: None)


def digits_like(n: int = 64, seed: int = 0) -> DataBundle:
    """`n` random 8x8 images with labels 0-9 as the train and calibration splits."""
    gen = torch.Generator().manual_seed(seed)
    examples = Examples(labels=[i % 10 for i in range(n)],
                        inputs=torch.rand(n, 1, 8, 8, generator=gen))
    splits = {"calibration": examples, "train": examples}
    return DataBundle("image", splits, [str(i) for i in range(10)], input_shape=[1, 8, 8])


def real_digits(n: int = 400) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `n` real scikit-learn digits (8x8, scaled to [0, 1]) and their labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images[:n] / 16.0, dtype=torch.float32).unsqueeze(1)
    return x, torch.tensor(digits.target[:n])


def image_bundle(model: nn.Module) -> ModelBundle:
    """An 8x8 image classifier as the `compress.models.zoo:mlp` factory bundle."""
    return ModelBundle(model.eval(), "factory", [str(i) for i in range(10)],
                       factory="compress.models.zoo:mlp", input_shape=[1, 8, 8])


class DataDependent(nn.Module):
    """Branches on a tensor's value: torch.export cannot capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        if x.sum() > 0:
            return self.linear(x)
        return -self.linear(x)


# ---- pruning ---------------------------------------------------------------------------------

def random_bert(vocab_size: int = 100) -> nn.Module:
    """A 2-layer BERT classifier (hidden 32, 4 heads, FFN 64) with seeded random weights."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, num_labels=2)
    return BertForSequenceClassification(config).eval()


def input_ids(vocab_size: int = 100) -> torch.Tensor:
    """Three seeded rows of 12 token ids."""
    return torch.randint(0, vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def chosen(model: nn.Module) -> dict[str, nn.Module]:
    """Every prunable layer but the embeddings, classifier and pooler."""
    return select_layers(model, ["*"], EXCLUDE)


# ---- embedding models ------------------------------------------------------------------------

def cls_bert_folder(folder: Path, init_std: float = 0.02, dropout: float = 0.1) -> Path:
    """A random-init BERT sentence-transformers folder in `folder`: CLS pooling, no Normalize
    (2 layers, 32 wide, MiniLM's tokenizer, weights drawn at `init_std`, `dropout` on hidden
    states and attention when training)."""
    from conftest import minilm_folder
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=64,
                         initializer_range=init_std, hidden_dropout_prob=dropout,
                         attention_probs_dropout_prob=dropout)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling/config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": True,
         "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False}))
    return folder


def stand_in_embedding_export(model_folder: Path, folder: Path, monkeypatch) -> list[tuple]:
    """An AOTInductor embedding export folder at `folder` (`model_folder`'s tokenizer and
    config, max_seq_length 64) whose program, as `serve.runtimes.load_runtime` loads it, is
    a stand-in: each row's embedding is its length in tokens. Returns the list the stand-in
    appends each pass's (rows, length) to."""
    import shutil

    import serve.runtimes

    shutil.copytree(model_folder, folder)
    (folder / "export.json").write_text(json.dumps(
        {"format": "aoti", "file": "model.pt2", "inputs": ["input_ids", "attention_mask"],
         "outputs": ["embedding"], "embedding": {"max_seq_length": 64}}))
    shapes: list[tuple] = []

    def fake_runtime(folder, meta, threads, spinning=True):
        def run(ids, mask):
            shapes.append(tuple(ids.shape))
            return mask.sum(-1, keepdim=True).float()
        return run

    monkeypatch.setattr(serve.runtimes, "load_runtime", fake_runtime)
    return shapes


# ---- causal LMs ------------------------------------------------------------------------------

def causal_lm_recipe(tmp_path: Path, model: Path, stages: list[dict], train_samples: int = 0,
                     calibration_samples: int = 0, **extra) -> Path:
    """A recipe of `stages` on a tiny causal LM and SST-2 text (with `train_samples` train
    sentences and `calibration_samples` calibration ones, from the train split, if any)."""
    from conftest import write_recipe

    train = {"train": {"split": "train", "max_samples": train_samples}} if train_samples else {}
    if calibration_samples:
        train["calibration"] = {"split": "train", "max_samples": calibration_samples}
    raw = {"name": "tiny_lm", "model": {"source": str(model)},
           "data": {"source": SST2, "text_column": "sentence", "max_length": 32, **train,
                    "eval": {"split": "validation", "max_samples": 12}},
           "evaluation": {"generation": GENERATION},
           "stages": stages, "output_dir": str(tmp_path / "runs"), **extra}
    return write_recipe(tmp_path / "lm.yaml", raw)


def saved_causal_lm(source: Path, folder: Path) -> Path:
    """A causal LM folder as a stage saves it (causal_lm.json beside the HF files)."""
    from compress.families.causal_lm.folder import load_recipe_causal_lm, save_causal_lm

    save_causal_lm(load_recipe_causal_lm(str(source)), folder)
    return folder


class Socket:
    """Collects what a handler sends TorchServe's frontend between batches."""

    def __init__(self) -> None:
        self.messages: list[bytes] = []

    def sendall(self, message: bytes) -> None:
        self.messages.append(bytes(message))


def causal_lm_handler(folder: Path, batch_size: int, settings: dict, **config: object):
    """A causal-LM handler started on an exported folder as a TorchServe worker starts it:
    `settings` are the archive's handler settings, `config` more of its model-config (such
    as asyncCommunication)."""
    from ts.context import Context

    from serve.causal_lm.server.handler import CausalLMHandler

    model_config = {"batchSize": batch_size, "maxWorkers": 1, "handler": settings, **config}
    handler = CausalLMHandler()
    handler.initialize(Context("tiny_lm", str(folder), {}, batch_size, None, "0.12.0",
                               model_yaml_config=model_config))
    return handler


def handler_batch(bodies: list[dict | bytes]):
    """TorchServe's (data, Context, socket) for one batch of request bodies."""
    from ts.context import Context, RequestProcessor

    context = Context("tiny_lm", "", {}, len(bodies), None, "0.12.0")
    context.request_ids = {i: f"request-{i}" for i in range(len(bodies))}
    context.request_processor = [RequestProcessor({}) for _ in bodies]
    socket = Socket()
    context.cl_socket = socket
    data = [{"body": b if isinstance(b, bytes) else json.dumps(b).encode()} for b in bodies]
    return data, context, socket


def q4_1(weight: torch.Tensor) -> torch.Tensor:
    """The weight as llama.cpp's Q4_1 stores it: per 32 inputs, 16 levels from a float16
    minimum in float16 steps."""
    groups = weight.reshape(weight.shape[0], -1, 32)
    low = groups.amin(-1, keepdim=True).half().float()
    step = ((groups.amax(-1, keepdim=True) - low) / 15).half().float()
    levels = torch.round((groups - low) / step).clamp(0, 15)
    return (levels * step + low).reshape(weight.shape)


def q8_0(weight: torch.Tensor) -> torch.Tensor:
    """Q8_0: per 32 inputs, int8 levels of a float16 step amax / 127."""
    groups = weight.reshape(weight.shape[0], -1, 32)
    step = (groups.abs().amax(-1, keepdim=True) / 127).half().float()
    return (torch.round(groups / step).clamp(-127, 127) * step).reshape(weight.shape)


def grouped_module(bits: int, half: bool, seed: int, activations: str):
    """A packed 96 -> 77 `GroupedLinear` in an activation mode, its records float16
    (`half`) or float32 (scales and offsets that float16 does not hold)."""
    from serve.causal_lm.runtime import grouped

    torch.manual_seed(seed)
    module = grouped.GroupedLinear.from_linear(nn.Linear(96, 77), 32, bits)
    if not half:
        module.scale.mul_(1 + 2 ** -20)
        module.offset.add_(2 ** -21)
    else:
        module.scale.copy_(module.scale.half().float())
        module.offset.copy_(module.offset.half().float())
    module.pack()
    assert module.half_scales == half and module.packed is not None
    module.activations = activations
    return module


def embedding_recipe(model: Path, data: Path, out: Path, stages: list[dict]) -> dict:
    """A sentence-transformers folder through `stages` on a sentiment table (k-NN labels)."""
    return {"name": "tiny_embed_run", "model": {"source": str(model), "task": "embedding"},
            "data": {"source": str(data), "text_column": "sentence", "max_length": 32,
                     "train": {"split": "train"},
                     "calibration": {"split": "train", "max_samples": 32},
                     "eval": {"split": "validation"}},
            "stages": stages,
            "evaluation": {"batch_size": 16,
                           "latency": {"batch_sizes": [1, 4], "seq_len": 16, "iters": 2,
                                       "warmup": 1}},
            "output_dir": str(out), "seed": 0}


def tiny_bert_folder(folder: Path, width: int = 32, positions: int = 128) -> Path:
    """A 2-layer random BertModel of `width` with MiniLM's tokenizer (a Hugging Face folder),
    seeded: the transformer of the sentence-transformers layout tests."""
    from conftest import minilm_folder
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=width,
                         num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                         max_position_embeddings=positions)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def legacy_st_folder(folder: Path, bert: Path, width: int, dense_out: int,
                     max_seq_length: int, bias_scale: float = 1.0) -> Path:
    """A sentence-transformers folder as version 2 wrote it around `bert`: a
    `0_Transformer` subfolder with its sentence_bert_config.json, pooling flags (mean and
    max on), a Tanh Dense to `dense_out` in pytorch_model.bin (seeded), Normalize."""
    import shutil

    shutil.copytree(bert, folder / "0_Transformer")
    (folder / "0_Transformer/sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}))
    kinds = ["Transformer", "Pooling", "Dense", "Normalize"]
    paths = ["0_Transformer", "1_Pooling", "2_Dense", "3_Normalize"]
    (folder / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{k}"}
        for i, (k, p) in enumerate(zip(kinds, paths, strict=True))]))
    for path in paths[1:]:
        (folder / path).mkdir()
    (folder / "1_Pooling/config.json").write_text(json.dumps(
        {"word_embedding_dimension": width, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True,
         "pooling_mode_mean_sqrt_len_tokens": False}))
    (folder / "2_Dense/config.json").write_text(json.dumps(
        {"in_features": 2 * width, "out_features": dense_out, "bias": True,
         "activation_function": "torch.nn.modules.activation.Tanh"}))
    torch.manual_seed(2)
    torch.save({"linear.weight": torch.randn(dense_out, 2 * width) / 8,
                "linear.bias": torch.randn(dense_out) * bias_scale},
               folder / "2_Dense/pytorch_model.bin")
    return folder


def shipped_graphs(tmp_path: Path) -> Path:
    """An archive's compiled_graphs/ folder with an Inductor cache, built for this CPU."""
    from serve.causal_lm.server import compiled_graphs

    folder = tmp_path / compiled_graphs.FOLDER
    (folder / compiled_graphs.INDUCTOR / "fxgraph").mkdir(parents=True)
    (folder / compiled_graphs.INDUCTOR / "fxgraph" / "entry").write_text("a graph")
    (folder / compiled_graphs.TARGET).write_text(json.dumps(compiled_graphs.target()))
    return folder
