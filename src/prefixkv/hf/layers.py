"""The layers of a :class:`~prefixkv.hf.cache.PagedPrefixCache`: the per-layer face transformers calls
(:class:`PagedLayer`; every call goes to the cache, whose :class:`prefixkv.hf.forward.Forward` writes and hands out
a layer's K/V). This module does not import the cache: a layer holds it by a weak reference."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..base.errors import CacheMisuseError
from ..compat import releases
from . import states


@releases.adapt_cache
class PagedLayer(CacheLayerMixin):
    """The per-layer face transformers expects (``cache.layers``); all state lives in the owning cache, which it
    holds by a weak reference."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, cache: Cache, layer_idx: int) -> None:
        super().__init__()
        # a weak reference: a strong one would make every cache a cycle that only the cyclic garbage collector
        # frees, so `del cache` would not give the blocks back (docs/correctness.md, "Releasing caches")
        self._cache_ref = weakref.ref(cache)
        self._layer_idx = layer_idx
        self.is_initialized = True

    @property
    def _cache(self) -> Cache:
        cache = self._cache_ref()
        if cache is None:
            raise CacheMisuseError("the PagedPrefixCache of this layer was garbage-collected")
        return cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cache.update(key_states, value_states, self._layer_idx)

    def update_tensor(self, name: str, states: torch.Tensor) -> torch.Tensor:
        """Write this layer's new values ``[B, heads, q, size]`` of the per-token tensor ``name`` its kind keeps
        besides K and V (:mod:`prefixkv.hf.kinds`) and return every row's whole tensor, ``[B, heads, columns, size]``:
        what a kind's face calls for such a tensor (a sparse attention's indexer keys), as ``update`` for K/V."""
        forward = getattr(self._cache, "forward", None)
        if forward is None:
            raise CacheMisuseError(f"layer {self._layer_idx}'s {name!r} was handed to a cache without a forward")
        result: torch.Tensor = forward.update_tensor(name, states, self._layer_idx)
        return result

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length(self._layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_mask_sizes(query_length, self._layer_idx)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        return None


class IndexedFace(PagedLayer):
    """The cache's face of a DeepSeek sparse attention layer: K/V as any layer's, and the lightning indexer's keys
    (``update_indexer``, transformers' ``DynamicIndexedLayer``'s method) through the pool's ``index_k``."""

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """Write the new indexer keys ``[B, q, index_head_dim]`` and return every row's, ``[B, columns,
        index_head_dim]`` (pad columns: zeros, which the indexer's mask hides as it hides stock's pads)."""
        return self.update_tensor("index_k", indexer_key_states[:, None])[:, 0]


# transformers' layer of a recurrent layer's states (None before transformers 5, where no model is served with them)
_StateBase: Any = releases.LINEAR_ATTENTION_LAYER or object


class StateLayer(_StateBase):
    """A recurrent layer's face (linear attention, Mamba, a short convolution): transformers' own
    ``LinearAttentionLayer``, holding each row's conv and recurrent states for this call, so that a model's
    ``update_conv_state`` / ``update_recurrent_state`` / ``has_previous_state`` work as with a ``DynamicCache``. The
    cache's rows select, snapshot and restore them (:mod:`prefixkv.hf.states`); beams and crops go through the cache,
    not the layer."""

    def __init__(self, cache: Cache, layer_idx: int, number_of_states: int = 1) -> None:
        super().__init__(number_of_states=number_of_states)
        self._cache_ref = weakref.ref(cache)
        self._layer_idx = layer_idx
        self.is_initialized = True

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        return None  # the cache's rows select the states with the blocks (RowSet.select)

    def update_conv_state(
        self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs: Any
    ) -> torch.Tensor:
        # a recording forward takes the states at its cuts too (prefixkv.hf.states.recording)
        states.note_conv(self, self._layer_idx, conv_states, state_idx, conv_kernel_size)
        return super().update_conv_state(conv_states, state_idx, conv_kernel_size=conv_kernel_size, **kwargs)  # type: ignore[no-any-return]

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        states.note_recurrent(self._layer_idx, state_idx)
        return super().update_recurrent_state(recurrent_states, state_idx, **kwargs)  # type: ignore[no-any-return]

    def crop(self, tokens_to_remove: int) -> None:
        raise CacheMisuseError(
            "a recurrent layer's state cannot be cropped back to an earlier token; prefixkv refuses it for models "
            "with recurrent layers (assisted or prompt-lookup decoding): generate without them, or without prefixkv"
        )


class HybridLayer(StateLayer, PagedLayer):
    """A hybrid layer's face (transformers' ``LinearAttentionAndFullAttentionLayer``): its states, as
    :class:`StateLayer`, and its K/V, as :class:`PagedLayer`."""

    def __init__(self, cache: Cache, layer_idx: int, number_of_states: int = 1) -> None:
        StateLayer.__init__(self, cache, layer_idx, number_of_states)
