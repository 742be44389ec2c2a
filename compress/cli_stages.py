"""`compress stages`: every stage kind's options, nested ones included, with types,
allowed values, bounds, real defaults and descriptions (no torch import)."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel

from compress.errors import UserError
from compress.stages.spec import all_specs

BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def describe_kinds(kind: str | None = None) -> list[dict[str, Any]]:
    """[{kind, doc, options: [{name, type, allowed, bounds, default, required, description}]}]
    for every kind, or the one named (UserError for an unknown kind)."""
    specs = all_specs()
    if kind is not None and kind not in specs:
        close = difflib.get_close_matches(kind, list(specs), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f" (kinds: {', '.join(specs)})"
        raise UserError(f"no stage kind '{kind}'{hint}")
    chosen = [specs[kind]] if kind else list(specs.values())
    return [{"kind": s.kind, "doc": s.doc(), "options": options_of(s.config)} for s in chosen]


def options_of(model: type[BaseModel], prefix: str = "") -> list[dict[str, Any]]:
    """The fields of a config class, nested config sections flattened to dotted names."""
    out = []
    for name, field in model.model_fields.items():
        if name == "kind":
            continue
        nested = _nested_model(field.annotation)
        default = None if field.is_required() else field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        out.append({"name": prefix + name, "type": _type_name(field.annotation),
                    "allowed": _allowed(field.annotation), "bounds": _bounds(field.metadata),
                    "default": default, "required": field.is_required(),
                    "description": field.description or ""})
        if nested is not None:
            out += options_of(nested, f"{prefix}{name}.")
    return out


def render_kinds(described: list[dict[str, Any]]) -> str:
    """The terminal listing: one block per kind, one line per option."""
    lines = []
    for item in described:
        lines.append(f"{item['kind']}: {item['doc']}")
        for opt in item["options"]:
            default = "required" if opt["required"] else f"default {opt['default']!r}"
            if opt["type"] == "section":
                default = "options below" if not opt["required"] else "required, below"
            extra = []
            if opt["allowed"]:
                extra.append("one of: " + ", ".join(map(str, opt["allowed"])))
            if opt["bounds"]:
                extra.append(", ".join(opt["bounds"]))
            note = f" [{'; '.join(extra)}]" if extra else ""
            lines.append(f"  {opt['name']:<24} {opt['type']:<16} {default:<22} "
                         f"{opt['description']}{note}")
        lines.append("")
    return "\n".join(lines)


def _strip_optional(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    for arg in _strip_optional(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _allowed(annotation: Any) -> list[Any]:
    for arg in _strip_optional(annotation):
        if typing.get_origin(arg) is Literal:
            return list(typing.get_args(arg))
    return []


def _bounds(metadata: list[Any]) -> list[str]:
    return [f"{sign} {getattr(m, key)}" for m in metadata for key, sign in BOUNDS
            if getattr(m, key, None) is not None]


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is Literal:
        return "str"
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if annotation is type(None):
        return "None"
    text = getattr(annotation, "__name__", None) if typing.get_origin(annotation) is None \
        else str(annotation)
    return (text or str(annotation)).replace("typing.", "")
