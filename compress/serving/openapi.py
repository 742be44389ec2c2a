"""An OpenAPI 3 description of a served causal LM's routes (compress's NDJSON API, and the
OpenAI routes where its handler answers them), with the limits its archive sets: `compress
serve` writes it beside the server (`<serve folder>/openapi.json`) for clients and API tools,
and the fuzz tests drive schemathesis with it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

ERROR = {"description": "the request is refused, one line says why",
         "content": {"application/json": {"schema": {"type": "object"}}}}
MESSAGES = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"type": "string", "enum": ["system", "user", "assistant"]},
                   "content": {"type": "string"}}}}
STOP = {"oneOf": [{"type": "string", "minLength": 1, "maxLength": 64},
                  {"type": "array", "maxItems": 8,
                   "items": {"type": "string", "minLength": 1, "maxLength": 64}}]}


PART = {"type": "object", "required": ["type", "text"],
        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
CHAT_MESSAGES = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role"],
    "properties": {"role": {"type": "string",
                            "enum": ["system", "developer", "user", "assistant", "tool"]},
                   "content": {"oneOf": [{"type": "string"},
                                         {"type": "array", "items": PART}]},
                   "tool_call_id": {"type": "string"}}}}
SCHEMA = {"type": "object"}  # any JSON schema
TOOLS = {"type": "array", "maxItems": 4, "items": {
    "type": "object", "required": ["type", "function"],
    "properties": {"type": {"type": "string", "enum": ["function"]},
                   "function": {"type": "object", "required": ["name"], "properties": {
                       "name": {"type": "string", "minLength": 1, "maxLength": 64},
                       "description": {"type": "string"}, "parameters": SCHEMA}}}}}
# OpenAI's options beyond sampling that the routes take
CHAT_OPTIONS = {
    "n": {"type": "integer", "minimum": 1, "maximum": 8},
    "logprobs": {"type": "boolean"},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "response_format": {"oneOf": [
        {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"type": "string", "enum": ["json_schema"]},
            "json_schema": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"}, "schema": SCHEMA,
                "strict": {"type": "boolean"}}}}}]},
    "tools": TOOLS,
    "tool_choice": {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                              {"type": "object"}]},
    "parallel_tool_calls": {"type": "boolean"}, "user": {"type": "string"}}
COMPLETION_OPTIONS = {"n": {"type": "integer", "minimum": 1, "maximum": 8},
                      "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
                      "echo": {"type": "boolean"}, "user": {"type": "string"}}


def _sampling(max_new_tokens: int, new_name: str) -> dict[str, Any]:
    return {new_name: {"type": "integer", "minimum": 1, "maximum": max_new_tokens},
            "temperature": {"type": "number", "minimum": 0, "maximum": 10},
            "top_p": {"type": "number", "minimum": 0, "exclusiveMinimum": True,
                      "maximum": 1},
            "stop": STOP, "seed": {"type": "integer", "minimum": 0},
            "ignore_eos": {"type": "boolean"}, "stream": {"type": "boolean"}}


def _post(summary: str, schema: dict[str, Any], streamed: str) -> dict[str, Any]:
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": schema}}},
        "responses": {"200": {"description": "the answer, streamed or whole", "content": {
            streamed: {"schema": {"type": "string"}},
            "application/json": {"schema": {"type": "object"}}}},
            "400": ERROR, "413": ERROR}}}


def openai_routes(config: dict[str, Any]) -> bool:
    """Whether an archive of this model-config answers the OpenAI routes: its continuous
    batch does (`asyncCommunication`, one process); a tensor- or pipeline-parallel worker
    (`parallelType`, a torchrun job) decodes TorchServe's batches, native requests alone."""
    return bool(config.get("asyncCommunication")) and not config.get("parallelType")


def causal_lm_openapi(model: str, version: str, max_new_tokens: int,
                      openai_paths: bool = True) -> dict[str, Any]:
    """The description of model `model` (archive version `version`) under /predictions,
    with the OpenAI routes where `openai_paths`."""
    native = {"type": "object", "additionalProperties": False,
              "properties": {"prompt": {"type": "string", "minLength": 1},
                             "messages": MESSAGES, **_sampling(max_new_tokens,
                                                               "max_new_tokens")},
              "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}
    chat = {"type": "object", "required": ["messages"],
            "properties": {"model": {"type": "string"}, "messages": CHAT_MESSAGES,
                           **_sampling(max_new_tokens, "max_tokens"), **CHAT_OPTIONS}}
    completion = {"type": "object", "required": ["prompt"],
                  "properties": {"model": {"type": "string"},
                                 "prompt": {"type": "string", "minLength": 1},
                                 **_sampling(max_new_tokens, "max_tokens"),
                                 **COMPLETION_OPTIONS}}
    base = f"/predictions/{model}"
    openai = f"{base}/{version}/v1"
    paths = {base: _post("generate (NDJSON chunks when streamed)", native,
                         "application/x-ndjson")}
    if openai_paths:
        paths |= {
            f"{openai}/chat/completions": _post("OpenAI chat completion", chat,
                                                "text/event-stream"),
            f"{openai}/completions": _post("OpenAI completion", completion,
                                           "text/event-stream"),
            f"{openai}/models": {"get": {"summary": "the served model", "responses": {
                "200": {"description": "OpenAI's model list", "content": {
                    "application/json": {"schema": {"type": "object"}}}}}}}}
    return {
        "openapi": "3.0.3",
        "info": {"title": f"compress: {model}", "version": version},
        "components": {"securitySchemes": {"token": {"type": "http", "scheme": "bearer"}}},
        "security": [{"token": []}],
        "paths": paths,
    }


def write_openapi(model_folder: Path, serve_dir: Path, model: str) -> Path | None:
    """`<serve_dir>/openapi.json` for an unpacked causal-LM archive (None for others)."""
    config = yaml.safe_load((model_folder / "model-config.yaml").read_text()) or {}
    handler = config.get("handler") or {}
    if handler.get("task") != "causal-lm":
        return None
    manifest = json.loads((model_folder / "MAR-INF" / "MANIFEST.json").read_text())
    version = str(manifest.get("model", {}).get("modelVersion") or "1.0")
    path = serve_dir / "openapi.json"
    description = causal_lm_openapi(model, version, int(handler["max_new_tokens"]),
                                    openai_routes(config))
    path.write_text(json.dumps(description, indent=2))
    return path
