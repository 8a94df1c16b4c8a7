"""The first-step protocol of a ``generate`` call on a ``PagedPrefixCache``: what the cache holds must fit the call.

At the first forward of each call the ``prepare_inputs_for_generation`` wrapper shows the cache the call's whole
sequence, the only place where it is visible. A cache that has computed nothing yet holds only what construction
reused; if the call's mask, namespace or inputs differ from what that reuse assumed, the reuse is redone for the
call as it is (:class:`Redo`) or dropped (:class:`Drop`). A cache that has computed must be continued: the call
passes its last output plus new tokens (:meth:`GenerateCall.check_continues`), or only the new tokens placed right
after the held columns (:meth:`GenerateCall.check_new_tokens`). :class:`GenerateCall` decides and applies its
decisions to the cache's :class:`prefixkv.hf.rows.RowSet` (docs/how-it-works.md, "One forward, and the first step of
a call"); it never calls the cache."""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch

from ..base.errors import CacheMisuseError, UnsupportedModelError
from ..base.tokens import relabel, token_ids
from ..compat import releases
from . import proof, rows, shapes, vision
from .parts import StoreParts


class Drop(NamedTuple):
    """Give back every reused column and stop proving the rows, for ``why`` (a warning says so)."""

    why: str


class Redo(NamedTuple):
    """Reuse again, for the call's own layout: each row's ``pads`` and ``keys`` under the store's ``space``."""

    pads: list[int]
    keys: list[list[int]]
    space: Hashable


