"""Images in the prompt (docs/generate.md, "Images"): a vision-language model's placeholders are keyed by a digest of
their image's processed inputs, so K/V are reused only for the same image processed alike; every call is compared with
stock generate on an untouched twin, every step's logits, float64."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from conftest import cache_kw, max_logit_diff, stock_twin

import prefixkv
from prefixkv.base.errors import CacheMisuseError
from prefixkv.compat import releases
from prefixkv.hf import vision

# transformers 4.x feeds no images to a forward that starts past position 0, so there a call with images reuses
# nothing (tests/test_compat.py::test_a_call_with_images_reuses_nothing_on_transformers_4)
pytestmark = pytest.mark.skipif(
    not releases.WARM_FORWARDS_TAKE_IMAGES, reason="transformers 4.x: a call with images reuses nothing"
)

IMAGE = 250
# a hybrid (issue 45): it resumes only where the store holds a snapshot of its recurrent states, taken by the runner
# before the first image (it computes ids alone) and at the end of each call (a chat's next turn resumes there)
RECURRENT = {"qwen3_5"}
FAMILIES = ["llava", "qwen2_vl", "qwen3_vl", "gemma3", "mistral3", "idefics3", "qwen3_5"]


def _image_tokens(family: str) -> list[int]:
    """The tokens of one image in a prompt of the tiny ``family`` (prefixkv.models): placeholders and their frame."""
    if family == "llava":
        return [IMAGE] * 16
    if family in ("qwen2_vl", "qwen3_vl", "qwen3_5"):
        return [252, *[IMAGE] * 4, 253]
    if family == "gemma3":
        return [251, *[IMAGE] * 4, 252]
    if family == "idefics3":
        return [251, 252, *[IMAGE] * 4, 251]
    rows = [
        [IMAGE] * 4 + [12] for _ in range(4)
    ]  # mistral3: 4 rows of 4, an [IMG_BREAK] after each, the last [IMG_END]
    rows[-1][-1] = 13
    return [t for r in rows for t in r]


def _pixels(family: str, seed: int) -> dict[str, torch.Tensor]:
    """The processed inputs of one random image of the tiny ``family``."""
    g = torch.Generator().manual_seed(seed)
    if family in ("qwen2_vl", "qwen3_vl", "qwen3_5"):
        return {
            "pixel_values": torch.randn(16, 24, generator=g, dtype=torch.float64),
            "image_grid_thw": torch.tensor([[1, 4, 4]]),
        }
    side = 32 if family == "mistral3" else 16
    if family == "idefics3":  # [batch, images, 3, h, w]: prompt() gathers each row's images
        return {
            "pixel_values": torch.randn(1, 1, 3, side, side, generator=g, dtype=torch.float64),
            "pixel_attention_mask": torch.ones(1, 1, side, side, dtype=torch.bool),
        }
    out = {"pixel_values": torch.randn(1, 3, side, side, generator=g, dtype=torch.float64)}
    if family == "mistral3":
        out["image_sizes"] = torch.tensor([[side, side]])
    return out


def prompt(family: str, rows: list[list[Any]]) -> dict[str, torch.Tensor]:
    """A processor's outputs for ``rows`` of pieces: a list of token ids, or an int, the seed of an image. Rows of
    equal length (no padding)."""
    ids, images = [], []
    for row in rows:
        tokens: list[int] = []
        for piece in row:
            if isinstance(piece, int):
                tokens += _image_tokens(family)
                images.append(_pixels(family, piece))
            else:
                tokens += piece
        ids.append(tokens)
    out: dict[str, torch.Tensor] = {"input_ids": torch.tensor(ids)}
    if family == "idefics3" and images:  # each row's images in a slot of its own, padded with zeros
        counts = [sum(isinstance(p, int) for p in row) for row in rows]
        pixels = torch.zeros(len(rows), max(counts), 3, 16, 16, dtype=torch.float64)
        masks = torch.zeros(len(rows), max(counts), 16, 16, dtype=torch.bool)
        seen = iter(images)
        for b, n in enumerate(counts):
            for j in range(n):
                one = next(seen)
                pixels[b, j], masks[b, j] = one["pixel_values"][0, 0], one["pixel_attention_mask"][0, 0]
        return {**out, "pixel_values": pixels, "pixel_attention_mask": masks}
    for name in images[0] if images else ():
        out[name] = torch.cat([one[name] for one in images])
    if family in ("qwen2_vl", "qwen3_vl", "qwen3_5"):
        out["mm_token_type_ids"] = (out["input_ids"] == IMAGE).long()
    if family == "gemma3":
        out["token_type_ids"] = (out["input_ids"] == IMAGE).long()
    return out


def text(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(20, 240, (n,), generator=g).tolist()


def run(model: Any, store: prefixkv.PrefixStore, inputs: dict[str, torch.Tensor], **kw: Any) -> tuple[Any, float]:
    """Generate with a cache built from ``inputs`` and stock on the twin; the cache's stats and the largest logit
    difference over every step."""
    twin = stock_twin(model)
    gen = {"max_new_tokens": 4, "do_sample": False, "output_logits": True, "return_dict_in_generate": True, **kw}
    ref = twin.generate(**inputs, **gen)
    with prefixkv.PagedPrefixCache(store, **inputs) as cache:
        out = model.generate(**inputs, **cache_kw(cache), **gen)
    store.check_invariants()
    assert out.sequences.tolist() == ref.sequences.tolist()
    return cache.stats, max_logit_diff(out.logits, ref.logits)


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return request.param, prefixkv.models.tiny_model(request.param, dtype=torch.float64)


def test_same_image_reused_another_never(vlm: tuple[str, Any]) -> None:
    family, model = vlm
    store = prefixkv.PrefixStore(model, block_size=4)
    system, question, follow = text(10, 1), text(5, 2), text(4, 3)
    cold = prompt(family, [[system, 7, question]])
    n = cold["input_ids"].shape[1]
    stats, diff = run(model, store, cold)
    assert stats.cached_tokens == 0 and diff < 1e-6
    before = len(system) + _image_tokens(family).index(IMAGE)
    # the same image: everything but the last token
    stats, diff = run(model, store, cold)
    assert stats.cached_tokens == (before if family in RECURRENT else n - 1) and diff < 1e-6, stats
    # a follow-up question about the same image: the whole earlier prompt
    stats, diff = run(model, store, prompt(family, [[system, 7, question, follow]]))
    assert stats.cached_tokens == (before if family in RECURRENT else n) and diff < 1e-6, stats
    # a chat's next turn about the image: everything up to the new question (the answer's last token excepted, whole
    # blocks of 4 where the last call ended)
    twin_out = stock_twin(model).generate(**cold, max_new_tokens=4, do_sample=False)
    answer = twin_out[0, n:].tolist()
    stats, diff = run(model, store, prompt(family, [[system, 7, question, answer, follow]]))
    assert stats.cached_tokens >= (n + len(answer) - 1) // 4 * 4 and diff < 1e-6, stats
    # another image behind the same text: the text before the image only, never its K/V
    stats, diff = run(model, store, prompt(family, [[system, 8, question]]))
    assert stats.cached_tokens == before and diff < 1e-6, stats
    # a later ordinary request, twice: a text-only call publishes (generate passes it no image, an empty dict)
    stats, diff = run(model, store, {"input_ids": torch.tensor([system + question])})
    # (a hybrid's runner computes the prompt up to its last token in this call, as its split_tokens say)
    assert stats.cached_tokens == (0 if family in RECURRENT else len(system)) and diff < 1e-6, stats
    stats, diff = run(model, store, {"input_ids": torch.tensor([system + question])})
    assert stats.cached_tokens == len(system + question) - 1 and diff < 1e-6, stats


def test_two_images_batches_and_beams(vlm: tuple[str, Any]) -> None:
    family, model = vlm
    store = prefixkv.PrefixStore(model, block_size=4)
    system, question = text(9, 4), text(5, 5)
    # two images in one prompt; then the first one again, followed by a third
    stats, diff = run(model, store, prompt(family, [[system, 1, text(3, 6), 2, question]]))
    assert diff < 1e-6
    stats, diff = run(model, store, prompt(family, [[system, 1, text(3, 6), 3, question]]))
    first = len(system) + _image_tokens(family).index(IMAGE)
    whole = len(system) + len(_image_tokens(family)) + 3  # the first image and the text after it
    assert stats.cached_tokens >= (first if family in RECURRENT else whole) and diff < 1e-6, stats
    # a batch of rows with different images behind the same text; then one of them again, with beams
    stats, diff = run(model, store, prompt(family, [[system, 4, question], [system, 5, question]]))
    assert diff < 1e-6
    # two rows with one new image: the rows' shared prefix is computed once, up to the image (its ids alone have none)
    stats, diff = run(model, store, prompt(family, [[system, 6, text(5, 7)], [system, 6, text(5, 8)]]))
    assert diff < 1e-6
    stats, diff = run(model, store, prompt(family, [[system, 5, question]]), num_beams=2)
    n = len(system) + len(_image_tokens(family)) + len(question)
    assert stats.cached_tokens == (first if family in RECURRENT else n - 1) and diff < 1e-6, stats
    stats, diff = run(model, store, {"input_ids": torch.tensor([system + question])})
    assert diff < 1e-6


def test_cache_without_images_reuses_the_text_before_them() -> None:
    model = prefixkv.models.tiny_model("llava", dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4)
    system, question = text(10, 1), text(5, 2)
    inputs = prompt("llava", [[system, 7, question]])
    twin = stock_twin(model)
    for _ in range(2):  # built from the ids alone: the image is one the cache was not given
        ref = twin.generate(
            **inputs, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        with prefixkv.PagedPrefixCache(store, inputs["input_ids"]) as cache:
            out = model.generate(
                **inputs,
                **cache_kw(cache),
                max_new_tokens=3,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        assert max_logit_diff(out.logits, ref.logits) < 1e-6
    assert cache.stats.cached_tokens == len(system)


def test_other_images_than_the_cache_was_built_with_are_refused() -> None:
    model = prefixkv.models.tiny_model("llava", dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4)
    a = prompt("llava", [[text(6, 1), 1, text(3, 2)]])
    b = prompt("llava", [[text(6, 1), 2, text(3, 2)]])
    with prefixkv.PagedPrefixCache(store, **a) as cache, pytest.raises(CacheMisuseError, match="not those"):
        model.generate(**b, **cache_kw(cache), max_new_tokens=2, do_sample=False)
    stats, diff = run(model, store, a)  # a later ordinary request
    assert stats.cached_tokens == 0 and diff < 1e-6


def test_a_prompt_ending_in_an_image_recomputes_the_whole_image() -> None:
    """One prompt token stays uncached: here an image's last placeholder, so the reuse ends before the image, not
    inside it (a forward feeds whole images)."""
    model = prefixkv.models.tiny_model("llava", dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4)
    system = text(9, 1)
    inputs = prompt("llava", [[system, 3]])
    for cached in (0, len(system)):
        stats, diff = run(model, store, inputs)
        assert stats.cached_tokens == cached and diff < 1e-6, stats
    stats, diff = run(model, store, {"input_ids": torch.tensor([system + text(3, 2)])})
    assert diff < 1e-6


def test_digest_keys_the_grid() -> None:
    """Two images of the same pixels in other grids are other images."""
    one = {"pixel_values": torch.zeros(16, 24), "image_grid_thw": torch.tensor([1, 4, 4])}
    other = {"pixel_values": torch.zeros(16, 24), "image_grid_thw": torch.tensor([1, 2, 8])}
    config = prefixkv.models.tiny_config("qwen2_vl")
    plans = [
        vision.plan(
            config,
            [0],
            [[5, 252, *[IMAGE] * 4, 253]],
            {k: v.unsqueeze(0) if k != "pixel_values" else v for k, v in x.items()},
        )
        for x in (one, other)
    ]
    assert plans[0] is not None and plans[1] is not None
    assert plans[0].keys[0][2:6] != plans[1].keys[0][2:6]


def test_enable_keys_the_images_generate_is_given() -> None:
    model = prefixkv.models.tiny_model("qwen2_vl", dtype=torch.float64)
    store = prefixkv.enable(model, block_size=4)
    inputs = prompt("qwen2_vl", [[text(8, 1), 3, text(4, 2)]])
    twin = stock_twin(model)
    ref = twin.generate(**inputs, max_new_tokens=3, do_sample=False)
    for _ in range(2):
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert out.tolist() == ref.tolist()
    assert store.stats.hit_tokens == inputs["input_ids"].shape[1] - 1
    prefixkv.disable(model)


def test_saved_and_loaded_image_prefixes_serve_the_same_image_only(tmp_path: Any) -> None:
    """Files key by the keys: an image's K/V come back under its digest's keys."""
    model = prefixkv.models.tiny_model("qwen2_vl", dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4)
    system, question = text(8, 1), text(5, 2)
    inputs = prompt("qwen2_vl", [[system, 3, question]])
    run(model, store, inputs)
    store.save(tmp_path / "images.safetensors")
    store.close()
    loaded = prefixkv.PrefixStore.load(tmp_path / "images.safetensors", model)
    stats, diff = run(model, loaded, inputs)
    assert stats.cached_tokens == inputs["input_ids"].shape[1] - 1 and diff < 1e-6, stats
    stats, diff = run(model, loaded, prompt("qwen2_vl", [[system, 4, question]]))
    assert stats.cached_tokens == len(system) + 1 and diff < 1e-6, stats


def test_an_invariant_store_reuses_the_text_before_the_first_image() -> None:
    """Its canonical chunks are prefilled from the ids alone, which have no image: they stop before it."""
    model = prefixkv.models.tiny_model("llava", dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4, invariant=True)
    chunk = store.settings.chunk_size
    assert chunk is not None
    system = text(2 * chunk + 3, 1)
    inputs = prompt("llava", [[system, 3, text(4, 2)]])
    for _ in range(2):
        stats, diff = run(model, store, inputs)
        assert diff < 1e-6
    assert stats.cached_tokens == len(system) // chunk * chunk, stats
    stats, diff = run(model, store, {"input_ids": torch.tensor([system + text(3, 2)])})
    assert diff < 1e-6


def test_pipeline_image_text_to_text_under_enable() -> None:
    image_module = pytest.importorskip("PIL.Image")
    model = prefixkv.models.tiny_model("llava", dtype=torch.float64)
    processor = prefixkv.models.tiny_processor()
    store = prefixkv.enable(model, block_size=4)
    twin = stock_twin(model)
    g = torch.Generator().manual_seed(0)
    image = image_module.fromarray((torch.rand(20, 20, 3, generator=g) * 255).to(torch.uint8).numpy())
    pipe = transformers.pipeline("image-text-to-text", model=model, processor=processor)
    ref = transformers.pipeline("image-text-to-text", model=twin, processor=processor)
    question = "ba bebo da de <image> fa fe"
    for _ in range(2):
        out = pipe(images=image, text=question, max_new_tokens=4, generate_kwargs={"do_sample": False})
        assert out == ref(images=image, text=question, max_new_tokens=4, generate_kwargs={"do_sample": False})
    prompt_tokens = len(processor(images=image, text=question).input_ids[0])
    assert store.stats.hit_tokens == prompt_tokens - 1
    prefixkv.disable(model)


def test_a_cached_image_is_not_encoded_again() -> None:
    """generate encodes the images of the uncached tail only: a follow-up question about a cached image runs no
    vision tower; a new image behind a cached one runs it on the new image alone."""
    model = prefixkv.models.tiny_model("qwen2_vl", dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4)
    encoded: list[int] = []
    hook = model.model.visual.register_forward_pre_hook(lambda m, args: encoded.append(args[0].shape[0]))
    system, question = text(8, 1), text(5, 2)
    run(model, store, prompt("qwen2_vl", [[system, 3, question]]))
    assert encoded == [16]  # 16 patches (the stock twin has no hook)
    encoded.clear()
    _, diff = run(model, store, prompt("qwen2_vl", [[system, 3, question, text(4, 3)]]))
    assert encoded == [] and diff < 1e-6
    _, diff = run(model, store, prompt("qwen2_vl", [[system, 3, question, 4, text(2, 4)]]))
    assert encoded == [16] and diff < 1e-6, encoded
    hook.remove()


def test_generate_many_refuses_images() -> None:
    """generate_many refills rows of ids, which images cannot follow: refused with the reason."""
    model = prefixkv.models.tiny_model("llava", dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4)
    inputs = prompt("llava", [[text(6, 1), 1, text(3, 2)]])
    with pytest.raises(ValueError, match="does not take pixel_values: it pads, batches and refills"):
        prefixkv.generate_many(model, [inputs["input_ids"][0]], store=store, pixel_values=inputs["pixel_values"])
    _, diff = run(model, store, {"input_ids": torch.tensor([text(6, 1) + text(3, 2)])})  # a later ordinary request
    assert diff < 1e-6


def _nudged(family: str, seed: int, where: str) -> dict[str, torch.Tensor]:
    """The image ``seed`` of ``family`` with one value changed: the first of its last channel, the first of its last
    row, or its last byte (Qwen-VL's flat patches: the last value of the first patch, the first of the last patch, the
    last value)."""
    one = _pixels(family, seed)
    pixels = one["pixel_values"].clone()
    if family in ("qwen2_vl", "qwen3_vl", "qwen3_5"):
        index: tuple[int, ...] = {"channel": (0, -1), "row": (-1, 0), "byte": (-1, -1)}[where]
    else:
        index = {"channel": (..., -1, 0, 0), "row": (..., 0, -1, 0), "byte": (..., -1, -1, -1)}[where]
    if where == "byte":  # the last byte of a little-endian float64: its sign and highest exponent bits
        pixels.view(torch.uint8).view(-1)[-1] ^= 0x01
    else:
        pixels[index] += 0.5
    return {**one, "pixel_values": pixels}


@pytest.mark.parametrize("where", ["channel", "row", "byte"])
def test_images_one_value_apart_never_share(vlm: tuple[str, Any], where: str) -> None:
    """Two images that differ in one value anywhere (the digest reads every byte of every tensor) are two images."""
    family, model = vlm
    store = prefixkv.PrefixStore(model, block_size=4)
    system, question = text(10, 1), text(5, 2)
    base = prompt(family, [[system, 7, question]])
    run(model, store, base)
    nudged = dict(base)
    one = _nudged(family, 7, where)
    if family == "idefics3":
        nudged["pixel_values"] = one["pixel_values"]
    else:
        nudged.update({k: v for k, v in one.items() if k in base})
    assert not torch.equal(nudged["pixel_values"], base["pixel_values"])
    stats, diff = run(model, store, nudged)
    before = len(system) + _image_tokens(family).index(IMAGE)
    assert stats.cached_tokens == before and diff < 1e-6, stats
    stats, diff = run(model, store, {"input_ids": torch.tensor([system + question])})  # a later ordinary request
    assert diff < 1e-6


def test_the_grid_alone_keys_the_image() -> None:
    """The same patches in another grid of the same placeholder count: another image, end to end."""
    model = prefixkv.models.tiny_model("qwen2_vl", dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4)
    system, question = text(10, 1), text(5, 2)
    square = prompt("qwen2_vl", [[system, 7, question]])
    run(model, store, square)
    wide = {**square, "image_grid_thw": torch.tensor([[1, 2, 8]])}
    stats, diff = run(model, store, wide)
    assert stats.cached_tokens == len(system) + 1 and diff < 1e-6, stats
    stats, diff = run(model, store, {"input_ids": torch.tensor([system + question])})
    assert diff < 1e-6


@pytest.mark.parametrize(("family", "name"), [("gemma3", "token_type_ids"), ("qwen2_vl", "mm_token_type_ids")])
def test_token_types_key_the_image(family: str, name: str) -> None:
    """The same prompt with and without its token types (Gemma 3's attention within an image, Qwen2-VL's rotary
    positions) are two prompts: neither reuses the other's image; a cache built with them refuses a call without."""
    model = prefixkv.models.tiny_model(family, dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4)
    system, question = text(10, 1), text(5, 2)
    typed = prompt(family, [[system, 7, question]])
    untyped = {k: v for k, v in typed.items() if k != name}
    n, before = typed["input_ids"].shape[1], len(system) + _image_tokens(family).index(IMAGE)
    for inputs, cached in ((typed, 0), (untyped, before), (typed, n - 1), (untyped, n - 1)):
        stats, diff = run(model, store, inputs)
        assert stats.cached_tokens == cached and diff < 1e-6, (inputs.keys(), stats)
    with (
        prefixkv.PagedPrefixCache(store, **typed) as cache,
        pytest.raises(CacheMisuseError, match=f"other {name}"),
    ):
        model.generate(**untyped, **cache_kw(cache), max_new_tokens=2, do_sample=False)
    stats, diff = run(model, store, {"input_ids": torch.tensor([system + question])})  # a later ordinary request
    assert diff < 1e-6


