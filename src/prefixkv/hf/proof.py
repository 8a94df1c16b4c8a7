"""The proof that a forward computes the K/V of a row's keys (docs/correctness.md, "Publish only what is proven").

A forward's inputs reach the cache as one frozen record, :class:`ForwardInputs`, built by the model hook; the
verdicts are pure functions over it and the facts of each row (:class:`RowFacts`): :func:`unproven` says why no
row of a forward can be proven, :func:`prove_rows` what each row may record, :func:`custom_positions` why a
generate call's own ``position_ids`` make construction's reuse wrong. The cache applies the verdicts; nothing
here mutates. :data:`NEUTRAL_INPUTS` is the one list of inputs that do not change K/V: any other input a forward
or a generate call passes makes its rows unproven."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, Protocol

import torch

from ..base.tokens import key, relabel, token_ids
from ..compat.releases import CACHE_KWARGS, RELEASE_NEUTRAL_INPUTS

# inputs of a forward (and of prepare_inputs_for_generation, which passes the rest on to it) that do not change
# the K/V of the ids; any other one (token_type_ids, pixel values) makes the rows unproven
NEUTRAL_INPUTS = frozenset(
    {
        "input_ids",
        "inputs_embeds",
        "attention_mask",
        "position_ids",
        *CACHE_KWARGS,
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "logits_to_keep",
        "labels",
        *RELEASE_NEUTRAL_INPUTS,  # those only some transformers releases pass
    }
)


def changing_inputs(
    inputs: Mapping[str, Any], *, tensors_only: bool = False, keyed: frozenset[str] = frozenset()
) -> tuple[str, ...]:
    """The names of ``inputs`` (a forward's, by name) that are set and may change K/V. With ``tensors_only``, only
    tensors count: the arguments of a generate step also hold generate's own settings (the tokenizer of
    ``stop_strings``), which never reach the forward. ``keyed``: inputs whose effect the rows' keys carry (a
    prompt's images, keyed by their digests: prefixkv/hf/vision.py)."""
    # the names first, as sets: a decode step passes only neutral ones, and its values need not be looked at
    rest = inputs.keys() - NEUTRAL_INPUTS - keyed
    if not rest:
        return ()
    return tuple(
        sorted(
            k
            for k in rest
            if (v := inputs[k]) is not None
            and not (isinstance(v, Mapping) and not v)  # an empty one (generate's mm_encoder_outputs of no image)
            and (not tensors_only or isinstance(v, torch.Tensor))
        )
    )


class ForwardInputs(NamedTuple):
    """One forward's inputs as the cache needs them: the ids (``None``: embeddings only), the embeddings, the
    mask and positions as passed, ``use_cache``, the other inputs that may change K/V (:func:`changing_inputs`),
    whether the model's K/V depend on ``position_ids`` (Bloom's ALiBi does not take them), and whether this is a
    decode step of ``generate``, whose mask only appends ones to the one checked at the call's first step."""

    input_ids: torch.Tensor | None
    inputs_embeds: torch.Tensor | None = None
    attention_mask: Any = None
    position_ids: Any = None
    use_cache: Any = None
    others: tuple[str, ...] = ()
    positions_matter: bool = True
    decode_step: bool = False

    @classmethod
    def of(
        cls,
        inputs: Mapping[str, Any],
        *,
        positions_matter: bool,
        decode_step: bool,
        keyed: frozenset[str] = frozenset(),
    ) -> ForwardInputs:
        """The record of a forward called with ``inputs`` (by name); ``keyed``: as :func:`changing_inputs`."""
        return cls(
            inputs.get("input_ids"),
            inputs.get("inputs_embeds"),
            inputs.get("attention_mask"),
            inputs.get("position_ids"),
            inputs.get("use_cache"),
            changing_inputs(inputs, keyed=keyed),
            positions_matter,
            decode_step,
        )

    @property
    def fed(self) -> torch.Tensor | None:
        """What the forward feeds, ``[batch, q, ...]``: the ids, else the embeddings."""
        return self.input_ids if self.input_ids is not None else self.inputs_embeds


class RowFacts(Protocol):
    """What the proof reads of a row: leading pads, its keys, whether they are proven, its shown tokens."""

    @property
    def pad(self) -> int: ...

    @property
    def keys(self) -> list[int]: ...

    @property
    def proven(self) -> bool: ...

    @property
    def real(self) -> int: ...


