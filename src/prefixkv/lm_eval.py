"""``python -m prefixkv.lm_eval <lm-eval arguments>``: lm-eval's command line with the ``hf-prefixkv`` model
registered, so ``--model hf-prefixkv --model_args pretrained=...`` works with no code. Needs
``pip install -e '.[eval]'`` from a clone of prefixkv (or ``bash scripts/setup.sh``)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """Run lm-eval's command line (``argv``, default ``sys.argv[1:]``) with ``hf-prefixkv`` registered."""
    from lm_eval.__main__ import cli_evaluate

    from .integrations import lm_eval as _registers_hf_prefixkv  # noqa: F401

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
