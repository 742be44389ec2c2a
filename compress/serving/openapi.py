"""An OpenAPI 3 description of a served causal LM's routes (compress's NDJSON API and the
OpenAI routes), with the limits its archive sets: `compress serve` writes it beside the
server (`<serve folder>/openapi.json`) for clients and API tools, and the fuzz tests drive
schemathesis with it."""

from __future__ import annotations

from typing import Any

ERROR = {"description": "the request is refused, one line says why",
         "content": {"application/json": {"schema": {"type": "object"}}}}
MESSAGES = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"type": "string", "enum": ["system", "user", "assistant"]},
                   "content": {"type": "string"}}}}
STOP = {"oneOf": [{"type": "string", "minLength": 1, "maxLength": 64},
                  {"type": "array", "maxItems": 8,
                   "items": {"type": "string", "minLength": 1, "maxLength": 64}}]}


def _sampling(max_new_tokens: int, new_name: str) -> dict[str, Any]:
    return {new_name: {"type": "integer", "minimum": 1, "maximum": max_new_tokens},
            "temperature": {"type": "number", "minimum": 0, "maximum": 10},
            "top_p": {"type": "number", "minimum": 0, "exclusiveMinimum": True,
                      "maximum": 1},
            "stop": STOP, "seed": {"type": "integer", "minimum": 0},
            "stream": {"type": "boolean"}}


def _post(summary: str, schema: dict[str, Any], streamed: str) -> dict[str, Any]:
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": schema}}},
        "responses": {"200": {"description": "the answer, streamed or whole", "content": {
            streamed: {"schema": {"type": "string"}},
            "application/json": {"schema": {"type": "object"}}}},
            "400": ERROR, "413": ERROR}}}


def lm_openapi(model: str, version: str, max_new_tokens: int) -> dict[str, Any]:
    """The description of model `model` (archive version `version`) under /predictions."""
    native = {"type": "object", "additionalProperties": False,
              "properties": {"prompt": {"type": "string", "minLength": 1},
                             "messages": MESSAGES, **_sampling(max_new_tokens,
                                                               "max_new_tokens")},
              "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}
    chat = {"type": "object", "required": ["messages"],
            "properties": {"model": {"type": "string"}, "messages": MESSAGES,
                           **_sampling(max_new_tokens, "max_tokens")}}
    completion = {"type": "object", "required": ["prompt"],
                  "properties": {"model": {"type": "string"},
                                 "prompt": {"type": "string", "minLength": 1},
                                 **_sampling(max_new_tokens, "max_tokens")}}
    base = f"/predictions/{model}"
    openai = f"{base}/{version}/v1"
    return {
        "openapi": "3.0.3",
        "info": {"title": f"compress: {model}", "version": version},
        "components": {"securitySchemes": {"token": {"type": "http", "scheme": "bearer"}}},
        "security": [{"token": []}],
        "paths": {
            base: _post("generate (NDJSON chunks when streamed)", native,
                        "application/x-ndjson"),
            f"{openai}/chat/completions": _post("OpenAI chat completion", chat,
                                                "text/event-stream"),
            f"{openai}/completions": _post("OpenAI completion", completion,
                                           "text/event-stream"),
            f"{openai}/models": {"get": {"summary": "the served model", "responses": {
                "200": {"description": "OpenAI's model list", "content": {
                    "application/json": {"schema": {"type": "object"}}}}}}},
        },
    }
