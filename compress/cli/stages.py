"""`compress stages`: every stage kind's options, nested ones included, with types,
allowed values, bounds, real defaults and descriptions (no torch import)."""

from __future__ import annotations

import difflib
import shutil
import textwrap
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel

from compress.errors import UserError
from compress.recipe.registry import all_specs

BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
SECTION = "section"  # the type shown for a nested group of options
COLUMN_CAPS = (28, 18, 24)  # widest aligned name, type and default columns


def describe_kinds(kind: str | None = None) -> list[dict[str, Any]]:
    """[{kind, doc, options: [{name, type, allowed, bounds, default, required, description}]}]
    for every kind, or the one named (UserError for an unknown kind)."""
    specs = all_specs()
    if kind is not None and kind not in specs:
        close = difflib.get_close_matches(kind, list(specs), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f" (kinds: {', '.join(specs)})"
        raise UserError(f"no stage kind '{kind}'{hint}")
    chosen = [specs[kind]] if kind else list(specs.values())
    return [{"kind": s.kind, "doc": _first_paragraph(s.config.__doc__) or s.doc(),
             "options": options_of(s.config)} for s in chosen]


def options_of(model: type[BaseModel], prefix: str = "",
               section_default: BaseModel | None = None) -> list[dict[str, Any]]:
    """The fields of a config class, nested config sections flattened to dotted names
    (a section's own line comes first, then its options; the options of each item of a list
    of sections as `name[].option`). Inside a section whose default is
    built by a factory (quantize's `qat`), `default` is what applies when the section is left
    out and `default_in_section` what applies to a key left out of a written section, when
    the two differ."""
    out = []
    for name, field in model.model_fields.items():
        if name == "kind":
            continue
        nested = _nested_model(field.annotation)
        required = field.is_required()
        value = None if required else field.get_default(call_default_factory=True)
        option = {"name": prefix + name, "type": _type_name(field.annotation),
                  "allowed": _allowed(field.annotation),
                  "bounds": _bounds([*field.metadata, *_inner_metadata(field.annotation)]),
                  "default": _plain(value), "required": required,
                  "description": field.description
                  or (_first_paragraph(nested.__doc__) if nested else "")}
        if section_default is not None:
            value = getattr(section_default, name)
            if _plain(value) != option["default"]:
                option["default_in_section"] = option["default"]
                option["default"], option["required"] = _plain(value), False
        out.append(option)
        if nested is not None:
            inner = value if isinstance(value, BaseModel) else None
            out += options_of(nested, f"{prefix}{name}.", inner)
        elif (item := _item_model(field.annotation)) is not None:
            out += options_of(item, f"{prefix}{name}[].")
    return out


def _plain(value: Any) -> Any:
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def render_kinds(described: list[dict[str, Any]], width: int | None = None) -> str:
    """The terminal listing: per kind its doc, then per option one aligned line (name, type,
    default, allowed values and bounds) and its description wrapped beneath."""
    width = width or max(60, min(110, shutil.get_terminal_size((100, 24)).columns))
    lines: list[str] = []
    for item in described:
        lines += textwrap.wrap(f"{item['kind']}: {item['doc']}", width,
                               subsequent_indent=" " * (len(item["kind"]) + 2))
        rows = [(opt["name"], opt["type"], _default_text(opt), _limits_text(opt))
                for opt in item["options"]]
        widths = [min(cap, max((len(row[i]) for row in rows), default=0))
                  for i, cap in enumerate(COLUMN_CAPS)]  # a longer cell shifts its line only
        for opt, row in zip(item["options"], rows, strict=True):
            cells = [cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)]
            line = "  " + "  ".join([*cells, row[3]])
            below = [opt["description"]]
            if len(line.rstrip()) > width:  # the limits go beneath, before the description
                line, below = "  " + "  ".join(cells), [row[3], *below]
            lines.append(line.rstrip())
            for text in filter(None, below):
                lines += textwrap.wrap(text, width, initial_indent=" " * 6,
                                       subsequent_indent=" " * 6)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _default_text(opt: dict[str, Any]) -> str:
    if opt["type"].startswith(SECTION):
        return "required, options below" if opt["required"] else "options below"
    text = "required" if opt["required"] else f"default {opt['default']!r}"
    if "default_in_section" in opt:
        section = opt["name"].rsplit(".", 1)[0]
        text += f" ({opt['default_in_section']!r} if a {section}: section is written)"
    return text


def _limits_text(opt: dict[str, Any]) -> str:
    parts = []
    if opt["allowed"]:
        parts.append("one of: " + ", ".join(map(str, opt["allowed"])))
    if opt["bounds"]:
        parts.append(", ".join(opt["bounds"]))
    return "; ".join(parts)


def _first_paragraph(doc: str | None) -> str:
    """A docstring's first paragraph on one line."""
    paragraph = (doc or "").strip().split("\n\n")[0]
    return " ".join(paragraph.split())


def _members(annotation: Any) -> list[Any]:
    """The members of a union (None left out), Annotated unwrapped; else [annotation]."""
    if typing.get_origin(annotation) is Annotated:
        return _members(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) if a is not type(None)
                for m in _members(a)]
    return [annotation]


def _inner_metadata(annotation: Any) -> list[Any]:
    """Constraints written inside the annotation, e.g. `Annotated[int, Field(ge=1)] | None`
    (pydantic lifts only the outermost Annotated into field.metadata)."""
    found = []
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (
        typing.Union, types.UnionType) else ()
    for arg in args:
        if typing.get_origin(arg) is Annotated:
            for extra in typing.get_args(arg)[1:]:
                found += getattr(extra, "metadata", None) or [extra]
    return found


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    for arg in _members(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _item_model(annotation: Any) -> type[BaseModel] | None:
    """The config class of each item of a list of sections (search's `shapes`), else None."""
    for arg in _members(annotation):
        if typing.get_origin(arg) in (list, tuple, set, frozenset):
            for inner in typing.get_args(arg):
                found = _nested_model(inner)
                if found is not None:
                    return found
    return None


def _allowed(annotation: Any) -> list[Any]:
    """The allowed values of a Literal, or of each item of a list of Literals."""
    found: list[Any] = []
    for arg in _members(annotation):
        origin = typing.get_origin(arg)
        if origin is Literal:
            found += typing.get_args(arg)
        elif origin in (list, tuple, set, frozenset):
            found += [v for inner in typing.get_args(arg) for v in _allowed(inner)]
    return list(dict.fromkeys(found))


def _bounds(metadata: list[Any]) -> list[str]:
    return [f"{sign} {getattr(m, key)}" for m in metadata for key, sign in BOUNDS
            if getattr(m, key, None) is not None]


def _type_name(annotation: Any) -> str:
    """A type as a user writes it: int, list[str], int | None, section (nested options)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin is Literal:
        names = dict.fromkeys(type(v).__name__ for v in typing.get_args(annotation))
        return " | ".join(names)
    if origin in (typing.Union, types.UnionType):
        names = dict.fromkeys(_type_name(a) for a in typing.get_args(annotation))
        return " | ".join(names)
    if annotation is type(None):
        return "None"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return SECTION
    if origin is not None:
        args = typing.get_args(annotation)
        name = getattr(origin, "__name__", str(origin).replace("typing.", ""))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]" if args else name
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))
