"""Saving, loading and merging cached prefixes: a round trip reuses the prefixes and matches stock
generate in float64; a file is refused, with the store unchanged, for another model, dtype, shape or
block size, and when truncated, corrupted, edited or from a newer format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import compare, random_tokens

import prefixkv
from prefixkv import CacheMisuseError, CapacityError, PersistError
from prefixkv.kv.fingerprint import fingerprint
from prefixkv.kv.prefix_file import FORMAT_VERSION

TOL = 1e-6
BS = 4
SYSTEM = random_tokens(45, seed=101)
DOC = random_tokens(26, seed=102)


def llama(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides: Any) -> Any:
    return prefixkv.models.tiny_model("llama", dtype=dtype, seed=seed, **overrides)


def ask(prefix: torch.Tensor, seed: int, n: int = 6) -> torch.Tensor:
    return torch.cat([prefix, random_tokens(n, seed=seed)])[None]


@pytest.fixture(scope="module")
def source() -> Any:
    """A store that answered two questions after SYSTEM and one after DOC."""
    model = llama()
    store = prefixkv.PrefixStore(model, block_size=BS)
    for ids in (ask(SYSTEM, 1), ask(SYSTEM, 2), ask(DOC, 3)):
        assert compare(model, store, ids, max_new_tokens=4).max_diff <= TOL
    yield store
    store.close()


@pytest.fixture(scope="module")
def saved(source: prefixkv.PrefixStore, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prefixes") / "all.safetensors"
    info = source.save(path)
    assert info.tokens == source.stats.cached_tokens
    assert info.blocks == source.stats.blocks_used
    assert info.prefixes == 3
    return path


def edited(path: Path, tmp_path: Path, edit: Any) -> Path:
    out = tmp_path / "edited.safetensors"
    out.write_bytes(edit(bytearray(path.read_bytes())))
    return out


def snapshot(store: prefixkv.PrefixStore) -> tuple[Any, ...]:
    """What a refused merge must leave as it was: counters, trie contents, the pool's bytes."""
    store.check_invariants()
    paths = sorted((n.start, tuple(n.tokens), tuple(n.blocks)) for n in store.blocks._trie.nodes())
    return store.stats, paths, [k.clone() for k in store.pool.keys]