class GenerateCall:
    """The call protocol's state of one cache: the prompt rows it was built from (pads included; ``None``: built
    without ``input_ids``), whether any forward has computed K/V yet (before that, it holds only what construction
    reused), and whether the next forward re-feeds the sequence (assisted and prompt-lookup decoding)."""

    def __init__(self, prompt_ids: list[list[int]] | None) -> None:
        self.prompt_ids = prompt_ids
        self.computed = False
        self.refeed = False

    def take_refeed(self) -> bool:
        """Whether the forward about to run re-feeds the sequence, once. Mutates."""
        refeed, self.refeed = self.refeed, False
        return refeed

    def fit(
        self, held: rows.RowSet, store: StoreParts, input_ids: torch.Tensor, length: int | None, kwargs: dict[str, Any]
    ) -> int | None:
        """At the first step of a call (:meth:`prefixkv.hf.forward.Forward.fit_call`): make what ``held`` holds fit
        the call, and return the ``next_sequence_length`` (``length``: what ``generate`` asked for) to feed. Mutates
        ``held`` and this."""
        refeed = self.take_refeed()
        if input_ids.dim() != 2:
            return length
        if not self.computed and self._redo(held, store, input_ids, kwargs):
            embeds = kwargs.get("inputs_embeds")
            width = embeds.shape[1] if isinstance(embeds, torch.Tensor) else input_ids.shape[1]
            return None if length is None and held.length == 0 else width - held.length
        columns = held.length
        if columns == 0:
            return length
        if length is None and not refeed:
            self.check_new_tokens(
                held.rows, columns, input_ids.shape[1], kwargs.get("attention_mask"), kwargs.get("position_ids")
            )
            return None
        self.check_continues(held.rows, columns, input_ids)
        if length is not None:
            return length
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            warnings.warn(
                "prefixkv: assisted or prompt-lookup decoding with output_attentions/output_hidden_states "
                "recomputes the whole prompt, so prefix reuse is off for this generate call",
                stacklevel=5,
            )
            held.drop_reuse()
            return None
        return input_ids.shape[1] - columns

    def fit_prompt(self, held: rows.RowSet, store: StoreParts, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> None:
        """Before a chunked prefill (``prefill_chunk_size``) cuts the call's ``input_ids`` by the columns ``held``
        holds: redo or drop construction's reuse for the whole prompt and mask, as the first step of an unchunked
        call does (its first chunk shows only its own columns). Mutates ``held``."""
        if input_ids.dim() == 2 and not self.computed:
            self._redo(held, store, input_ids, kwargs)

    def _redo(self, held: rows.RowSet, store: StoreParts, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> bool:
        """Redo or drop construction's reuse as :meth:`replan` decides; whether what ``held`` holds changed.
        Mutates ``held``."""
        training = store.hf_model.training
        decision = self.replan(
            held.rows,
            input_ids,
            kwargs,
            training=training,
            space=held.space_now.for_step(),
            held_space=held.space,
            padded=shapes.padded_refusal(store.hf_model),
            # transformers 4.x feeds no images to a forward past position 0: there a call with images is unproven
            keyed=vision.KEYED if held.images is not None and releases.WARM_FORWARDS_TAKE_IMAGES else frozenset(),
        )
        if decision is None:
            return False
        if isinstance(decision, Drop):
            had = held.length
            held.drop_reuse()
            held.not_cached(decision.why)
            for row in held.rows:
                row.forget()
            warnings.warn(
                f"prefixkv: {decision.why}: this PagedPrefixCache neither reuses nor publishes cached K/V in this "
                "generate call",
                stacklevel=6,
            )
            return had > 0
        held.reattach(store, decision.pads, decision.keys, decision.space)
        return True

    def replan(
        self,
        held: Sequence[rows.Row],
        input_ids: torch.Tensor,
        kwargs: dict[str, Any],
        *,
        training: bool,
        space: Hashable,
        held_space: Hashable,
        padded: tuple[str, bool] | None = None,
        keyed: frozenset[str] = frozenset(),
    ) -> Drop | Redo | None:
        """Before the cache computes anything: whether the reuse of construction is wrong for the call as it is
        (its inputs rule out any proof, or its own positions differ from the mask's) or was made for another
        layout (``generate`` inferred a mask, an adapter was switched: ``space`` differs from ``held_space``);
        ``padded``: why the model's left-padded rows cannot reuse, and whether it refuses them
        (:func:`prefixkv.hf.shapes.padded_refusal`: raises :class:`UnsupportedModelError`).
        ``keyed``: the inputs the rows' keys carry (a prompt's images). ``None``: keep it. Does not mutate."""
        if padded is not None and padded[1] and any(row.pad for row in held):
            raise UnsupportedModelError(
                f"this model {padded[0]}: a left-padded batch would get other outputs than stock generate; "
                "generate its rows one at a time (no padding) with prefixkv, or the batch without prefixkv"
            )
        if not held or not any(row.proven for row in held):
            return None
        embeds = kwargs.get("inputs_embeds")
        attention_mask = kwargs.get("attention_mask")
        forward = proof.ForwardInputs(
            None if isinstance(embeds, torch.Tensor) else input_ids,
            embeds,
            use_cache=kwargs.get("use_cache"),
            others=proof.changing_inputs(kwargs, tensors_only=True, keyed=keyed),
        )
        why = proof.unproven(forward, training=training, space=lambda: held_space, held_space=held_space)
        # a chunk of a chunked prefill (``prefill_chunk_size``) feeds only its columns after the held ones, so its
        # positions start there: check_new_tokens checks them, and the proof checks the call's mask and positions
        chunk = self.prompt_ids is not None and input_ids.shape[1] != len(self.prompt_ids[0])
        if why is None and not chunk:
            why = proof.custom_positions(input_ids, attention_mask, kwargs.get("position_ids"))
        if why is None and padded is not None and any(row.pad for row in held):
            why = padded[0]  # the model's padded rows reusing unpadded K/V are not its whole ones (hf/shapes.py)
        if why is not None:
            return Drop(why)
        if self.prompt_ids is None or input_ids.shape[0] % len(held):
            return None
        per = input_ids.shape[0] // len(held)
        if input_ids[::per].cpu().tolist() != self.prompt_ids:
            return None  # not the prompt this cache was built from: check_continues says so
        mask = None if attention_mask is None else rows.check_mask(attention_mask, tuple(input_ids.shape))[::per]
        pads, keys = rows.layout(input_ids[::per], mask)
        keys = [relabel(k, r.keys) for k, r in zip(keys, held)]  # a placeholder's key is its image's (hf/vision.py)
        if any(not k for k in keys) or (
            space == held_space and all(p == r.pad and k == r.keys for p, k, r in zip(pads, keys, held))
        ):
            return None
        return Redo(pads, keys, space)

    @staticmethod
    def check_new_tokens(
        held: Sequence[rows.Row],
        length: int,
        width: int,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> None:
        """A call that passes only its ``width`` new tokens (and chunked prefill) must place them right after the
        ``length`` held columns: its attention mask spans both, or (once generate dropped an all-ones mask) the
        position of its last token is the last column's. Raise :class:`CacheMisuseError` otherwise."""
        if attention_mask is not None and attention_mask.dim() == 2:
            if attention_mask.shape[1] != length + width:
                raise CacheMisuseError(
                    f"generate was given {width} new tokens and an attention mask of {attention_mask.shape[1]} "
                    f"columns, but this PagedPrefixCache holds {length}: the mask must span the cached columns and "
                    "the new tokens (or pass the whole sequence: the last output plus new tokens)"
                )
            return
        if position_ids is None or position_ids.dim() != 2 or not held:
            return
        last = position_ids[:, -1].tolist()
        per = max(1, len(last) // len(held))
        for j, position in enumerate(last):
            expected = length + width - 1 - held[min(j // per, len(held) - 1)].pad
            if position != expected:
                raise CacheMisuseError(
                    f"row {j}: generate places its {width} new tokens to end at position {position}, but after the "
                    f"{length} columns this PagedPrefixCache holds they end at {expected}: pass an attention mask "
                    "spanning the cached columns and the new tokens, or the whole sequence"
                )

    @staticmethod
    def check_continues(held: Sequence[rows.Row], length: int, input_ids: torch.Tensor) -> None:
        """Raise :class:`CacheMisuseError` unless every row of ``input_ids`` starts with the tokens the cache holds
        in its first ``length`` columns (rows whose tokens are unknown, from embeddings, are skipped)."""
        width, batch, count = input_ids.shape[1], input_ids.shape[0], len(held)
        if width <= length:
            raise CacheMisuseError(
                f"generate was called with {width} columns but this PagedPrefixCache already holds {length}: a "
                "cache only continues a longer sequence that starts with what it holds (the output of its last "
                "generate call plus new tokens). Build a new cache for a new prompt (the store still reuses its prefix)"
            )
        if count == 0:
            return
        if batch % count:
            raise CacheMisuseError(
                f"this cache holds {count} rows but generate was called with {batch}; continue with the same batch"
            )
        ids = input_ids[:, :length].cpu().tolist()
        for j, seq in enumerate(ids):
            row = held[j // (batch // count)]
            if not row.proven:
                continue
            stored = token_ids(row.keys[: max(0, length - row.pad)])
            given = seq[min(row.pad, length) :]
            if given[: len(stored)] != stored:
                t = next(t for t, (a, b) in enumerate(zip(given, stored)) if a != b)
                raise CacheMisuseError(
                    f"row {j}: token {t} passed to generate is {given[t]}, but this PagedPrefixCache holds {stored[t]} "
                    "there: a cache only continues the sequence it holds (the output of its last generate call plus "
                    "new tokens). Build a new cache for a new prompt (the store still reuses its prefix)"
                )
