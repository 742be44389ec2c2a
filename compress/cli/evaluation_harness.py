"""`compress-lm-eval`: lm-eval's command line with the `compress` model registered
(`compress.families.causal_lm.evaluation_harness`), so that `--model compress
--model_args folder=<export folder>` scores a compress export; every other argument is
lm-eval's own."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from compress.families.causal_lm import evaluation_harness
    except ImportError as exc:
        print(f"error: lm-eval is not installed ({exc}): pip install "
              "'compress-pipeline[eval]'", file=sys.stderr)
        raise SystemExit(2) from None
    evaluation_harness.main()
