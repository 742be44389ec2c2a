"""The command line every benchmark shares: progress on stderr (stdout has the table alone),
an argument parser whose error is one line, and one exit ladder: 0, 2 for what the user
asked for, 1 for a peer's or any other failure, 130 when interrupted, each failure one
`error:` line without a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from benchmarks.harness.venv import PeerError
from compress.errors import UserError, one_line


def echo(text: str) -> None:
    """One line of progress on stderr."""
    print(text, file=sys.stderr, flush=True)


class Parser(argparse.ArgumentParser):
    """argparse with its error as one `error:` line and exit code 2 (no usage)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def fill(args: argparse.Namespace, defaults: dict[str, Any]) -> None:
    """Each option of `defaults` the command line left unset (None) takes its value there
    (`--quick`'s or the full run's)."""
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def numbers(parser: argparse.ArgumentParser, option: str, text: str, example: str
            ) -> list[int]:
    """The comma-separated whole numbers of `option`'s `text`; the parser's error when one is
    not a number."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"{option} {text!r}: expected numbers like {example}")


def exit_code(body: Callable[[], int], user: tuple[type[BaseException], ...] = (UserError,),
              peer: str = "") -> int:
    """`body()`'s exit code, or its failure as one `error:` line and a code: 2 for the
    `user` errors (each of a UserError's messages, else the error in one line), 1 for a
    PeerError (its line after `peer`) or any other failure, 130 when interrupted."""
    try:
        return body()
    except user as exc:
        for message in getattr(exc, "messages", None) or [one_line(exc)]:
            print(f"error: {message}", file=sys.stderr)
        return 2
    except PeerError as exc:
        print(f"error: {peer}{exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - one line, no traceback
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 1