class Verdict(NamedTuple):
    """What a forward proves of one row: the keys to record after the row's (``None``: the row is unproven from
    now on) and how many of them the mask shows, or ``error``: the message of the ``CacheMisuseError`` to raise
    (the forward contradicts the row's prompt ids, or K/V that construction reused)."""

    keys: list[int] | None
    shown: int = 0
    error: str | None = None


_FORGET = Verdict(None)


def unproven(
    forward: ForwardInputs, *, training: bool, space: Callable[[], Hashable], held_space: Hashable
) -> str | None:
    """Why no row of ``forward`` can be proven, whatever its mask: ``use_cache=False`` re-feeds the sequence;
    embeddings need not be those of the ids (a soft prompt); inputs such as ``token_type_ids`` change the
    embeddings; dropout in training mode makes K/V random; another adapter or changed weights (``space()``, the
    store's namespace now, against ``held_space``) compute other K/V, checked except on ``generate``'s decode steps,
    which cannot change them. ``None`` if none."""
    if forward.use_cache is False:
        return "use_cache=False"
    if forward.input_ids is None:
        return "inputs_embeds (their K/V need not be those of the ids)"
    if forward.others:
        return f"{', '.join(forward.others)} (inputs whose effect on K/V prefixkv cannot check)"
    if training:
        return "a model in training mode (dropout makes K/V random; call model.eval())"
    if not forward.decode_step and space() != held_space:
        return "another adapter or changed weights"
    return None


def custom_positions(input_ids: torch.Tensor, attention_mask: Any, position_ids: Any) -> str | None:
    """Why a generate call's own ``position_ids`` make construction's reuse wrong (they are not those the mask
    implies: the count of shown tokens before each), or ``None``."""
    if position_ids is None:
        return None
    reason = "position_ids of its own (K/V depend on positions; the cache keys assume the mask's)"
    position_ids = text_positions(position_ids)
    if not isinstance(position_ids, torch.Tensor) or tuple(position_ids.shape) != tuple(input_ids.shape):
        return reason
    shown = torch.ones(input_ids.shape, dtype=torch.bool) if attention_mask is None else attention_mask.bool().cpu()
    expected = shown.to(torch.long).cumsum(dim=1) - 1
    return reason if bool(((position_ids.cpu() != expected) & shown).any()) else None


def text_positions(position_ids: Any) -> Any:
    """The text positions of ``position_ids``: generate's multimodal rotary positions (Qwen-VL's ``[4, B, S]``)
    lead with them, and their three other rows follow from the ids and the images, which the keys carry
    (prefixkv/hf/vision.py); any other tensor as it is."""
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3 and position_ids.shape[0] == 4:
        return position_ids[0]
    return position_ids


