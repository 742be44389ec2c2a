"""EleutherAI's lm-evaluation-harness (lm-eval) over a causal-LM export folder: the model
`compress`, which loads the folder through the shipped runtime (`serve.causal_lm.runtime
.loading`: its real weights, grouped int8/int4, 2:4 or experts, in the activation mode its
facts name) and answers lm-eval's three request kinds: loglikelihood, rolling
loglikelihood and generation.

lm-eval's own CLI finds no model outside its package (its registry reads no entry points),
so `compress-lm-eval` is lm-eval's CLI with `compress` registered first:

    compress-lm-eval --model compress --model_args folder=runs/llm_int8/02-export/transformers \\
        --tasks sst2_local --include_path recipes/tasks --limit 100

In Python: `lm_eval.simple_evaluate(model=CompressLM(folder), tasks=[...])`.

Scores are the served prefill's over each request's tokens (`CompressLM.token_logprobs`), one
request at a time (a request's score never depends on what else is scored beside it),
log-softmax in float32: what the served `/v1/completions` returns for `echo` with
`logprobs`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401 (lm-eval's own models: registered before ours, or never)
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from serve.causal_lm.runtime import loading
from serve.causal_lm.runtime.attention import attention, decode_attention_for
from serve.causal_lm.server.prefill import Prefiller
from serve.causal_lm.server.rows import Row

DEFAULT_MAX_LENGTH = 2048  # tokens a forward scores at most (a rolling window's length)
LOCAL_TASKS = Path(__file__).resolve().parents[3] / "recipes" / "tasks"  # over local data


@register_model("compress")
class CompressLM(LM):
    """A causal-LM export folder as an lm-eval model (`folder=`; `max_length=`: the longest
    forward, at most the model's context)."""

    def __init__(self, folder: str | None = None, max_length: int | str | None = None,
                 batch_size: int | str = 1, loaded: loading.LoadedCausalLM | None = None,
                 **_: Any) -> None:
        super().__init__()
        if loaded is None:
            path = Path(folder or ".")
            if folder is None or not (path / loading.CAUSAL_LM_FILE).is_file():
                raise ValueError(f"{folder}: not a causal-LM export folder (no "
                                 f"{loading.CAUSAL_LM_FILE}); pass folder=<run>/NN-export/"
                                 "transformers")
            loaded = loading.load_folder(path)
        self.lm = loaded
        self.prefiller: Prefiller | None = None  # made at the first score (its cache's length)
        context = int(getattr(self.lm.model.config, "max_position_embeddings", 0) or 0)
        wanted = int(max_length) if max_length else DEFAULT_MAX_LENGTH
        self.max_length = min(wanted, context) if context else wanted
        self.stop = loading.stop_ids(self.lm.model, self.lm.tokenizer)
        # what precedes a text scored from its start: the beginning token, else the end one
        # (lm-eval's own models' choice, so that both score the same tokens)
        tokenizer = self.lm.tokenizer
        first = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else \
            tokenizer.eos_token_id
        self.prefix_token = int(first if isinstance(first, int) else sorted(self.stop)[0])

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.lm.tokenizer(text, add_special_tokens=False)["input_ids"]]

    @torch.inference_mode()
    def token_logprobs(self, ids: list[int]) -> tuple[list[float], list[bool]]:
        """For each token of `ids` after the first: its log-probability after the tokens
        before it, and whether it is the likeliest token there. Scored as the served
        prefill scores a prompt (`serve.causal_lm.server.prefill`: the runtime's decode
        attention, the same chunks), so that these are the endpoint's numbers for echo with
        logprobs in every activation mode: in the int8 mode, another attention's rounding
        flips some activations' int8 codes (transformers' SDPA put SmolLM2's scores up to
        0.24 nats a token away from the runtime's)."""
        model = self.lm.model
        if self.prefiller is None:
            self.prefiller = Prefiller(model, self.max_length + 1)
        row = Row(ids, 0, lambda token, end: None, logprobs=1, score_prompt=True)
        with attention(model, decode_attention_for(model)):
            job = self.prefiller.start([row])
            while not job.finished:
                self.prefiller.step(job, whole=True)
        self.prefiller.release(job)
        scored = job.prompt_scores(0)
        return ([logprob for logprob, _ in scored],
                [rivals[0][0] == token for (_, rivals), token in zip(scored, ids[1:],
                                                                     strict=True)])

    def _continuation(self, context: list[int], continuation: list[int]
                      ) -> tuple[float, bool]:
        """The log-probability of `continuation` after `context` (the last max_length
        tokens of both), and whether each of its tokens is the greedy one."""
        ids = (context + continuation)[-(self.max_length + 1):]
        scores, greedy = self.token_logprobs(ids)
        count = len(continuation)
        return float(sum(scores[-count:])), all(greedy[-count:])

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False
                      ) -> list[tuple[float, bool]]:
        answers = []
        for request in shown(requests, "loglikelihood", disable_tqdm):
            context, continuation = request.args
            if context:  # the continuation's tokens as lm-eval's own models split them
                whole = self.encode(context + continuation)
                context_ids = self.encode(context)
                context_ids, continuation_ids = whole[:len(context_ids)], whole[
                    len(context_ids):]
            else:
                context_ids, continuation_ids = [self.prefix_token], self.encode(continuation)
            answers.append(self._continuation(context_ids, continuation_ids))
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False
                              ) -> list[float]:
        answers = []
        for request in shown(requests, "rolling loglikelihood", disable_tqdm):
            (text,) = request.args
            total = 0.0
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    self.encode(text), self.prefix_token, self.max_length, 1)):
                total += self._continuation(list(context), list(continuation))[0]
            answers.append(total)
        return answers

    @torch.inference_mode()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        answers = []
        for request in shown(requests, "generation", disable_tqdm):
            context, options = request.args
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(options.get("max_gen_toks", 256))
            ids = self.encode(context)[-(self.max_length - new):]
            decoder = loading.StaticDecoder(self.lm.model, len(ids) + new)
            tokens = decoder.generate([ids], new, self.stop).tokens
            text = self.lm.tokenizer.decode(tokens, skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0]
            answers.append(text)
        return answers


