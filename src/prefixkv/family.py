"""The model's family, on the ground floor: the name transformers gives its kind of model (``config.model_type``),
the one way messages, saved files and refusals name it."""

from __future__ import annotations

from typing import Any


def family(model: Any) -> str:
    """The model's family as transformers names it (``config.model_type``), else its class's name. Does not mutate.

    >>> import prefixkv
    >>> family(prefixkv.models.tiny_model("llama"))
    'llama'
    """
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", None) or type(model).__name__)
