"""The OpenAI surface real clients use, on a real server (TorchServe, then LitServe: the
`engine` fixture) serving a tiny random Llama with SmolLM2's tokenizer and chat template:
structured output (json_schema, sampled, always valid), tool calls (named, required,
auto; streamed deltas shaped as OpenAI's), logprobs equal to an offline log-softmax, n
choices, the usage chunk, the fields clients send as null, and LangChain's ChatOpenAI
unchanged (invoke, stream, with_structured_output both ways, bind_tools)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path

import pytest
import torch
from conftest import REPO, fuzz_routes, packaged_causal_lm_run, serving

pytest.importorskip("ts")
openai = pytest.importorskip("openai")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

from serve.causal_lm.runtime import loading  # noqa: E402

pytestmark = pytest.mark.serving

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "mood": {"enum": ["happy", "sad"]}},
    "required": ["name", "age", "mood"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def causal_lm_run(smol_tokenizer_llama_folder: Path, tmp_path_factory, data_dir: Path) -> Path:
    """int8_grouped weights, as the shipped LLM recipes: the products are compress's kernels,
    so a greedy row's tokens are its own whatever the batch (the rule of docs/causal-lm.md,
    which test_causal_lm_property asserts); a float model's are MKL's, whose blocking
    follows the row count (on an Emerald Rapids a greedy answer changed beside other rows)."""
    return packaged_causal_lm_run(tmp_path_factory.mktemp("lm_openai"), "smol_lm",
                                  smol_tokenizer_llama_folder,
                                  {"batch_size": 8, "max_new_tokens": 96, "threads": 1}, data_dir,
                                  512, scheme="int8_grouped")


@pytest.fixture(scope="module")
def served(causal_lm_run: Path, state_dir, engine: str) -> dict:
    yield from serving(causal_lm_run, engine, 300)


@pytest.fixture(scope="module")
def offline(causal_lm_run: Path) -> loading.LoadedCausalLM:
    return loading.load_folder(causal_lm_run / "01-export/transformers")  # after 00-quantize


@pytest.fixture(scope="module")
def client(served: dict):
    return openai.OpenAI(base_url=f"{served['url']}/1.0/v1",
                         api_key=served.get("token") or "unused", max_retries=0)


def valid(schema: dict, text: str) -> bool:
    try:
        jsonschema_rs.validate(schema, json.loads(text, parse_float=Decimal))
    except (ValueError, jsonschema_rs.ValidationError):
        return False
    return True


def test_json_schema_answers_always_validate_sampled_and_greedy(client) -> None:
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    texts = []
    for seed in range(4):  # 20 sampled completions at temperature 1
        answer = client.chat.completions.create(
            model="smol_lm", messages=ASK, response_format=response_format, n=5,
            temperature=1.0, seed=seed, max_tokens=60)
        assert len(answer.choices) == 5
        texts += [c.message.content for c in answer.choices]
    assert all(valid(PERSON, t) for t in texts), texts
    assert len(set(texts)) > 5  # sampled: not one answer repeated
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smol_lm", messages=ASK, response_format=response_format, temperature=0,
        max_tokens=60, stream=True) if c.choices)
    assert valid(PERSON, streamed)
    whole = client.chat.completions.create(model="smol_lm", messages=ASK, max_tokens=60,
                                           response_format={"type": "json_object"},
                                           temperature=0)
    assert isinstance(json.loads(whole.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as bad:  # the engine cannot compile it
        client.chat.completions.create(model="smol_lm", messages=ASK, max_tokens=8,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"$ref": "#/$defs/nope"}}})
    assert "schema" in bad.value.message


def offline_logprobs(lm: loading.LoadedCausalLM, ids: list[int], tokens: list[int]
                     ) -> torch.Tensor:
    """log-softmax of the model's logits at each generated position (tokens x vocab)."""
    with torch.no_grad():
        logits = lm.model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_logprobs_equal_an_offline_log_softmax(client, offline) -> None:
    prompt = "the film was"
    ids = loading.prompt_ids(offline.tokenizer, prompt)
    want = loading.StaticDecoder(offline.model, 512).generate(
        [ids], 12, loading.stop_ids(offline.model, offline.tokenizer)).tokens
    expected = offline_logprobs(offline, ids, want)
    answer = client.chat.completions.create(
        model="smol_lm", messages=[{"role": "user", "content": prompt}], max_tokens=12,
        temperature=0, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == len(want)
    for k, (entry, token) in enumerate(zip(content, want, strict=True)):
        assert entry.token == offline.tokenizer.decode([token])
        assert abs(entry.logprob - float(expected[k, token])) < 1e-4
        top = expected[k].topk(3).values.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top, abs=1e-4)
    streamed = [e for c in client.chat.completions.create(
        model="smol_lm", messages=[{"role": "user", "content": prompt}], max_tokens=12,
        temperature=0, logprobs=True, stream=True) if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content],
                                                          abs=1e-6)
    raw_ids = loading.prompt_ids(offline.tokenizer, prompt, chat_template=False)
    completion = client.completions.create(model="smol_lm", prompt=prompt, max_tokens=6,
                                           temperature=0, logprobs=2)
    raw = loading.StaticDecoder(offline.model, 512).generate([raw_ids], 6).tokens
    expected = offline_logprobs(offline, raw_ids, raw)
    got = completion.choices[0].logprobs
    assert got.token_logprobs == pytest.approx(
        [float(expected[k, t]) for k, t in enumerate(raw)], abs=1e-4)
    assert all(len(top) == 2 for top in got.top_logprobs)