def shown(requests: list[Any], what: str, disabled: bool) -> Any:
    """`requests` with a progress bar (rate and ETA) on a terminal, quiet elsewhere."""
    return tqdm(requests, desc=f"compress {what}", unit="req",
                disable=disabled or not sys.stderr.isatty())


def task_scores(model: Any, tokenizer: Any, tasks: list[str], limit: int | None = None,
                include_path: str | Path | None = None, max_length: int = DEFAULT_MAX_LENGTH
                ) -> dict[str, float]:
    """lm-eval's scores of `tasks` for an in-memory causal LM (`model`, `tokenizer`), as
    metrics named `lm_eval_<task>_<metric>` (their standard errors left out); local
    task files from `include_path` (default: LOCAL_TASKS)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    lm = CompressLM(loaded=loading.LoadedCausalLM(model.eval(), tokenizer, {}),
                    max_length=max_length)
    folder = Path(include_path or LOCAL_TASKS)
    manager = TaskManager(include_path=str(folder))
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        local = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
        raise ValueError(f"task {unknown[0]!r} not found: not one of lm-eval's, nor in "
                         f"{folder} ({local or 'no task files'})")
    results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager,
                                      limit=limit, log_samples=False)["results"]
    scores = {}
    for task, figures in results.items():
        for name, value in figures.items():  # "acc,none": a metric under its filter
            metric = name.split(",")[0]
            if "," in name and isinstance(value, int | float) and not metric.endswith("_stderr"):
                scores[f"lm_eval_{task}_{metric}"] = round(float(value), 6)
    return scores


def main() -> None:
    """lm-eval's command line, with the `compress` model registered (by this import)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
