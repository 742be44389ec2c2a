"""Errors of capturing a model and writing it in a file format, each said in one line.

`CompressError` is the base of every error an algorithm raises (compress's pipeline turns
one into a failed stage naming the stage); `compress.errors` adds the user-facing ones."""

from __future__ import annotations


class CompressError(Exception):
    """An algorithm that could not do its work, said in one line (the Python API raises
    these; the pipeline turns one into a StageError naming the stage)."""


class CaptureError(CompressError):
    """torch.export (or a tracer) could not capture the model."""


class ExportError(CompressError):
    """A model could not be written in the asked format, or that format's runtime is missing."""


class RandomOpError(ExportError):
    """An exported graph still holds a random op (dropout in train mode, sampling): its
    outputs would differ from call to call, so the export is refused."""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """The exception's type and first non-empty message line, shortened."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."
