"""The attention backends by name (``PrefixStore(attention=...)``): one table of name -> what builds the backend,
the ones this package builds (``"blocks"``, ``"gather"``) and those a module adds when it is imported
(:func:`provide`: ``"flex"``); how a name resolves for a pool (:func:`choose`: the backend's name and the one line
that says why, made once per store and carried by its settings); and a cache's own backend of that name
(:func:`build`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .blocks import BlocksBackend
from .gather import GatherBackend
from .interface import READ_DEVICES
from .reads import AttentionBackend

# a fresh backend for a pool in blocks of this size (a cache's own: a backend keeps memos between its forwards)
Factory = Callable[[int], AttentionBackend]
# whether a backend serves a pool on this device, stored in this dtype, in blocks of this size, for a model whose
# attention soft-caps its logits at this value (``None``: it does not), and if not, why
Check = Callable[[torch.device, torch.dtype, int, float | None], tuple[bool, str]]


class Entry(NamedTuple):
    """One backend of the table: ``module``, the module that provides it; ``build``, its :data:`Factory` (``None``
    until that module is imported, :func:`provide`); ``check``, where it does not serve every pool stored in the
    dtype the model computes in, its :data:`Check`."""

    module: str
    build: Factory | None
    check: Check | None = None


def _blocks(block_size: int) -> AttentionBackend:
    return BlocksBackend()


def _gather(block_size: int) -> AttentionBackend:
    return GatherBackend()


# the table: every backend by name. A module that provides one registers it when imported (:func:`provide`); the
# store imports it when it is asked for (this module imports none: it is below them)
_TABLE: dict[str, Entry] = {
    "blocks": Entry("prefixkv.attention.blocks", _blocks),
    "flex": Entry("prefixkv.attention.flex", None),
    "gather": Entry("prefixkv.attention.gather", _gather),
}
# the names ``PrefixStore(attention=...)`` accepts: ``"auto"`` and every backend of the table
BACKENDS = ("auto", *sorted(_TABLE))


class Choice(NamedTuple):
    """The backend a name resolves to for a pool (``"blocks"``, ``"gather"``, ``"flex"``) and the one line that says
    why (``store.attention_backend``)."""

    name: str
    reason: str


def provide(name: str, build: Factory, check: Check) -> None:
    """Make ``build`` the factory of the backend ``name`` of the table, serving the pools ``check`` allows (the module
    that provides it calls this when imported). Mutates module state."""
    entry = _TABLE[check_backend(name)]
    _TABLE[name] = entry._replace(build=build, check=check)


def check_backend(name: Any) -> str:
    """``name`` if it names a backend of :data:`BACKENDS`, else a ``ValueError`` that lists them."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(map(repr, BACKENDS))}, got {name!r}")
    return name


def choose(
    name: str,
    device: torch.device,
    dtype: torch.dtype | str,
    *,
    model_dtype: torch.dtype,
    block_size: int = 16,
    softcap: float | None = None,
) -> Choice:
    """The backend called ``name`` (``"blocks"``, ``"gather"``, a provided one such as ``"flex"`` where its check
    allows the pool, else ``"gather"``, or ``"auto"``: ``"blocks"`` where the pool is on a device of
    :data:`READ_DEVICES` and stored in the dtype the model computes in, else ``"gather"``) for a pool on ``device``
    stored as ``dtype`` (a torch dtype, or a quantized storage: ``"int8"``, ``"fp8"``) in blocks of ``block_size``,
    for a model whose attention soft-caps its logits at ``softcap``, and the one-line reason. Raises ``ValueError``
    for ``"blocks"`` over a pool it cannot read. Does not mutate."""
    check_backend(name)
    readable = dtype == model_dtype
    if name == "blocks" and not readable:
        raise ValueError(
            f"the 'blocks' backend reads the pool in the dtype the model computes in ({model_dtype}), but the pool "
            f"is stored as {dtype}: choose 'gather' or 'auto'"
        )
    if name in ("blocks", "gather"):
        return Choice(name, f"{name}: asked for by name")
    if not readable or isinstance(dtype, str):
        return Choice("gather", f"gather: the pool is stored as {dtype}, the model computes in {model_dtype}")
    if name == "auto":
        if device.type not in READ_DEVICES:
            return Choice("gather", f"gather: reading the blocks in place is not implemented fast on {device.type}")
        return Choice("blocks", f"blocks: the pool is on {device.type} in {dtype}")
    entry = _TABLE[name]
    if entry.build is None or entry.check is None:
        return Choice("gather", f"gather: {entry.module}, which provides {name!r}, was not imported")
    ok, why = entry.check(device, dtype, block_size, softcap)
    if not ok:
        return Choice("gather", f"gather: {why}")
    return Choice(name, f"{name}: the pool is on {device.type} in {dtype}")


def build(name: str, block_size: int) -> AttentionBackend:
    """A fresh backend ``name`` of the table (the one :func:`choose` resolved) for a pool in blocks of
    ``block_size``: each cache builds its own, which keeps its memos. Raises ``ValueError`` for a backend whose
    module was not imported, or a name that is not one (``"auto"`` names none). Does not mutate."""
    entry = _TABLE.get(name)
    if entry is None:
        raise ValueError(f"no attention backend is called {name!r}; the table has {', '.join(map(repr, _TABLE))}")
    if entry.build is None:
        raise ValueError(f"the {name!r} attention backend is provided by {entry.module}, which was not imported")
    return entry.build(block_size)


def choose_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype | str,
    *,
    model_dtype: torch.dtype,
    block_size: int = 16,
    softcap: float | None = None,
) -> tuple[AttentionBackend, str]:
    """The backend :func:`choose` resolves ``name`` to, built (:func:`build`), and its one-line reason. Does not
    mutate."""
    chosen = choose(name, device, dtype, model_dtype=model_dtype, block_size=block_size, softcap=softcap)
    return build(chosen.name, block_size), chosen.reason
