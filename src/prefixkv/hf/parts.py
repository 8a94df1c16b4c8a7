"""What a :class:`~prefixkv.store.PrefixStore` hands down to the layers it composes (docs/how-it-works.md,
"Layers"): its settings as a frozen record (:class:`~prefixkv.base.settings.StoreSettings`, whose home is the ground
floor), and :class:`StoreParts`, what a cache, its rows, the model hooks and the model runner read of the store they
serve. The store sits on top of them and builds them; they know it only through this interface, so none of them
imports the store."""

from __future__ import annotations

from collections.abc import Collection
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch

from ..base.settings import StoreSettings
from ..base.stats import RowStats
from ..kv.manager import BlockManager
from .kinds import LayerKind
from .states import Snapshots


class Handle(Protocol):
    """What undoes one hook or patch."""

    def remove(self) -> None: ...


class Prefills(Protocol):
    """The prefills a cache's rows ask of their store's model runner (:class:`prefixkv.hf.runner.ModelRunner`)."""

    def prefill(
        self, tokens: list[int], *, keep_partial: bool, count: bool, namespace: str | None = None
    ) -> AbstractContextManager[RowStats]:
        """Compute and publish the uncached rest of ``tokens``, in user ``namespace``; the published tokens stay
        locked until the context exits. Mutates the store."""
        ...

    def prefill_states(
        self, tokens: list[int], stops: list[int], namespace: str | None, junctions: Collection[int] = ()
    ) -> AbstractContextManager[int]:
        """For a model with recurrent layers: compute ``tokens`` up to each of ``stops`` (``junctions`` among them)
        and grid position in turn, publishing the K/V and a state snapshot at each; yields the tokens computed, all
        of them locked until the context exits. Mutates the store."""
        ...

    def prefill_shared(self, rows: list[list[int]], namespace: str | None) -> list[tuple[int, list[int]]]:
        """In-batch sharing: compute once each whole-block prefix that several ``rows`` (of user ``namespace``)
        share; return, per prefix computed, the tokens computed and the rows sharing it. Mutates the store."""
        ...

    def prefill_chunks(self, prefixes: list[list[int]], namespace: str | None) -> AbstractContextManager[list[int]]:
        """An invariant store's canonical prefill of ``prefixes`` in user ``namespace``; yields how many tokens
        of each the store held before, all of them locked until the context exits. Mutates the store."""
        ...


@runtime_checkable
class StoreParts(Protocol):
    """What the layers below the user-facing store read of it: its blocks, its settings, the transformers model
    that computes (inside a PEFT wrapper, its base model) and the runner of that model."""

    @property
    def blocks(self) -> BlockManager: ...

    @property
    def settings(self) -> StoreSettings: ...

    @property
    def hf_model(self) -> torch.nn.Module: ...

    @property
    def runner(self) -> Prefills: ...

    @property
    def layer_kinds(self) -> list[LayerKind] | None:
        """Each layer's kind (:mod:`prefixkv.hf.kinds`) for a model with layers of another kind than K/V, else
        ``None``."""
        ...

    @property
    def snapshots(self) -> Snapshots:
        """The recurrent layers' state snapshots (:class:`prefixkv.hf.states.Snapshots`; empty for other models)."""
        ...
