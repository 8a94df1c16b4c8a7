"""``python -m prefixkv.lm_eval <lm-eval arguments>``: lm-eval's command line with the ``hf-prefixkv`` model
registered, so ``--model hf-prefixkv --model_args pretrained=...`` works with no code; at the end it prints how
many prompt tokens the store reused. Needs
``pip install -e '.[eval]'`` from a clone of prefixkv (or ``bash scripts/setup.sh``)."""

from __future__ import annotations

import sys

from .base.stats import StoreStats


def main(argv: list[str] | None = None) -> None:
    """Run lm-eval's command line (``argv``, default ``sys.argv[1:]``) with ``hf-prefixkv`` registered, then print
    the reuse of each ``hf-prefixkv`` store it built (prompt tokens reused of those looked up)."""
    from lm_eval.__main__ import cli_evaluate

    from .integrations.lm_eval import stores_made  # importing it registers hf-prefixkv

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    with stores_made() as stores:
        cli_evaluate()
    for store in stores:
        print(reuse_line(store.stats))


def reuse_line(stats: StoreStats) -> str:
    """What ``main`` prints for one store: the prompt tokens it reused, of those looked up, over how many rows."""
    return (
        f"hf-prefixkv store: reused {stats.hit_tokens} of {stats.prompt_tokens} prompt tokens "
        f"({stats.hit_rate:.1%}) over {stats.queries} looked-up rows"
    )


if __name__ == "__main__":
    main()
