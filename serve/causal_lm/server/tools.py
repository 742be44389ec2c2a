"""OpenAI's tool calls for a model whose chat template knows no tools (SmolLM2's, and most
small models'), as llama-server's "generic" format does: the tools are described in a
system message, the answer is constrained to JSON (`grammar.py`), either
`{"tool_calls": [{"name", "arguments"}]}` with each function's arguments valid against its
schema, or, where the model may choose (`tool_choice: auto`), `{"response": text}`; the
JSON is then read back into OpenAI's `tool_calls` or `content` (no torch; shipped in
`causal_lm`)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

ANY_OBJECT: dict[str, Any] = {"type": "object"}
MAX_SCHEMA_DEPTH = 64  # levels of JSON (objects and lists) in a schema: deeper is a 400


@dataclass(frozen=True)
class ToolUse:
    """The tools a request offers and how the answer may use them: `mode` "auto" (a call
    or a text answer), "required" (one call or more) or a function's name (that one)."""

    functions: tuple[dict[str, Any], ...]  # {"name", "description", "parameters"}
    mode: str
    parallel: bool = False  # more than one call in an answer (`parallel_tool_calls: true`)

    def schema(self) -> dict[str, Any]:
        """The JSON schema of the answer."""
        chosen = [f for f in self.functions if self.mode in ("auto", "required")
                  or f["name"] == self.mode]
        call = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": f["name"]}, "arguments": closed(f.get("parameters") or ANY_OBJECT)},
            "required": ["name", "arguments"], "additionalProperties": False}
            for f in chosen]}
        calls = {"type": "array", "items": call, "minItems": 1}
        if not self.parallel:
            calls["maxItems"] = 1
        answer = {"type": "object", "properties": {"tool_calls": calls},
                  "required": ["tool_calls"], "additionalProperties": False}
        if self.mode != "auto":
            return answer
        text = {"type": "object", "properties": {"response": {"type": "string"}},
                "required": ["response"], "additionalProperties": False}
        return {"anyOf": [answer, text]}

    def instructions(self) -> str:
        """The system message's text that describes the tools and the answer's form."""
        listed = json.dumps([{k: f[k] for k in ("name", "description", "parameters") if k in f}
                             for f in self.functions])
        lines = [f"You can call these tools: {listed}",
                 'To call tools, answer with JSON only: {"tool_calls": [{"name": <a tool\'s '
                 'name>, "arguments": <its arguments>}]}.']
        if self.mode == "auto":
            lines.append('To answer without a tool, answer with JSON only: '
                         '{"response": <your answer>}.')
        elif self.mode != "required":
            lines.append(f"Call the tool {self.mode}.")
        return "\n".join(lines)


def tool_use(body: dict[str, Any]) -> ToolUse | None:
    """The `tools`, `tool_choice` and `parallel_tool_calls` of a chat request; None where no
    tool may be called. ValueError: a 400 that says what is wrong."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: give `tools` to choose from")
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise ValueError('tools: a list of {"type": "function", "function": {"name": str, '
                         '"description": str, "parameters": a JSON schema}}')
    functions = tuple(t["function"] for t in tools)
    for function in functions:
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError(f"tools: the parameters of {function['name']!r} must be a JSON "
                             "schema (an object)")
        check_depth(function.get("parameters", {}), f"tools: the parameters of "
                                                    f"{function['name']!r}")
    names = [f["name"] for f in functions]
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str) or name not in names:
            raise ValueError(f"tool_choice: {{\"type\": \"function\", \"function\": "
                             f"{{\"name\": one of {names}}}}}")
        mode = name
    elif choice in (None, "auto", "required", "none"):
        mode = choice or "auto"
    else:
        raise ValueError('tool_choice: "none", "auto", "required" or {"type": "function", '
                         '"function": {"name": ...}}')
    if mode == "none":
        return None
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ValueError("parallel_tool_calls: true or false")
    return ToolUse(functions, mode, parallel is True)


def check_depth(value: Any, what: str) -> None:
    """ValueError where `value` nests objects and lists past MAX_SCHEMA_DEPTH levels (walked
    without recursion: what walks a schema later recurses, and Python's json reads nesting
    deeper than those walks can go)."""
    level = [value]  # the containers one level down, each round
    for _ in range(MAX_SCHEMA_DEPTH):
        level = [v for item in level
                 for v in (item.values() if isinstance(item, dict) else item)
                 if isinstance(v, dict | list)]
        if not level:
            return
    raise ValueError(f"{what}: nested more than {MAX_SCHEMA_DEPTH} levels deep")


def closed(schema: Any) -> Any:
    """`schema` with every object that names its properties and says nothing of others
    closed to them (`additionalProperties: false`, as OpenAI's strict mode requires): a small model
    otherwise copies the schema's own keywords into its arguments."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "$defs", "definitions"):  # name -> schema
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(v) for name, v in out[key].items()}
    for key in ("items", "anyOf", "oneOf", "allOf", "prefixItems"):  # schemas
        if key in out:
            out[key] = closed(out[key])
    if "properties" in out and "additionalProperties" not in out:  # {"type": "object"}
        out["additionalProperties"] = False  # alone stays any object
    return out


def with_instructions(messages: list[dict[str, str]], use: ToolUse) -> list[dict[str, str]]:
    """The chat with the tools' instructions in its system message (added first, or
    appended to the one there is)."""
    if messages and messages[0]["role"] == "system":
        first = {"role": "system",
                 "content": f"{messages[0]['content']}\n\n{use.instructions()}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": use.instructions()}, *messages]


def called(text: str) -> tuple[list[dict[str, Any]] | None, str]:
    """(OpenAI's `tool_calls` of an answer's JSON, or None where it answered in text; the
    text). Text that is not such JSON (an answer cut by max_tokens) stays as it is."""
    try:
        value = json.loads(text)
    except ValueError:
        return None, text
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        calls = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                  "function": {"name": c.get("name"),
                               "arguments": json.dumps(c.get("arguments", {}))}}
                 for c in value["tool_calls"] if isinstance(c, dict)]
        return calls, ""
    if isinstance(value, dict) and isinstance(value.get("response"), str):
        return None, value["response"]
    return None, text


def as_text(message: dict[str, Any]) -> str:
    """An assistant message's `tool_calls` written as the model is asked to write them (its
    earlier turn, seen by the chat template)."""
    shape = ('messages: an assistant\'s tool_calls: a list of {"id", "type": "function", '
             '"function": {"name": str, "arguments": JSON text}}')
    listed = message.get("tool_calls") or []
    if not isinstance(listed, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments", ""), str | None) for c in listed):
        raise ValueError(shape)
    calls = []
    for call in listed:
        function = call["function"]
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (RecursionError, ValueError):
            raise ValueError("messages: a tool call's arguments must be JSON text") from None
        calls.append({"name": function["name"], "arguments": arguments})
    return json.dumps({"tool_calls": calls})
