"""The causal-LM TorchServe handler in this process (seconds, no Java): TorchServe's own
Context and message encoder, a batch of requests of different lengths with one bad one,
streamed chunks that add up to each answer's text, greedy text equal to batch-1 decoding."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("ts")

from builders import causal_lm_handler, handler_batch, saved_causal_lm  # noqa: E402

from compress.families.causal_lm.folder import load_causal_lm_folder  # noqa: E402
from compress.families.causal_lm.stages.export import export_causal_lm  # noqa: E402
from serve.causal_lm.runtime import loading  # noqa: E402
from serve.causal_lm.server import requests as causal_lm_requests  # noqa: E402
from serve.causal_lm.server.batcher import buckets, fitting_groups  # noqa: E402
from serve.causal_lm.server.handler import CausalLMHandler  # noqa: E402


@pytest.fixture(scope="module")
def handler(varied_llama_folder, tmp_path_factory) -> CausalLMHandler:
    from compress.models.bundle import ModelBundle
    from serve.causal_lm.runtime.loading import load_folder

    folder = tmp_path_factory.mktemp("lm_export") / "transformers"
    lm = load_folder(saved_causal_lm(varied_llama_folder, tmp_path_factory.mktemp("saved")))
    export_causal_lm(ModelBundle(lm.model, "causal-lm", [], tokenizer=lm.tokenizer,
                                 causal_lm_facts=lm.facts),
                     folder)
    return causal_lm_handler(folder, 4, {"threads": 1, "max_new_tokens": 12,
                                         "default_new_tokens": 6, "cache_len": 48,
                                         "compile": "none", "chat_template": False})


def test_a_batch_streams_each_answer_and_refuses_the_bad_one_alone(handler) -> None:
    prompts = ["the film was", "a much longer prompt about a movie that goes on and on", "hi"]
    bodies: list[dict | bytes] = [{"prompt": prompts[0], "max_new_tokens": 12},
                                  {"prompt": "   "},
                                  {"prompt": prompts[1], "max_new_tokens": 5, "stream": False},
                                  {"messages": [{"role": "user", "content": prompts[2]}]}]
    data, context, socket = handler_batch(bodies)
    answers = [json.loads(a) for a in handler.handle(data, context)]
    assert len(answers) == 4
    assert context.get_response_status(1) == (400, "empty prompt: send a non-empty string")
    assert answers[1] == {"error": "empty prompt: send a non-empty string", "status": 400}
    assert [context.get_response_headers(i)["X-Batch-Size"] for i in range(4)] == ["4"] * 4
    assert [a["usage"]["completion_tokens"] for a in (answers[0], answers[2], answers[3])] == [
        12, 5, 6]  # 6: the handler's default_new_tokens
    assert all(answers[i]["finish_reason"] == "length" for i in (0, 2, 3))

    lm = handler.causal_lm  # batched greedy text equals batch-1 decoding of each prompt
    for i, prompt in ((0, prompts[0]), (2, prompts[1]), (3, prompts[2])):
        ids = loading.prompt_ids(lm.tokenizer, prompt, chat_template=False)
        alone = loading.StaticDecoder(lm.model, 48).generate(
            [ids], answers[i]["usage"]["completion_tokens"]).tokens
        assert answers[i]["text"] == lm.tokenizer.decode(alone, skip_special_tokens=True)
        assert answers[i]["usage"]["prompt_tokens"] == len(ids)

    # one intermediate message per step with new text; request 2 asked for no stream
    chunks: dict[str, list[str]] = {}
    for message in socket.messages:
        for request, body in re.findall(rb"(request-\d).*?(\{\"delta\".*?\}\n)", message,
                                        re.S):
            chunks.setdefault(request.decode(), []).append(json.loads(body)["delta"])
    assert set(chunks) == {"request-0", "request-3"} and len(socket.messages) >= 6
    assert "".join(chunks["request-0"]) == answers[0]["text"]
    assert "".join(chunks["request-3"]) == answers[3]["text"]
    assert len(chunks["request-0"]) > 1
    assert context.get_response_headers(0)["ts_stream_next"] == "true"  # set by TorchServe


@pytest.mark.parametrize(("body", "message"), [
    (b'{"prompt": "x"', "malformed JSON"),
    ({"prompt": "x", "max_new_tokens": 13}, "max_new_tokens: an integer from 1 to 12, got 13"),
    ({"prompt": "word " * 60}, "prompt too long: 62 tokens + max_new_tokens 6 exceed the "
     "context of 48 tokens"),
    ({"prompt": "x", "messages": []}, 'give exactly one of "prompt"'),
    ({"prompt": "x", "top_p": 0}, "top_p: must be above 0"),
    ({"prompt": "x", "temprature": 1}, "unknown field 'temprature'"),
    ({"prompt": "x", "stop": 0}, "stop: a string or a list"),  # was read as no stop
    ({"prompt": "x", "stop": False}, "stop: a string or a list"),
    ({"prompt": "x", "stop": ""}, "stop: a string or a list"),
])
def test_bad_requests_get_a_400_that_says_why(handler, body, message) -> None:
    data, context, _ = handler_batch([body, {"prompt": "fine"}])
    answers = [json.loads(a) for a in handler.handle(data, context)]
    assert context.get_response_status(0)[0] == 400
    assert answers[0]["error"].startswith(message), answers[0]
    assert context.get_response_status(1)[0] == 200 and answers[1]["text"]


def test_a_json_string_body_is_a_400_as_on_litserve(handler) -> None:
    """TorchServe's worker hands over an application/json body decoded: a JSON string
    holding an object's text is that string (LitServe parses the bytes once and refuses
    it), not the object parsed a second time."""
    from ts.context import RequestProcessor

    data, context, _ = handler_batch([b"", {"prompt": "fine"}])
    data[0]["body"] = json.dumps({"prompt": "hi"})  # what json.loads of '"{\"prompt..."' gave
    context.request_processor[0] = RequestProcessor({"body": {"content-type": "application/json"}})
    answers = [json.loads(a) for a in handler.handle(data, context)]
    assert context.get_response_status(0)[0] == 400
    assert answers[0]["error"].startswith("send a JSON object"), answers[0]
    assert context.get_response_status(1)[0] == 200 and answers[1]["text"]
    data, context, _ = handler_batch([b""])  # the same text as a plain-text body: parsed
    data[0]["body"] = json.dumps({"prompt": "hi"})
    context.request_processor[0] = RequestProcessor({"body": {"content-type": "text/plain"}})
    handler.handle(data, context)
    assert context.get_response_status(0)[0] == 200


def test_stop_strings_end_the_text_and_are_never_streamed(handler) -> None:
    lm = handler.causal_lm
    ids = loading.prompt_ids(lm.tokenizer, "the film was", chat_template=False)
    tokens = loading.StaticDecoder(lm.model, 48).generate([ids], 12).tokens
    full = lm.tokenizer.decode(tokens, skip_special_tokens=True)
    stop = full.split()[3]  # a word in the middle of the greedy text
    data, context, socket = handler_batch([{"prompt": "the film was", "max_new_tokens": 12,
                                            "stop": [stop]}])
    answer = json.loads(handler.handle(data, context)[0])
    assert answer["text"] == full[:full.index(stop)] and answer["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] < 12
    streamed = b"".join(socket.messages)
    assert stop.encode() not in streamed


def test_buckets_and_groups_keep_shapes_and_the_cache() -> None:
    assert buckets(8) == [1, 2, 4, 8] and buckets(6) == [1, 2, 4, 6] and buckets(1) == [1]
    request = causal_lm_requests.GenerationRequest
    parsed = {0: request([1] * 10, 20), 1: request([1] * 30, 10), 2: request([1] * 5, 5)}
    assert fitting_groups(parsed, 48, 4) == [[0], [1, 2]]  # 30 + 20 would not fit in 48
    assert fitting_groups(parsed, 64, 2) == [[0, 1], [2]]


def test_a_saved_folder_loads_the_same_through_compress_and_the_runtime(
        varied_llama_folder, tmp_path) -> None:
    folder = saved_causal_lm(varied_llama_folder, tmp_path / "saved")
    ours, theirs = load_causal_lm_folder(folder), loading.load_folder(folder)
    assert ours.causal_lm_facts == theirs.facts
    assert all((a == b).all() for a, b in zip(ours.model.state_dict().values(),
                                              theirs.model.state_dict().values(), strict=True))


def test_a_row_whose_logits_allow_no_token_fails_alone_on_the_batch_path(
        handler, monkeypatch) -> None:
    """Its request gets a 500 naming its id alone; the other decodes its tokens."""
    for decoder in handler.decoders.values():
        def poisoned(*args, step=decoder.decode_step, **kwargs):
            logits = step(*args, **kwargs)
            logits[0] = float("nan")
            return logits

        monkeypatch.setattr(decoder, "decode_step", poisoned)
    bodies = [{"prompt": "the film was", "max_new_tokens": 6, "temperature": 0.8, "seed": 1,
               "stream": False},
              {"prompt": "hi", "max_new_tokens": 6, "stream": False}]
    data, context, _ = handler_batch(bodies)
    answers = [json.loads(a) for a in handler.handle(data, context)]
    assert answers[0]["status"] == 500 and "request-0" in answers[0]["error"]
    assert context.get_response_status(0)[0] == 500
    assert answers[1]["finish_reason"] == "length" and answers[1]["usage"][
        "completion_tokens"] == 6
