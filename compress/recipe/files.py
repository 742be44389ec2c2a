"""Reading recipe files (no torch import): strict YAML, `KEY=VALUE` overrides and
`${VAR}` / `${VAR:-default}` interpolation. Each problem is one line for a UserError."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from compress.errors import UserError


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        try:
            first = seen.setdefault(key, line)
        except TypeError:  # an unhashable key: construct_mapping reports it
            continue
        if first != line:
            raise yaml.constructor.ConstructorError(
                None, None, f"key '{key}' is given twice (lines {first} and {line}); keep one",
                key_node.start_mark)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def parse_yaml(text: str, where: str) -> Any:
    """Parse YAML text strictly (duplicate keys and recursive aliases refused)."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{where}{line}: malformed YAML: {problem}") from None
    except RecursionError:
        raise UserError(f"{where}: an alias refers to itself (e.g. a: &a [*a]); "
                        f"write the value out instead") from None
    if _recursive(data, set()):
        raise UserError(f"{where}: an alias refers to itself (e.g. a: &a [*a]); "
                        f"write the value out instead")
    return data


def _recursive(node: Any, open_ids: set[int]) -> bool:
    if not isinstance(node, dict | list):
        return False
    if id(node) in open_ids:
        return True
    open_ids.add(id(node))
    children = node.values() if isinstance(node, dict) else node
    found = any(_recursive(child, open_ids) for child in children)
    open_ids.discard(id(node))
    return found


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Parse a recipe file into a mapping, with one clear line for a missing, unreadable,
    non-UTF-8 or malformed file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: recipe file not found (check the path)")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); save "
                        f"the recipe as UTF-8") from None
    data = parse_yaml(text, str(path))
    if not isinstance(data, dict):
        raise UserError(f"{path}: a recipe must be a YAML mapping with name, model, data, stages")
    return data

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def interpolate_env(node: Any, problems: list[str], where: str = "") -> Any:
    """Replace `${VAR}` and `${VAR:-default}` in every string value."""
    if isinstance(node, dict):
        return {k: interpolate_env(v, problems, f"{where}.{k}" if where else str(k))
                for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate_env(v, problems, f"{where}.{i}") for i, v in enumerate(node)]
    if not isinstance(node, str):
        return node

    def substitute(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        value = os.environ.get(name)
        if value is not None:
            return value
        if default is not None:
            return default
        problems.append(
            f"{where}: environment variable {name} is not set "
            f"(set it, or write ${{{name}:-default}})"
        )
        return match.group(0)

    return _ENV.sub(substitute, node)


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply `a.b.0.c=value` overrides (values parsed as YAML scalars) to a recipe mapping."""
    problems = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            problems.append(f"override '{item}': expected KEY=VALUE, e.g. stages.0.max_steps=50")
            continue
        try:
            value = parse_yaml(text, f"override '{item}'") if text else ""
        except UserError:
            value = text
        error = _set_path(raw, key.split("."), value)
        if error:
            problems.append(f"override '{item}': {error}")
    if problems:
        raise UserError(problems)
    return raw


def _set_path(node: Any, parts: list[str], value: Any) -> str | None:
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        here = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit():
                return f"'{here}': a list needs a numeric index"
            index = int(part)
            if index >= len(node):
                return f"'{here}': index {index} out of range (the list has {len(node)} items)"
            if last:
                node[index] = value
            else:
                node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            return f"'{'.'.join(parts[:i])}' is a value, not a section"
    return None