def test_token_types_of_a_token_that_is_no_placeholder_are_refused() -> None:
    model = prefixkv.models.tiny_model("gemma3", dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4)
    inputs = prompt("gemma3", [[text(10, 1), 7, text(5, 2)]])
    inputs["token_type_ids"] = inputs["token_type_ids"].clone()
    inputs["token_type_ids"][0, 3] = 1
    with pytest.raises(ValueError, match="token_type_ids marks token 3 of row 0"):
        prefixkv.PagedPrefixCache(store, **inputs)


def test_a_keyword_that_changes_the_encoding_is_keyed() -> None:
    """vision_feature_layer changes every image's features: the cache keys it (given to it, or to generate under
    enable); a call given another than its cache was built with is refused."""
    model = prefixkv.models.tiny_model("llava", dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4)
    system, question = text(10, 1), text(5, 2)
    inputs = prompt("llava", [[system, 7, question]])
    layer = {**inputs, "vision_feature_layer": -2}
    n, before = inputs["input_ids"].shape[1], len(system)
    for given, cached in ((inputs, 0), (layer, before), (layer, n - 1), (inputs, n - 1)):
        stats, diff = run(model, store, given)
        assert stats.cached_tokens == cached and diff < 1e-6, stats
    with (
        prefixkv.PagedPrefixCache(store, **inputs) as cache,
        pytest.raises(CacheMisuseError, match="other vision_feature_layer"),
    ):
        model.generate(**layer, **cache_kw(cache), max_new_tokens=2, do_sample=False)
    store.close()
    twin = stock_twin(model)
    store = prefixkv.enable(model, block_size=4)
    for given in (inputs, layer, layer):
        ref = twin.generate(
            **given, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        out = model.generate(
            **given, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        assert max_logit_diff(out.logits, ref.logits) < 1e-6
    assert store.stats.hit_tokens == before + n - 1
    out = model.generate(torch.tensor([system + question]), max_new_tokens=3, do_sample=False)  # an ordinary request
    assert out.tolist() == twin.generate(torch.tensor([system + question]), max_new_tokens=3, do_sample=False).tolist()
    prefixkv.disable(model)


def test_every_input_an_image_encoder_of_a_known_layout_takes_is_keyed() -> None:
    """generate hands a model's image encoder every keyword its get_image_features names: each family prefixkv keys
    must have them all among the inputs that key an image (a release that adds one fails here, not silently)."""
    import inspect

    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as NAMES

    checked = 0
    for family in vision.LAYOUTS:
        cls = getattr(transformers, NAMES.get(family, ""), None)
        if cls is None:  # a family this release does not have
            continue
        taken = set(inspect.signature(cls.get_image_features).parameters) - {"self", "kwargs"}
        assert taken <= vision.IMAGE_INPUTS, (family, sorted(taken - vision.IMAGE_INPUTS))
        checked += 1
    assert checked >= 7


def test_a_forward_given_raw_images_checks_their_keywords() -> None:
    """Where generate hands a forward the images raw (a release or model that does not encode them first), the
    forward's encoding keywords and token types must be those the cache keyed the images by."""
    config = prefixkv.models.tiny_config("gemma3")
    inputs = prompt("gemma3", [[text(6, 1), 7, text(3, 2)]])
    pads, keys = [0], inputs["input_ids"].tolist()
    plan = vision.plan(config, pads, keys, {k: v for k, v in inputs.items() if k != "input_ids"})
    assert plan is not None
    assert plan.feed([0], dict(inputs)) == dict(inputs)  # as the cache was built: unchanged
    untyped = {k: v for k, v in inputs.items() if k != "token_type_ids"}
    with pytest.raises(ValueError, match="this forward's token_type_ids differ"):
        plan.feed([0], untyped)
    with pytest.raises(ValueError, match="this forward's vision_feature_layer differ"):
        plan.feed([0], {**inputs, "vision_feature_layer": -2})