def mask_rows(mask: Any, rows: int, width: int, since: int) -> list[list[bool]] | Literal[False] | None:
    """Columns ``since`` to ``width`` of a forward's 2-D attention mask as lists of bools (``None`` without a
    mask, ``False`` for one the proof cannot read: 4-D, not ``[rows, width]``, or not 0/1). Only the columns asked
    for are read: a decode step reads its new ones, not the whole context."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tuple(mask.shape) != (rows, width):
        return False
    values = mask[:, since:].detach().cpu()
    rows_list: list[list[bool]] = values.tolist()
    if values.dtype == torch.bool:
        return rows_list
    # checked on the Python values: a decode step's one column costs no tensor ops (Python's 0, 1, 0.0, 1.0 are the
    # ints' and floats' 0 and 1 as the tensor compares them; NaN is neither)
    if not set(itertools.chain.from_iterable(rows_list)) <= {0, 1}:
        return False
    return [[v == 1 for v in row] for row in rows_list]


def position_rows(position_ids: Any, rows: int, q: int) -> list[list[int]] | Literal[False] | None:
    """The positions of a forward's ``q`` columns per row (``None`` when the model derives them, ``False`` for
    positions the proof cannot read, such as 3-D rotary sections)."""
    if position_ids is None:
        return None
    position_ids = text_positions(position_ids)
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[0] not in (1, rows):
        return False
    last = position_ids if position_ids.shape[1] <= q else position_ids[:, -q:]  # a decode step's, as it is
    values: list[list[int]] = last.cpu().tolist()
    return values * rows if len(values) == 1 and rows > 1 else values


def positions_ok(row: RowFacts, first: int, shown: list[bool], positions: list[int] | None) -> bool:
    """Whether the shown tokens fed to ``row`` (from its token ``first``) sit at the positions their keys imply:
    the count of shown tokens before each. Without ``position_ids`` the model counts columns, which agrees only
    without padding or holes."""
    if positions is None:
        return row.pad == 0 and row.real == first and all(shown)
    fed = positions[len(positions) - len(shown) :]
    expected = row.real
    for position, visible in zip(fed, shown):
        if visible:
            if position != expected:
                return False
            expected += 1
    return True


def _contradiction(i: int, reused: bool, what: str) -> Verdict:
    """A row whose forward contradicts it: an error where construction reused K/V for it, else it is unproven."""
    if not reused:
        return _FORGET
    return Verdict(
        None,
        error=(
            f"row {i}: the {what} of this forward is not the one this PagedPrefixCache was built for, so the K/V it "
            f"reused are not those this forward needs; build the cache with the {what} you pass to the model (or "
            "build it without input_ids)"
        ),
    )


def prove_rows(
    forward: ForwardInputs, rows: Sequence[RowFacts], start: int, *, reused: bool
) -> list[Verdict | None] | None:
    """The proof, row by row, of a forward that feeds its columns after ``start`` and that :func:`unproven` let
    through (``reused``: the rows hold K/V that construction reused and no forward has computed yet). A row's
    verdict records the new keys only if the forward provably computes their K/V: an attention mask that hides
    exactly the row's padding and the keys' hidden tokens (over every column, or, on a decode step, over the new
    ones) and, where positions matter, positions that count the shown tokens. ``None`` for an unproven row;
    ``None`` for the whole forward when its mask or positions are of a kind the proof cannot read (a 4-D mask,
    3-D positions): then every row is unproven."""
    ids_tensor = forward.input_ids
    if ids_tensor is None or not any(row.proven for row in rows):
        return [None] * len(rows)
    q = ids_tensor.shape[1]
    since = start if forward.decode_step else 0  # the mask's columns to read; `new` is where this forward's begin
    new = start - since
    mask = mask_rows(forward.attention_mask, len(rows), start + q, since)
    positions = position_rows(forward.position_ids, len(rows), q)
    if mask is False or positions is False:
        return None
    ids = ids_tensor.cpu().tolist()
    verdicts: list[Verdict | None] = []
    for i, row in enumerate(rows):
        if not row.proven:
            verdicts.append(None)
            continue
        skip = min(q, max(0, row.pad - start))  # new columns that are padding
        first = max(0, start - row.pad)  # token index of the first new real column
        shown = [True] * (q - skip) if mask is None else mask[i][new + skip : new + q]
        known = row.keys[first : first + q - skip]
        keys = [key(t, v) for t, v in zip(ids[i][skip:], shown)]
        if known:  # a decode step's new token has no key yet: nothing to relabel
            keys = relabel(keys, known)
        verdicts.append(_prove_row(i, row, keys, known, shown, first, mask, new, skip, positions, forward, reused))
    return verdicts


def _prove_row(
    i: int,
    row: RowFacts,
    keys: list[int],
    known: list[int],
    shown: list[bool],
    first: int,
    mask: list[list[bool]] | None,
    new: int,
    skip: int,
    positions: list[list[int]] | None,
    forward: ForwardInputs,
    reused: bool,
) -> Verdict:
    """:func:`prove_rows` for row ``i``, whose new ``keys`` the forward feeds after the ``known`` ones."""
    if keys[: len(known)] != known:
        if token_ids(keys[: len(known)]) != token_ids(known):
            return Verdict(
                None,
                error=(
                    f"row {i}: the tokens fed at positions {first}..{first + len(keys) - 1} differ from the prompt "
                    "this PagedPrefixCache was built with; build a new cache for a new prompt"
                ),
            )
        return _contradiction(i, reused, "attention mask")
    if mask is None:  # the model attends every column: right only with no padding and no holes
        old_ok, pads_hidden = row.pad == 0 and row.real == first, True
    else:
        old = mask[i][:new]  # every held column when the whole mask is read, else none
        pad = min(row.pad, len(old))
        old_ok = old == [False] * pad + [k >= 0 for k in row.keys[: len(old) - pad]]
        pads_hidden = not any(mask[i][new : new + skip])
    if not old_ok:
        verdict = _contradiction(i, reused, "attention mask")
        if verdict.error is not None:
            return verdict
    placed = not forward.positions_matter or positions_ok(
        row, first, shown, None if positions is None else positions[i]
    )
    if not placed:
        verdict = _contradiction(i, reused, "position layout")
        if verdict.error is not None:
            return verdict
    if not (old_ok and pads_hidden and placed):
        return _FORGET
    return Verdict(keys[len(known) :], sum(shown))