def assert_same(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    assert a[:2] == b[:2]
    assert all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


def test_round_trip_reuses_the_prefixes_and_matches_stock(source: prefixkv.PrefixStore, saved: Path) -> None:
    model = llama()  # a fresh process would build it the same way
    store = prefixkv.PrefixStore.load(saved, model)
    store.check_invariants()
    assert store.block_size == BS and store.dtype == torch.float64
    assert store.stats.cached_tokens == source.stats.cached_tokens
    ids = ask(SYSTEM, 4, n=9)
    first = compare(model, store, ids)
    assert first.same_tokens and first.max_diff <= TOL
    assert first.cache.stats.cached_tokens == 45  # all of SYSTEM, the 45th from a copied part-block
    assert first.fed_tokens == ids.shape[1] - 45
    doc = compare(model, store, ask(DOC, 5))
    assert doc.max_diff <= TOL and doc.cache.stats.cached_tokens == 26
    store.close()


def test_a_loaded_store_saves_the_same_prefixes(saved: Path, tmp_path: Path) -> None:
    model = llama()
    with prefixkv.PrefixStore.load(saved, model) as store:
        again = store.save(tmp_path / "again.safetensors")
    with prefixkv.PrefixStore.load(tmp_path / "again.safetensors", model) as reloaded:
        for ids in (ask(SYSTEM, 6), ask(DOC, 7)):
            with prefixkv.PagedPrefixCache(reloaded, ids) as cache:
                assert cache.stats.cached_tokens == ids.shape[1] - 6
    assert again.prefixes == 3


def test_a_differently_seeded_model_is_refused(saved: Path) -> None:
    other = llama(seed=1)
    with pytest.raises(PersistError, match="other weights"):
        prefixkv.PrefixStore.load(saved, other)
    assert other.config._attn_implementation == "sdpa"  # no store was left attached
    with prefixkv.PrefixStore(other, block_size=BS) as live:
        before = snapshot(live)
        with pytest.raises(PersistError, match="other weights"):
            live.merge(saved)
        assert_same(before, snapshot(live))


@pytest.mark.parametrize(
    ("model", "kwargs", "message"),
    [
        (lambda: llama(dtype=torch.float32), {}, r"computed by a model in torch\.float64"),
        (lambda: llama(num_key_value_heads=4), {}, "another model"),
        (lambda: llama(num_hidden_layers=3), {}, "this model has 3 of 2 heads x 16"),
        (llama, {"block_size": 8}, "block_size=4"),
        (llama, {"dtype": torch.float32}, "dtype=torch.float64"),
    ],
    ids=["model-dtype", "kv-heads", "layers", "block-size", "store-dtype"],
)
def test_other_dtypes_shapes_and_block_sizes_are_refused(
    saved: Path, model: Any, kwargs: dict[str, Any], message: str
) -> None:
    m = model()
    with pytest.raises(PersistError, match=message):
        prefixkv.PrefixStore.load(saved, m, **kwargs)
    assert m.config._attn_implementation == "sdpa"


def test_a_truncated_file_is_refused_and_the_store_unchanged(saved: Path, tmp_path: Path) -> None:
    with prefixkv.PrefixStore(llama(), block_size=BS) as live:
        compare(live.model, live, ask(SYSTEM, 8))
        before = snapshot(live)
        for keep in (5, 100, len(saved.read_bytes()) - 1):
            cut = edited(saved, tmp_path, lambda b, n=keep: b[:n])
            with pytest.raises(PersistError, match="not a readable safetensors file"):
                live.merge(cut)
            with pytest.raises(PersistError, match="truncated or corrupted"):
                prefixkv.PrefixStore.load(cut, llama())
        assert_same(before, snapshot(live))


def test_flipped_bytes_in_the_tensor_data_fail_the_checksum(saved: Path, tmp_path: Path) -> None:
    size = len(saved.read_bytes())

    def flip(b: bytearray, at: int) -> bytearray:
        b[at] ^= 0x40
        return b

    with prefixkv.PrefixStore(llama(), block_size=BS) as live:
        before = snapshot(live)
        for at in (size - 3, size // 2 + 7):  # K/V bytes near the end, trie or K/V bytes mid-file
            with pytest.raises(PersistError, match="checksum"):
                live.merge(edited(saved, tmp_path, lambda b, i=at: flip(b, i)))
        assert_same(before, snapshot(live))


def test_a_tampered_header_is_refused(saved: Path, tmp_path: Path) -> None:
    def replace(old: bytes, new: bytes) -> Any:
        def edit(b: bytearray) -> bytearray:
            assert old in b and len(old) == len(new)
            return bytearray(b.replace(old, new, 1))

        return edit

    model = llama()
    cases = [
        (b'"block_size":"4"', b'"block_size":"8"', "checksum"),
        (b'"dtype":"float64"', b'"dtype":"float32"', "checksum"),
        (b'"dtype":"I64"', b'"dtype":"F64"', "checksum"),  # the first trie tensor reinterpreted
        (b'"format":"prefixkv', b'"format":"prefixKV', "not a prefixkv prefix file"),
        (f'"format_version":"{FORMAT_VERSION}"'.encode(), b'"format_version":"7"', "newer prefixkv"),
        (b'"__metadata__":{', b'"__metadata__":[', "not a readable safetensors file"),
    ]
    for old, new, message in cases:
        with pytest.raises(PersistError, match=message):
            prefixkv.PrefixStore.load(edited(saved, tmp_path, replace(old, new)), model)
    assert model.config._attn_implementation == "sdpa"


def test_a_well_checksummed_but_malformed_trie_is_refused(saved: Path, tmp_path: Path) -> None:
    """A file made by hand with a valid checksum still cannot corrupt a store."""
    from safetensors.torch import load_file, save_file

    from prefixkv.kv.prefix_file import checksum, read

    tensors, meta = load_file(saved), read(saved).meta
    breakages = {
        "trie.parent": lambda t: t.flip(0),  # children before their parents
        "trie.blocks": lambda t: t + 1000,  # blocks the file does not hold
        "trie.num_blocks": lambda t: t + 1,  # more blocks than a node's edge touches
        "k.1": lambda t: t[:, :2],  # K of the wrong block size
    }
    model = llama()
    for name, breakage in breakages.items():
        broken = {**tensors, name: breakage(tensors[name]).contiguous()}
        save_file(broken, tmp_path / "made.safetensors", metadata={**meta, "checksum": checksum(broken, meta)})
        with pytest.raises(PersistError, match="is malformed"):
            prefixkv.PrefixStore.load(tmp_path / "made.safetensors", model)
    assert model.config._attn_implementation == "sdpa"


def test_save_a_subset_of_prefixes(source: prefixkv.PrefixStore, tmp_path: Path) -> None:
    path = tmp_path / "system.safetensors"
    info = source.save(path, prefixes=[SYSTEM])
    assert info == prefixkv.PersistStats(prefixes=1, tokens=45, blocks=12)  # 45 tokens touch 12 chunks
    model = llama()
    with prefixkv.PrefixStore.load(path, model) as store:
        assert store.stats.cached_tokens == 45 and store.stats.blocks_used == 12
        with prefixkv.PagedPrefixCache(store, ask(DOC, 9)) as cache:
            assert cache.stats.cached_tokens == 0
        warm = compare(model, store, ask(SYSTEM, 10))
        assert warm.same_tokens and warm.max_diff <= TOL
        assert warm.cache.stats.cached_tokens == 45
    # a prefix cached only in part is saved up to where it is cached
    longer = torch.cat([DOC, random_tokens(30, seed=11)])
    assert source.save(tmp_path / "doc.safetensors", prefixes=[longer[None]]).tokens == 26
    with pytest.raises(ValueError, match=r"prefix 1 \(9 tokens\) is not cached"):
        source.save(tmp_path / "none.safetensors", prefixes=[SYSTEM, random_tokens(9, seed=12)])


def test_merge_adds_only_the_blocks_the_store_lacks(saved: Path) -> None:
    model = llama()
    with prefixkv.PrefixStore(model, block_size=BS) as live:
        compare(model, live, ask(SYSTEM, 1), max_new_tokens=4)  # the source's first question, again
        used = live.stats.blocks_used
        added = live.merge(saved)
        live.check_invariants()
        assert added.prefixes == 2  # the second SYSTEM question and the DOC question
        assert live.stats.blocks_used == used + added.blocks
        assert added.blocks < prefixkv.PrefixStore.load(saved, llama()).stats.blocks_used
        assert live.merge(saved) == prefixkv.PersistStats(0, 0, 0)
        result = compare(model, live, ask(DOC, 13))
        assert result.same_tokens and result.max_diff <= TOL and result.cache.stats.cached_tokens == 26
        # the second question branches off at token 45, inside a block: the file's copy of that block
        # holds the shared token 44 and the question's first three
        second = compare(model, live, ask(SYSTEM, 2))
        assert second.same_tokens and second.max_diff <= TOL and second.cache.stats.cached_tokens == 50


def test_merge_evicts_within_the_budget_or_raises_before_any_change(saved: Path) -> None:
    model = llama()
    need = prefixkv.PrefixStore.load(saved, llama()).stats.blocks_used
    with prefixkv.PrefixStore(model, block_size=BS, num_blocks=need) as live:
        other = random_tokens(20, seed=14)[None]
        compare(model, live, other)
        held = live.stats.blocks_used
        live.merge(saved)
        live.check_invariants()
        assert held == 6 and live.stats.evictions > 0 and live.stats.blocks_used == need
        with prefixkv.PagedPrefixCache(live, other) as cache:
            assert cache.stats.cached_tokens == 0  # the older prefix made room
    with prefixkv.PrefixStore(model, block_size=BS, num_blocks=need - 1) as small:
        compare(model, small, other)
        before = snapshot(small)
        with pytest.raises(CapacityError, match=f"needs {need} new KV blocks"):
            small.merge(saved)
        assert_same(before, snapshot(small))
    with pytest.raises(CapacityError):
        prefixkv.PrefixStore.load(saved, model, num_blocks=3)
    assert model.config._attn_implementation == "sdpa"  # the half-built store was closed


def test_a_model_cast_after_the_store_was_built_is_an_error(tmp_path: Path) -> None:
    model = llama()
    store = prefixkv.PrefixStore(model, block_size=BS)
    ids = ask(SYSTEM, 15)
    compare(model, store, ids)
    model.to(torch.float32)
    with pytest.raises(CacheMisuseError, match="moved or cast after the PrefixStore was built"):
        model.generate(ids, cache=prefixkv.PagedPrefixCache(store, ids), max_new_tokens=2)
    with pytest.raises(PersistError, match="cast"):
        store.save(tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    model.to(torch.float64)
    store.check_invariants()
    assert compare(model, store, ids).max_diff <= TOL
    store.close()


def test_fingerprint_tells_weights_and_adapters_apart() -> None:
    a, b = llama(), llama()
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint(llama(seed=1))
    assert fingerprint(a) != fingerprint(llama(dtype=torch.float32))
    with torch.no_grad():
        b.model.layers[1].self_attn.k_proj.weight[3, 5] += 1e-9  # a value inside the hashed sample
    assert fingerprint(a) != fingerprint(b)
    c = llama(rope_theta=500.0)
    assert fingerprint(a) != fingerprint(c)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_fingerprint_tells_the_active_and_the_disabled_adapters_apart() -> None:
    """A real PEFT model (a duck-typed one hid that the fingerprint read the wrapper, which always says
    "disabled"): the active adapter and disabling it each change the fingerprint, nothing else being changed."""
    peft = pytest.importorskip("peft")
    lora = {"r": 4, "target_modules": ["k_proj", "v_proj"], "init_lora_weights": False}
    wrapped = peft.get_peft_model(llama(), peft.LoraConfig(**lora), adapter_name="french")
    wrapped.add_adapter("german", peft.LoraConfig(**lora))
    french = fingerprint(wrapped)
    with wrapped.disable_adapter():
        disabled = fingerprint(wrapped)
    wrapped.set_adapter("german")
    german = fingerprint(wrapped)
    wrapped.set_adapter("french")
    assert len({french, disabled, german}) == 3
    assert fingerprint(wrapped) == french
