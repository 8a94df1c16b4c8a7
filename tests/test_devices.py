"""Every layer's pool lives where that layer computes: models dispatched by accelerate (layers offloaded
to CPU or disk, or split across a GPU and the CPU) give the logits of stock generate, cold and warm,
and load prefixes saved from the same weights in another layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import cpu_offload, disk_offload, dispatch_model
from conftest import compare, random_tokens

import prefixkv
from prefixkv import CacheMisuseError
from prefixkv.kv.fingerprint import fingerprint

TOL = 1e-6
SYSTEM = random_tokens(37, seed=201)


def llama() -> Any:
    return prefixkv.models.tiny_model("llama", dtype=torch.float64)


def device_map(layer0: Any, layer1: Any, rest: Any) -> dict[str, Any]:
    return {
        "model.embed_tokens": rest,
        "model.rotary_emb": rest,
        "model.layers.0": layer0,
        "model.layers.1": layer1,
        "model.norm": rest,
        "lm_head": rest,
    }


LAYOUTS = {
    "dispatch-cpu-disk": lambda folder: dispatch_model(
        llama(), device_map=device_map("cpu", "disk", "cpu"), offload_dir=str(folder)
    ),
    "cpu-offload": lambda folder: cpu_offload(llama(), execution_device="cpu"),
    "disk-offload": lambda folder: disk_offload(llama(), str(folder), execution_device="cpu"),
}


def cold_then_warm(
    model: Any, store: prefixkv.PrefixStore, cached: int, device: str = "cpu", warm: int = len(SYSTEM)
) -> None:
    """A call after SYSTEM reuses ``cached`` tokens, then a second one ``warm`` (all of SYSTEM); both exact."""
    for seed, reused in ((1, cached), (2, warm)):
        ids = torch.cat([SYSTEM, random_tokens(5, seed=seed)])[None].to(device)
        result = compare(model, store, ids, max_new_tokens=4)
        assert result.same_tokens and result.max_diff <= TOL
        assert result.cache.stats.cached_tokens == reused
        assert result.fed_tokens == ids.shape[1] - reused


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SYSTEM's prefix, saved from a plain model on the CPU."""
    plain = llama()
    path = tmp_path_factory.mktemp("devices") / "system.safetensors"
    with prefixkv.PrefixStore(plain, block_size=4) as source:
        cold_then_warm(plain, source, cached=0)
        source.save(path, prefixes=[SYSTEM])
    return path


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_offloaded_layouts_match_stock_and_load_saved_prefixes(layout: str, saved: Path, tmp_path: Path) -> None:
    model = LAYOUTS[layout](tmp_path / "offload")
    assert any(p.device.type == "meta" for p in model.parameters())  # accelerate holds some weights
    assert fingerprint(model) == fingerprint(llama())
    with prefixkv.PrefixStore(model, block_size=4) as store:
        assert [s.device for s in store.pool.specs] == [torch.device("cpu")] * 2
        assert [k.device for k in store.pool.keys] == [torch.device("cpu")] * 2
        cold_then_warm(model, store, cached=0)
    with prefixkv.PrefixStore.load(saved, model) as loaded:
        cold_then_warm(model, loaded, cached=len(SYSTEM))


def test_fingerprint_is_the_same_in_every_layout_with_tied_weights(tmp_path: Path) -> None:
    def tied() -> Any:
        return prefixkv.models.tiny_model("llama", dtype=torch.float64, tie_word_embeddings=True)

    expected = fingerprint(tied())
    assert expected != fingerprint(llama())
    layouts = [
        dispatch_model(tied(), device_map=device_map("cpu", "disk", "disk"), offload_dir=str(tmp_path / "a")),
        cpu_offload(tied(), execution_device="cpu"),
        disk_offload(tied(), str(tmp_path / "b"), execution_device="cpu"),
    ]
    assert [fingerprint(m) for m in layouts] == [expected] * 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("main", "pools"),
    [("cpu", ["cuda", "cpu"]), ("cuda:0", ["cuda", "cuda"])],
    ids=["layer1-computes-on-cpu", "layer1-offloaded-to-cpu"],
)
def test_layers_split_across_cuda_and_cpu(main: str, pools: list[str], tmp_path: Path) -> None:
    # with a CPU main device layer 1 computes on the CPU; with a GPU one accelerate keeps its weights in
    # CPU memory and computes it on the GPU
    model = dispatch_model(llama(), device_map=device_map(0, "cpu", 0), main_device=main)
    with prefixkv.PrefixStore(model, block_size=4) as store:
        assert [k.device.type for k in store.pool.keys] == pools
        cold_then_warm(model, store, cached=0, device=main)
        store.save(tmp_path / "split.safetensors")
    plain = llama()  # the same weights, all on the CPU: the file loads, its K/V match within float64 noise
    with prefixkv.PrefixStore.load(tmp_path / "split.safetensors", plain) as loaded:
        # the file holds both calls' prompts: each reuses all of its 42 tokens but the last
        cold_then_warm(plain, loaded, cached=len(SYSTEM) + 4, warm=len(SYSTEM) + 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_model_moved_after_the_store_was_built_is_an_error() -> None:
    model = llama()
    store = prefixkv.PrefixStore(model, block_size=4)
    ids = torch.cat([SYSTEM, random_tokens(5, seed=3)])[None]
    compare(model, store, ids)
    model.to("cuda")
    with pytest.raises(CacheMisuseError, match="moved or cast after the PrefixStore was built"):
        model.generate(ids.cuda(), cache=prefixkv.PagedPrefixCache(store, ids), max_new_tokens=2)
    model.to("cpu")
    store.check_invariants()
    assert compare(model, store, ids).max_diff <= TOL
    store.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_device_without_index_is_read_as_the_current_one() -> None:
    from prefixkv.kv.key_space import _with_index

    # accelerate may name the device "cuda"; tensors computed there report "cuda:0"
    assert _with_index(torch.device("cuda")) == torch.device("cuda", torch.cuda.current_device())
    assert _with_index(torch.device("cpu")) == torch.device("cpu")