def test_echo_with_logprobs_scores_every_prompt_token_as_offline(client, offline) -> None:
    """What lm-eval's local-completions sends for likelihood tasks: prompts as token ids,
    several a request, echo with logprobs; and the openai client's max_tokens=0 form."""
    texts = ["the film was a joy", "a dull, tired and lifeless remake of a remake"]
    prompts = [loading.prompt_ids(offline.tokenizer, t, chat_template=False) for t in texts]
    scored = client.completions.create(model="smol_lm", prompt=texts[0], echo=True,
                                       logprobs=5, max_tokens=0, temperature=0)
    (choice,) = scored.choices
    assert choice.text == texts[0] and scored.usage.completion_tokens == 0
    want = offline_logprobs(offline, prompts[0][:1], prompts[0][1:])
    got = choice.logprobs
    assert got.tokens == [offline.tokenizer.decode([t]) for t in prompts[0]]
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    assert got.token_logprobs[1:] == pytest.approx(
        [float(want[k, t]) for k, t in enumerate(prompts[0][1:])], abs=1e-4)
    assert [sorted(top.values(), reverse=True) for top in got.top_logprobs[1:]] == [
        pytest.approx(want[k].topk(5).values.tolist(), abs=1e-4)
        for k in range(len(prompts[0]) - 1)]
    both = client.completions.create(model="smol_lm", prompt=prompts, echo=True, logprobs=1,
                                     max_tokens=1, temperature=0, seed=1234)
    assert sorted(c.index for c in both.choices) == [0, 1]
    for c in both.choices:
        ids = prompts[c.index]
        assert c.text.startswith(offline.tokenizer.decode(ids))
        assert len(c.logprobs.token_logprobs) == len(ids) + 1  # the prompt, then one token
        want = offline_logprobs(offline, ids[:1], ids[1:])
        assert c.logprobs.token_logprobs[1:len(ids)] == pytest.approx(
            [float(want[k, t]) for k, t in enumerate(ids[1:])], abs=1e-4)
    assert both.usage.prompt_tokens == sum(len(p) for p in prompts)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="smol_lm", prompt=texts[0], echo=True, logprobs=1,
                                  max_tokens=1, stream=True)
    assert "stream: false" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="smol_lm", prompt=[[1, 2, 10**9]], max_tokens=1)
    assert "vocabulary" in bad.value.message


