"""Bad input gets a clear error, and the store stays consistent and usable afterwards."""

from __future__ import annotations

import pytest
import torch
from conftest import compare, random_tokens

import prefixkv
from prefixkv import CacheMisuseError, CapacityError


@pytest.fixture
def store(llama64: object) -> prefixkv.PrefixStore:
    s = prefixkv.PrefixStore(llama64, block_size=4)
    yield s
    s.check_invariants()
    s.close()


@pytest.mark.parametrize("size", [0, -3, 1.5, True])
def test_block_size_must_be_a_positive_int(llama64: object, size: object) -> None:
    with pytest.raises(ValueError, match="block_size"):
        prefixkv.PrefixStore(llama64, block_size=size)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "ids",
    [
        torch.arange(5),
        torch.rand(1, 5),
        [[1, 2, 3]],
        torch.zeros(1, 0, dtype=torch.long),
        torch.ones(1, 2, 3).long(),
    ],
    ids=["1-D", "float", "list", "empty", "3-D"],
)
def test_input_ids_must_be_2d_integers(store: prefixkv.PrefixStore, ids: object) -> None:
    with pytest.raises(ValueError, match="input_ids"):
        prefixkv.PagedPrefixCache(store, ids)  # type: ignore[arg-type]


def test_attention_mask_shape_and_padding_side(store: prefixkv.PrefixStore) -> None:
    ids = random_tokens(6, seed=1).view(2, 3)
    with pytest.raises(ValueError, match="shape of input_ids"):
        prefixkv.PagedPrefixCache(store, ids, torch.ones(2, 4, dtype=torch.long))
    # right padding is accepted: the hidden token is keyed apart (tests/test_never_wrong.py checks the logits)
    right = prefixkv.PagedPrefixCache(store, ids, torch.tensor([[1, 1, 0], [1, 1, 1]]))
    assert right._rowset.rows[0].keys == [ids[0, 0].item(), ids[0, 1].item(), -1 - ids[0, 2].item()]
    right.close()
    with pytest.raises(ValueError, match="all padding"):
        prefixkv.PagedPrefixCache(store, ids, torch.tensor([[0, 0, 0], [1, 1, 1]]))
    with pytest.raises(ValueError, match="only 0"):
        prefixkv.PagedPrefixCache(store, ids, torch.tensor([[2, 1, 1], [1, 1, 1]]))
    with pytest.raises(ValueError, match="only 0"):  # a float mask is not read as padding where it is 0.5
        prefixkv.PagedPrefixCache(store, ids, torch.tensor([[0.5, 1.0, 1.0], [1.0, 1.0, 1.0]]))


def test_cache_from_a_store_of_another_model(store: prefixkv.PrefixStore) -> None:
    other = prefixkv.models.tiny_model("llama", dtype=torch.float64, num_key_value_heads=4)
    ids = random_tokens(10, seed=2)[None]
    with pytest.raises(CacheMisuseError, match=r"another model|was built for"):
        other.generate(ids, cache=prefixkv.PagedPrefixCache(store, ids), max_new_tokens=2)
    same_shape = prefixkv.models.tiny_model("llama", dtype=torch.float64, seed=1)
    with pytest.raises(CacheMisuseError, match="outside a forward of the model"):
        same_shape.generate(ids, cache=prefixkv.PagedPrefixCache(store, ids), max_new_tokens=2)


def test_store_dtype_mismatch_is_refused(llama64: object) -> None:
    model32 = prefixkv.models.tiny_model("llama", dtype=torch.float32)
    store = prefixkv.PrefixStore(model32)
    model32.to(torch.float64)
    ids = random_tokens(10, seed=3)[None]
    with pytest.raises(CacheMisuseError, match="moved or cast"):
        model32.generate(ids, cache=prefixkv.PagedPrefixCache(store, ids), max_new_tokens=2)
    store.close()


def test_cache_built_for_another_prompt(store: prefixkv.PrefixStore, llama64: object) -> None:
    a, b = random_tokens(10, seed=4)[None], random_tokens(10, seed=5)[None]
    with pytest.raises(CacheMisuseError, match="differ from the prompt"):
        llama64.generate(b, cache=prefixkv.PagedPrefixCache(store, a), max_new_tokens=2)


def test_store_too_small_for_the_request(llama64: object) -> None:
    store = prefixkv.PrefixStore(llama64, block_size=4, num_blocks=3)
    ids = random_tokens(20, seed=6)[None]
    with pytest.raises(CapacityError, match=r"budget 3 blocks.*held by live caches.*Raise max_memory"):
        llama64.generate(ids, cache=prefixkv.PagedPrefixCache(store, ids), max_new_tokens=2)
    import gc

    gc.collect()
    store.check_invariants()
    small = random_tokens(6, seed=7)[None]
    result = compare(llama64, store, small, max_new_tokens=3)
    assert result.same_tokens and result.max_diff <= 1e-6
    store.close()


def test_budget_arguments(llama64: object) -> None:
    with pytest.raises(ValueError, match="not both"):
        prefixkv.PrefixStore(llama64, max_memory="1MiB", num_blocks=4)
    with pytest.raises(ValueError, match="less than one block"):
        prefixkv.PrefixStore(llama64, max_memory=100)
    with pytest.raises(ValueError, match="memory size"):
        prefixkv.PrefixStore(llama64, max_memory="lots")
    store = prefixkv.PrefixStore(llama64, block_size=4, max_memory="64KiB")
    # the pool's tensors, the reserved padding block included, stay within max_memory
    assert store.max_blocks == 64 * 1024 // store.bytes_per_block - 1
    assert (store.max_blocks + 1) * store.bytes_per_block <= 64 * 1024
    store.close()


def test_closed_cache_cannot_be_used(store: prefixkv.PrefixStore, llama64: object) -> None:
    ids = random_tokens(8, seed=8)[None]
    cache = prefixkv.PagedPrefixCache(store, ids)
    cache.close()
    with pytest.raises(CacheMisuseError, match="closed"):
        llama64.generate(ids, cache=cache, max_new_tokens=2)


def test_unsupported_families_are_refused() -> None:
    from transformers import AutoModelForSeq2SeqLM, T5Config

    config = T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=64, decoder_start_token_id=0)
    model = AutoModelForSeq2SeqLM.from_config(config)
    with pytest.raises(prefixkv.UnsupportedModelError, match="t5 is an encoder-decoder"):
        prefixkv.PrefixStore(model)
