"""The model's family, on the ground floor: the name transformers gives its kind of model (``config.model_type``),
the one way messages, saved files and refusals name it; and whose an error raised in a forward prefixkv runs is."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from .errors import ModelCodeError, refuses_float64

_PACKAGE = Path(__file__).resolve().parents[1]  # prefixkv/, above this base/ folder


def family(model: Any) -> str:
    """The model's family as transformers names it (``config.model_type``), else its class's name. Does not mutate.

    >>> import prefixkv
    >>> family(prefixkv.models.tiny_model("llama"))
    'llama'
    """
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", None) or type(model).__name__)


@contextlib.contextmanager
def model_errors(model: Any) -> Iterator[None]:
    """Around prefixkv code that runs ``model``'s forward (a cache's prefill of a prompt, a pin, a warm-up): an
    exception the model's own code raised with no prefixkv code under it, because a kernel refuses float64 (as the
    census tells a family that needs float32: docs/architectures.md, "The census"), is raised again as
    :class:`ModelCodeError`, which says so and what dtype to build the model in, from the model's exception cut to
    its own frames. Stock ``generate`` raises the same on that model: any forward in float64 reaches the kernel.
    Anything else passes unchanged. Does not mutate."""
    try:
        yield
    except Exception as e:
        below = _under_prefixkv(e.__traceback__, _model_files(model))
        if below is None or not refuses_float64(e) or _dtype(model) != "float64":
            raise
        where = _innermost_outside_torch(below)
        raise ModelCodeError(
            f"{family(model)}'s own code raised {type(e).__name__} in float64 ({where}: {e}), with no prefixkv code "
            "under it: a kernel of the family refuses float64, and stock generate raises the same on this model. "
            f"Build the model in float32 (dtype=torch.float32), the dtype the census checks {family(model)} in "
            f"(python -m prefixkv families {family(model)})"
        ) from e.with_traceback(below)


def _under_prefixkv(tb: TracebackType | None, model_files: set[str]) -> TracebackType | None:
    """The part of traceback ``tb`` under its last prefixkv frame, if it is the model's own code (a frame in one of
    ``model_files``): else ``None``."""
    below = None
    while tb is not None:
        if _PACKAGE in Path(tb.tb_frame.f_code.co_filename).resolve().parents:
            below = tb.tb_next
        tb = tb.tb_next
    frames = below
    while frames is not None:
        if frames.tb_frame.f_code.co_filename in model_files:
            return below
        frames = frames.tb_next
    return None


def _innermost_outside_torch(tb: TracebackType | None) -> str:
    """Where the innermost frame of ``tb`` outside torch is (the kernel's caller in the model's code), as text."""
    where = ""
    torch_files = Path(torch.__file__).resolve().parent
    while tb is not None:
        path = Path(tb.tb_frame.f_code.co_filename).resolve()
        if torch_files not in path.parents:
            where = f"{'/'.join(path.parts[-3:])}, line {tb.tb_lineno}, in {tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    return where


def _model_files(model: Any) -> set[str]:
    """The source files of the classes of ``model``'s modules, torch's own left out."""
    files = set()
    for module in model.modules():
        if not type(module).__module__.startswith("torch."):
            with contextlib.suppress(TypeError, OSError):
                files.add(inspect.getfile(type(module)))
    return files


def _dtype(model: Any) -> str:
    """The dtype of ``model``'s first floating-point parameter, as a name (``""`` when it has none)."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return str(parameter.dtype).removeprefix("torch.")
    return ""
