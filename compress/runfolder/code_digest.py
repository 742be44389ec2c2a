"""The code a stage runs, as digests for its cache key: its run module and every module of
this project that it imports, directly or through others, lazily inside functions included,
and the native sources a module builds (the `.cpp` files it names beside it or in a `csrc/`
folder beside it); and the packages it ships in its output, whose folders are the list of
what ships (`shipped_files`: every file, sub-folders included).

The imports are read from the sources (`ast`), never executed, so keying a cached stage
imports nothing. A change to any of that code runs the stage again instead of reporting it
cached; code the stage cannot reach (the CLI, the reports) leaves its cache alone."""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterable
from functools import cache
from pathlib import Path

from compress.runfolder.files import sha256_file

PROJECT = ("compress", "export", "serve")  # the packages whose code is part of the key
# a kernel source a module names: Path(__file__).with_name("kernel.cpp"), CSRC / "kernel.cpp"
_NATIVE = re.compile(r"""["']([\w.-]+\.(?:cpp|cc|c|h|cu))["']""")
NOT_SHIPPED = ("__pycache__", "*.pyc", "*.so")  # caches and built libraries


@cache
def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def module_file(name: str) -> Path | None:
    """The source file of a project module (`a.b` -> a/b.py or a/b/__init__.py), if any."""
    top, *rest = name.split(".")
    root = _package_dir(top) if top in PROJECT else None
    if root is None:
        return None
    base = root.joinpath(*rest)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imported(name: str, path: Path) -> set[str]:
    """Project modules named by the import statements of one source file."""
    stat = path.stat()  # a file is parsed once a process until it changes
    return {m for m in _named_imports(name, path, stat.st_mtime_ns, stat.st_size)
            if m.split(".")[0] in PROJECT and module_file(m)}


@cache
def _named_imports(name: str, path: Path, mtime_ns: int, size: int) -> frozenset[str]:
    """Every module the import statements of one source file name (parsed once a version)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # submodules
    return frozenset(found)


def module_closure(roots: Iterable[str]) -> list[str]:
    """`roots` and every project module they import, transitively, sorted."""
    seen: set[str] = set()
    todo = [r for r in roots if module_file(r)]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")  # importing a.b.c runs a/__init__ and a/b/__init__ too
        todo += [p for p in (".".join(parts[:k]) for k in range(1, len(parts))) if module_file(p)]
        todo += sorted(_imported(name, module_file(name)) - seen)
    return sorted(seen)


def native_sources(path: Path) -> list[Path]:
    """The native sources a module names (and builds at run time), beside it or in the
    `csrc/` folder beside it."""
    names = sorted(set(_NATIVE.findall(path.read_text())))
    found = [folder / n for n in names for folder in (path.parent, path.parent / "csrc")]
    return [source for source in found if source.is_file()]


def shipped_files(package: str) -> list[Path]:
    """Every file of a project package's folder, sub-folders included (its sub-packages,
    its C++ sources), but caches and built libraries: what a stage that ships the package
    copies, sorted."""
    path = module_file(package)
    if path is None or path.name != "__init__.py":
        raise ValueError(f"{package} is not a package of this project")
    files = (p for p in path.parent.rglob("*") if p.is_file())
    return sorted(p for p in files if not any(p.match(pattern) or pattern in p.parts
                                              for pattern in NOT_SHIPPED))


def shipped_digests(packages: Iterable[str]) -> list[str]:
    """"package:file sha256" for every file of each of `packages` (`shipped_files`), and
    the digests of the project modules those files import (`code_digests`): the key of a
    stage's shipped code."""
    digests, modules = [], []
    for package in packages:
        folder = module_file(package).parent  # type: ignore[union-attr]
        for path in shipped_files(package):
            digests.append(f"{package}:{path.relative_to(folder)} {sha256_file(path)}")
            if path.suffix == ".py":
                parts = path.relative_to(folder).with_suffix("").parts
                name = ".".join((package, *parts)).removesuffix(".__init__")
                modules += _imported(name, path)
    return digests + code_digests(modules)


def code_digests(roots: Iterable[str]) -> list[str]:
    """"module sha256" for each module of `roots`' closure, and "module:file sha256" for
    each native source it builds: what a stage's key includes."""
    digests = []
    for name in module_closure(roots):
        path = module_file(name)
        digests.append(f"{name} {sha256_file(path)}")
        digests += [f"{name}:{src.name} {sha256_file(src)}" for src in native_sources(path)]
    return digests
