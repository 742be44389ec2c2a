"""Turn pydantic validation errors into one readable line each, with did-you-mean hints."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from compress.recipe.registry import stage_configs


def format_validation_error(exc: ValidationError, root: type[BaseModel]) -> list[str]:
    """One line per problem: `stages.0.lerning_rate: unknown key (did you mean ...)`."""
    lines = []
    kinds = list(stage_configs())
    for err in exc.errors():
        loc = tuple(err["loc"])
        where = format_loc(loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            key = str(loc[-1])
            allowed = sorted(_fields_at(root, loc[:-1]))
            lines.append(f"{where}: unknown key{_did_you_mean(key, allowed, allowed)}")
        elif kind == "union_tag_invalid":
            tag = str(err.get("ctx", {}).get("tag"))
            lines.append(
                f"{where}.kind: unknown stage kind '{tag}'{_did_you_mean(tag, kinds, kinds)}"
            )
        elif kind == "union_tag_not_found":
            lines.append(f"{where}: missing 'kind' (one of: {', '.join(kinds)})")
        elif kind in ("finite_number", "float_parsing") and "inf" in str(err.get("input")).lower():
            lines.append(f"{where}: must be a finite number (got {_short(err.get('input'))})")
        elif kind == "missing":
            lines.append(f"{where}: required key is missing")
        elif kind == "value_error":
            lines.append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"{where}: {err['msg']} (got {_short(err.get('input'))})")
    return lines


def format_loc(loc: tuple[Any, ...]) -> str:
    """`('stages', 0, 'finetune', 'lr')` -> `stages.0.lr`: the override syntax, so a
    location can be pasted back as `stages.0.lr=VALUE`."""
    parts: list[str] = []
    previous: Any = None
    for part in loc:
        stage_tag = isinstance(previous, int) and part in stage_configs()
        if not stage_tag:
            parts.append(str(part))
        previous = part
    return ".".join(parts) or "recipe"


def _did_you_mean(word: str, candidates: list[str], allowed: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{close[0]}'?)"
    if allowed:
        return f" (allowed: {', '.join(allowed)})"
    return ""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fields_at(root: type[BaseModel], loc: tuple[Any, ...]) -> set[str]:
    """The field names of the model found by walking `loc` from `root`."""
    node: Any = root
    for part in loc:
        node = _unwrap(node)
        if isinstance(part, int):
            args = typing.get_args(node)
            node = args[0] if args else node
            continue
        if isinstance(part, str) and part in stage_configs() and not _is_model_with(node, part):
            node = stage_configs()[part]
            continue
        if _is_model_with(node, part):
            node = node.model_fields[part].annotation
        else:
            return set()
    node = _unwrap(node)
    if isinstance(node, type) and issubclass(node, BaseModel):
        return set(node.model_fields)
    return set()


def _is_model_with(node: Any, field: Any) -> bool:
    return isinstance(node, type) and issubclass(node, BaseModel) and field in node.model_fields


def _unwrap(node: Any) -> Any:
    """Strip Annotated and Optional wrappers."""
    while True:
        origin = typing.get_origin(node)
        if origin is typing.Annotated:
            node = typing.get_args(node)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(node) if a is not type(None)]
            if len(args) != 1:
                return node
            node = args[0]
        else:
            return node