def test_scored_prompts_beside_streaming_chats_answer_as_each_alone(client, offline) -> None:
    """Batch invariance with scoring: a batch of echo + logprobs prompts and streamed chat
    answers, sent together, get what each gets alone, to the bit."""
    texts = ["the film was a joy", "a dull , tired remake", "it 's a charming and often "
             "affecting journey"]
    prompts = [loading.prompt_ids(offline.tokenizer, t, chat_template=False) for t in texts]
    chats = [[{"role": "user", "content": q}] for q in ("Name a colour.", "Count to five.")]

    def scored() -> list[list]:
        answer = client.completions.create(model="smol_lm", prompt=prompts, echo=True,
                                           logprobs=2, max_tokens=3, temperature=0)
        return [[c.logprobs.token_logprobs, c.logprobs.top_logprobs, c.text]
                for c in sorted(answer.choices, key=lambda c: c.index)]

    def chat(messages: list[dict]) -> str:
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="smol_lm", messages=messages, max_tokens=24, temperature=0, stream=True)
            if c.choices)

    alone_scores, alone_chats = scored(), [chat(m) for m in chats]
    with ThreadPoolExecutor(4) as pool:
        together = [pool.submit(chat, chats[0]), pool.submit(scored), pool.submit(chat, chats[1]),
                    pool.submit(scored)]
        got = [f.result(timeout=120) for f in together]
    assert [got[0], got[2]] == alone_chats
    assert got[1] == alone_scores and got[3] == alone_scores


