"""Error types that the CLI turns into exit codes (2 for user errors, 1 for failed stages)."""

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
