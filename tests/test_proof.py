"""The proof (``prefixkv.hf.proof``, docs/correctness.md, "Publish only what is proven") as a table: a forward's
inputs and a row's facts in, a verdict out, with no model. One row of a table per rule, and for each rule the
cases where it must refuse. The end-to-end tests (test_never_wrong.py, test_edges.py) check that the cache
applies the verdicts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from prefixkv.hf.proof import ForwardInputs, Verdict, changing_inputs, custom_positions, prove_rows, unproven


@dataclass
class Facts:
    """A row as the proof reads it."""

    pad: int = 0
    keys: list[int] = field(default_factory=list)
    proven: bool = True
    real: int = 0


def ids(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(list(rows))


def mask(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(list(rows))


SPACE = ("model", "no adapter")

# name, forward, training, namespace now, expected reason (None: nothing rules the forward out)
UNPROVEN = [
    ("plain forward", ForwardInputs(ids([5, 6])), False, SPACE, None),
    ("use_cache=False re-feeds", ForwardInputs(ids([5, 6]), use_cache=False), False, SPACE, "use_cache=False"),
    ("use_cache=True is fine", ForwardInputs(ids([5, 6]), use_cache=True), False, SPACE, None),
    (
        "embeddings are not their ids",
        ForwardInputs(None, torch.zeros(1, 2, 4)),
        False,
        SPACE,
        "inputs_embeds (their K/V need not be those of the ids)",
    ),
    (
        "an input that changes K/V",
        ForwardInputs(ids([5, 6]), others=("token_type_ids",)),
        False,
        SPACE,
        "token_type_ids (inputs whose effect on K/V prefixkv cannot check)",
    ),
    (
        "training mode",
        ForwardInputs(ids([5, 6])),
        True,
        SPACE,
        "a model in training mode (dropout makes K/V random; call model.eval())",
    ),
    ("another adapter", ForwardInputs(ids([5, 6])), False, ("model", "lora"), "another adapter or changed weights"),
    ("a decode step does not re-check the adapter", ForwardInputs(ids([5]), decode_step=True), False, ("x",), None),
]


@pytest.mark.parametrize("forward, training, space, expected", [c[1:] for c in UNPROVEN], ids=[c[0] for c in UNPROVEN])
def test_what_rules_out_every_row(forward: ForwardInputs, training: bool, space: Any, expected: str | None) -> None:
    assert unproven(forward, training=training, space=lambda: space, held_space=SPACE) == expected


def test_only_inputs_outside_the_neutral_list_change_kv() -> None:
    inputs = {
        "input_ids": ids([1]),
        "attention_mask": mask([1]),
        "cache": object(),
        "use_cache": True,
        "is_first_iteration": True,
        "logits_to_keep": 1,
        "token_type_ids": ids([0]),
        "pixel_values": torch.zeros(1),
        "position_ids": None,
        "labels": None,
    }
    assert changing_inputs(inputs) == ("pixel_values", "token_type_ids")
    # a generate step's arguments hold generate's own settings too; only tensors among them reach the forward
    assert changing_inputs({**inputs, "tokenizer": object()}) == ("pixel_values", "token_type_ids", "tokenizer")
    assert changing_inputs({**inputs, "tokenizer": object()}, tensors_only=True) == ("pixel_values", "token_type_ids")
    # a prompt's images that the keys carry do not count, nor an empty mapping; a decode step's neutral names give none
    assert changing_inputs(inputs, keyed=frozenset({"pixel_values"})) == ("token_type_ids",)
    assert changing_inputs({**inputs, "mm_encoder_outputs": {}}) == ("pixel_values", "token_type_ids")
    assert changing_inputs({"input_ids": ids([1]), "use_cache": True, "position_ids": ids([3])}) == ()
    record = ForwardInputs.of(inputs, positions_matter=True, decode_step=False)
    assert record.others == ("pixel_values", "token_type_ids") and record.input_ids is inputs["input_ids"]


def positions(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(list(rows))


H = -1 - 7  # the key of token 7 where the mask hides it

# name, row, start, forward, reused, expected verdict
ROWS: list[tuple[str, Facts, int, ForwardInputs, bool, Verdict | None]] = [
    ("a prompt fed in order", Facts(), 0, ForwardInputs(ids([5, 6, 7])), False, Verdict([5, 6, 7], 3)),
    ("a decode step after it", Facts(keys=[5, 6], real=2), 2, ForwardInputs(ids([9])), False, Verdict([9], 1)),
    (
        "left padding the mask hides",
        Facts(pad=2),
        0,
        ForwardInputs(ids([0, 0, 5, 6]), attention_mask=mask([0, 0, 1, 1]), position_ids=positions([1, 1, 0, 1])),
        False,
        Verdict([5, 6], 2),
    ),
    (
        "left padding the mask hides, positions counting columns",
        Facts(pad=2),
        0,
        ForwardInputs(ids([0, 0, 5, 6]), attention_mask=mask([0, 0, 1, 1])),
        False,
        Verdict(None),
    ),
    (
        "left padding and no mask: the model attends the pads",
        Facts(pad=2),
        0,
        ForwardInputs(ids([0, 0, 5, 6])),
        False,
        Verdict(None),
    ),
    (
        "a mask that shows a pad column",
        Facts(pad=2),
        0,
        ForwardInputs(ids([0, 0, 5, 6]), attention_mask=mask([0, 1, 1, 1]), position_ids=positions([1, 0, 0, 1])),
        False,
        Verdict(None),
    ),
    (
        "a hole keys its token apart",
        Facts(),
        0,
        ForwardInputs(ids([5, 7, 6]), attention_mask=mask([1, 0, 1]), position_ids=positions([0, 0, 1])),
        False,
        Verdict([5, H, 6], 2),
    ),
    (
        "a hole without positions: the model counts columns",
        Facts(),
        0,
        ForwardInputs(ids([5, 7, 6]), attention_mask=mask([1, 0, 1])),
        False,
        Verdict(None),
    ),
    (
        "a hole, positions counted by a model that takes none (ALiBi)",
        Facts(),
        0,
        ForwardInputs(ids([5, 7, 6]), attention_mask=mask([1, 0, 1]), positions_matter=False),
        False,
        Verdict([5, H, 6], 2),
    ),
    (
        "positions that skip one",
        Facts(keys=[5, 6], real=2),
        2,
        ForwardInputs(ids([9]), position_ids=positions([3])),
        False,
        Verdict(None),
    ),
    (
        "positions that skip one, on reused K/V",
        Facts(keys=[5, 6], real=2),
        2,
        ForwardInputs(ids([9]), position_ids=positions([3])),
        True,
        Verdict(None, error="position layout"),
    ),
    (
        "the held columns' mask differs from the keys",
        Facts(keys=[5, 6], real=2),
        2,
        ForwardInputs(ids([9]), attention_mask=mask([1, 0, 1])),
        False,
        Verdict(None),
    ),
    (
        "the held columns' mask differs, on reused K/V",
        Facts(keys=[5, 6], real=2),
        2,
        ForwardInputs(ids([9]), attention_mask=mask([1, 0, 1])),
        True,
        Verdict(None, error="attention mask"),
    ),
    (
        "a decode step reads only its new columns of the mask",
        Facts(keys=[5, 6], real=2),
        2,
        ForwardInputs(ids([9]), attention_mask=mask([1, 0, 1]), decode_step=True),
        False,
        Verdict([9], 1),
    ),
    (
        "a re-fed prompt token under another mask",
        Facts(keys=[5, 6, 7], real=3),
        2,
        ForwardInputs(ids([7, 8]), attention_mask=mask([1, 1, 0, 1]), position_ids=positions([2, 2])),
        False,
        Verdict(None),
    ),
    (
        "a re-fed prompt token under another mask, on reused K/V",
        Facts(keys=[5, 6, 7], real=2),
        2,
        ForwardInputs(ids([7, 8]), attention_mask=mask([1, 1, 0, 1]), position_ids=positions([2, 2])),
        True,
        Verdict(None, error="attention mask"),
    ),
    (
        "tokens other than the prompt's",
        Facts(keys=[5, 6, 7], real=2),
        2,
        ForwardInputs(ids([8])),
        False,
        Verdict(None, error="differ from the prompt"),
    ),
    ("a row already unproven stays so", Facts(proven=False), 0, ForwardInputs(ids([5, 6])), False, None),
]


@pytest.mark.parametrize("row, start, forward, reused, expected", [c[1:] for c in ROWS], ids=[c[0] for c in ROWS])
def test_what_a_forward_proves_of_a_row(
    row: Facts, start: int, forward: ForwardInputs, reused: bool, expected: Verdict | None
) -> None:
    verdicts = prove_rows(forward, [row], start, reused=reused)
    assert verdicts is not None
    (got,) = verdicts
    if expected is None or expected.error is None:
        assert got == expected
    else:
        assert got is not None and got.keys is None and got.error is not None and expected.error in got.error


@pytest.mark.parametrize(
    "forward",
    [
        ForwardInputs(ids([5, 6]), attention_mask=torch.ones(1, 1, 2, 2, dtype=torch.bool)),
        ForwardInputs(ids([5, 6]), attention_mask=mask([1, 1, 1])),
        ForwardInputs(ids([5, 6]), attention_mask=torch.tensor([[1.0, 0.5]])),
        ForwardInputs(ids([5, 6]), position_ids=torch.zeros(3, 1, 2, dtype=torch.long)),
    ],
    ids=["4-D mask", "mask of another width", "mask of other values", "3-D positions"],
)
def test_a_mask_or_positions_the_proof_cannot_read_rules_out_every_row(forward: ForwardInputs) -> None:
    assert prove_rows(forward, [Facts()], 0, reused=False) is None


def test_rows_of_a_batch_are_proven_each_on_its_own() -> None:
    forward = ForwardInputs(
        ids([0, 5, 6], [4, 5, 6]),
        attention_mask=mask([0, 1, 1], [1, 1, 1]),
        position_ids=positions([1, 0, 1], [0, 1, 2]),
    )
    padded_with_mask_hiding_pad, plain = Facts(pad=1), Facts(pad=0)
    assert prove_rows(forward, [padded_with_mask_hiding_pad, plain], 0, reused=False) == [
        Verdict([5, 6], 2),
        Verdict([4, 5, 6], 3),
    ]
    no_mask = ForwardInputs(ids([0, 5, 6], [4, 5, 6]))
    assert prove_rows(no_mask, [Facts(pad=1), Facts()], 0, reused=False) == [Verdict(None), Verdict([4, 5, 6], 3)]


CALLS = [
    ("no positions of its own", ids([5, 6, 7]), None, None, False),
    ("the mask's positions", ids([5, 6, 7]), None, positions([0, 1, 2]), False),
    ("the mask's positions under padding", ids([0, 5, 6]), mask([0, 1, 1]), positions([1, 0, 1]), False),
    ("shifted positions", ids([5, 6, 7]), None, positions([1, 2, 3]), True),
    ("positions of another shape", ids([5, 6, 7]), None, positions([0, 1]), True),
]


@pytest.mark.parametrize(
    "input_ids, attention_mask, position_ids, wrong", [c[1:] for c in CALLS], ids=[c[0] for c in CALLS]
)
def test_a_calls_own_positions_make_construction_reuse_wrong(
    input_ids: torch.Tensor, attention_mask: Any, position_ids: Any, wrong: bool
) -> None:
    assert (custom_positions(input_ids, attention_mask, position_ids) is not None) == wrong