def test_lm_eval_scores_the_endpoint_as_it_scores_the_export_folder(
        served: dict, causal_lm_run: Path, data_dir: Path, monkeypatch) -> None:
    """lm-eval's local-completions through the endpoint (token ids, 4 prompts a request, 2
    requests at once) and its `compress` model on the export folder agree: the two-choice
    task's accuracy exactly, the rolling perplexity within 0.1%."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from compress.families.causal_lm.evaluation_harness import CompressLM

    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    monkeypatch.setenv("OPENAI_API_KEY", served["token"])
    folder = causal_lm_run / "01-export/transformers"
    tasks = TaskManager(include_path=str(REPO / "recipes" / "tasks"))
    scores = {}
    for name, model, args in (
            ("served", "local-completions",
             f"base_url={served['url']}/1.0/v1/completions,tokenizer={folder},"
             "tokenized_requests=True,batch_size=4,num_concurrent=2,max_retries=1"),
            ("offline", CompressLM(str(folder)), None)):
        scores[name] = lm_eval.simple_evaluate(
            model=model, model_args=args, tasks=["sst2_local", "sst2_rolling"],
            task_manager=tasks, limit=16, log_samples=False)["results"]
    served_scores, offline_scores = scores["served"], scores["offline"]
    assert served_scores["sst2_local"]["acc,none"] == offline_scores["sst2_local"]["acc,none"]
    assert served_scores["sst2_rolling"]["word_perplexity,none"] == pytest.approx(
        offline_scores["sst2_rolling"]["word_perplexity,none"], rel=1e-3)
    assert 1 < offline_scores["sst2_rolling"]["word_perplexity,none"] < float("inf")


def test_n_choices_the_usage_chunk_and_what_clients_send_as_null(client, served) -> None:
    three = client.chat.completions.create(model="smol_lm", messages=ASK, n=3, max_tokens=6,
                                           temperature=1.0, seed=7, logprobs=True)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert len({c.message.content for c in three.choices}) > 1  # each choice its own sample
    assert three.usage.completion_tokens == sum(len(c.logprobs.content) for c in three.choices)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="smol_lm", messages=ASK, n=2,
                                                max_tokens=6, temperature=0, stream=True):
        for choice in chunk.choices:  # each choice's deltas under its index
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert set(texts) == {0, 1} and texts[0] == texts[1]  # greedy: the same text twice
    assert finishes[0] and finishes[1]
    chunks = list(client.chat.completions.create(
        model="smol_lm", messages=ASK, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.chat.completions.create(model="smol_lm", messages=ASK, max_tokens=5,
                                                temperature=0, stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason
    # the opening cases of the issue: each accepted, as OpenAI documents it
    import urllib.request

    body = {"model": "smol_lm", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is "}, {"type": "text", "text": "the weather?"}]}],
        "logprobs": False, "response_format": {"type": "text"}, "temperature": None,
        "stream": None, "max_completion_tokens": None, "max_tokens": 5, "user": "u1",
        "metadata": {"k": "v"}, "store": False}
    request = urllib.request.Request(
        f"{served['url']}/1.0/v1/chat/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {served['token']}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    assert answer["usage"]["completion_tokens"] == 5 or answer["choices"][0][
        "finish_reason"] == "stop"
    assert answer["choices"][0]["logprobs"] is None
    with pytest.raises(openai.BadRequestError) as bad:  # changes the output: named
        client.chat.completions.create(model="smol_lm", messages=ASK, max_tokens=4,
                                       extra_body={"mirostat": 2})
    assert "mirostat" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="smol_lm", prompt="a", suffix="b", max_tokens=4)
    assert "suffix" in bad.value.message
    echoed = client.completions.create(model="smol_lm", prompt="the film", max_tokens=4,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("the film")


def test_tool_calls_named_required_and_streamed_validate_their_arguments(client) -> None:
    named = client.chat.completions.create(
        model="smol_lm", messages=ASK, tools=[WEATHER, TIME], max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert valid(WEATHER["function"]["parameters"], call.function.arguments)
    required = client.chat.completions.create(
        model="smol_lm", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        max_tokens=80, temperature=1.0, seed=3, parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    tool = {"get_weather": WEATHER, "get_time": TIME}[calls[0].function.name]
    assert valid(tool["function"]["parameters"], calls[0].function.arguments)
    # streamed: OpenAI's deltas (index, id, name, then the arguments), finish tool_calls
    deltas, finish = [], None
    for chunk in client.chat.completions.create(
            model="smol_lm", messages=ASK, tools=[WEATHER], tool_choice="required",
            max_tokens=80, temperature=0, stream=True):
        if chunk.choices:
            deltas += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and deltas[0].id and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
    assert valid(WEATHER["function"]["parameters"], arguments)
    # the call's answer goes back as a tool message; auto may answer in text
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    auto = client.chat.completions.create(model="smol_lm", messages=history, tools=[WEATHER],
                                          max_tokens=80, temperature=0)
    message = auto.choices[0].message
    assert (message.tool_calls is None) != (message.content is None)
    none = client.chat.completions.create(model="smol_lm", messages=ASK, tools=[WEATHER],
                                          tool_choice="none", max_tokens=6, temperature=0)
    assert none.choices[0].message.tool_calls is None


def test_langchain_chat_openai_works_unchanged(served: dict) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)

    class GetWeather(BaseModel):
        """The weather in a city."""

        city: str = Field(max_length=16)

    chat = langchain_openai.ChatOpenAI(
        model="smol_lm", base_url=f"{served['url']}/1.0/v1", api_key=served["token"],
        temperature=0, max_tokens=40, max_retries=0)
    said = chat.invoke("What is the weather in Paris?")
    assert isinstance(said.content, str) and said.usage_metadata["output_tokens"] > 0
    pieces = [c.content for c in chat.stream("What is the weather in Paris?")]
    assert len(pieces) > 1 and "".join(pieces) == said.content
    for method in ("json_schema", "function_calling"):
        person = chat.with_structured_output(Person, method=method).invoke("Describe a person")
        assert isinstance(person, Person), method
    bound = chat.bind_tools([GetWeather], tool_choice="GetWeather")
    call = bound.invoke("What is the weather in Paris?").tool_calls[0]
    assert call["name"] == "GetWeather" and GetWeather(**call["args"])


def test_fuzzing_the_new_fields_on_a_grammar_capable_archive_gets_no_server_error(
        served: dict, client) -> None:
    """schemathesis over the routes with structured output, tools, logprobs and n (this
    archive's tokenizer takes grammars: fuzzed schemas reach the engine); then a good
    request is still answered."""
    fuzz_routes(served, "smol_lm")
    answer = client.chat.completions.create(model="smol_lm", messages=ASK, max_tokens=4,
                                            temperature=0)
    assert answer.choices[0].finish_reason in ("length", "stop")
