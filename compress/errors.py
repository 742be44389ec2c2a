"""Error types: user errors (exit 2), failed stages (exit 1), and the domain errors the
library raises without knowing about stages (the pipeline attaches the stage name)."""

from __future__ import annotations

from export.errors import (  # noqa: F401  (defined with the formats; raised by compress too)
    CaptureError,
    CompressError,
    ExportError,
    RandomOpError,
    one_line,
)


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


class ParityError(CompressError):
    """An exported or converted model disagrees with the model it came from."""
