"""Error types: user errors (exit 2), failed stages (exit 1), and the domain errors the
library raises without knowing about stages (the pipeline attaches the stage name)."""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user asked for: a recipe, a path, a dataset. Exit code 2.

    Holds one or more one-line messages, each saying what is wrong and how to fix it.
    """

    exit_code = 2

    def __init__(self, messages: str | list[str]):
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        super().__init__("\n".join(self.messages))


class StageError(Exception):
    """A stage that started and failed. Exit code 1, one line naming the stage."""

    exit_code = 1

    def __init__(self, stage: str, cause: str):
        self.stage = stage
        self.cause = cause
        super().__init__(f"stage {stage} failed: {cause}")


class CompressError(Exception):
    """An algorithm that could not do its work, said in one line (the Python API raises
    these; the pipeline turns one into a StageError naming the stage)."""


class CaptureError(CompressError):
    """torch.export (or a tracer) could not capture the model."""


class ParityError(CompressError):
    """An exported or converted model disagrees with the model it came from."""


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
