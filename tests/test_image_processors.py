"""Every image layout docs/generate.md ("Images") names, fed the outputs of its family's own processor class (built
here from a tiny tokenizer and image processor, no download): the same image reused, a chat's next turn with the first
image and a new one, another image behind the same text, then ordinary requests; every call compared with stock
generate on an untouched twin, every step's logits, float64. A family whose layout prefixkv does not know is refused
with its name."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import transformers
from conftest import max_logit_diff, stock_twin
from test_images import RECURRENT, run

import prefixkv
from prefixkv.compat import releases
from prefixkv.models import _TEXT, build, tiny_config, tiny_tokenizer

pytestmark = pytest.mark.skipif(
    not releases.WARM_FORWARDS_TAKE_IMAGES, reason="transformers 4.x: a call with images reuses nothing"
)
image_module = pytest.importorskip("PIL.Image")


def tokenizer(*specials: str, **tokens: str) -> Any:
    """The tiny tokenizer with ``specials`` as ids 250, 251, ... (the tiny models' placeholder and frame ids) and
    ``tokens`` as its named special tokens (Gemma 3's processor reads ``tokenizer.boi_token``)."""
    tok = tiny_tokenizer(vocab_size=250)
    tok.add_special_tokens({"additional_special_tokens": list(specials)})
    for name, value in tokens.items():
        setattr(tok, name, value)
        setattr(tok, f"{name}_id", tok.convert_tokens_to_ids(value))
    return tok


def image_processor(name: str, **kwargs: Any) -> Any:
    """The image processor class ``name`` (its Pillow backend where transformers has one: torchvision is optional)."""
    return (getattr(transformers, f"{name}Pil", None) or getattr(transformers, name))(**kwargs)


@contextlib.contextmanager
def no_video_processor() -> Iterator[None]:
    """A processor built without a video processor: transformers checks the class of each argument, and resolving
    the video processors' needs torchvision."""
    check = transformers.ProcessorMixin.check_argument_for_proper_class

    def lenient(self: Any, name: str, argument: Any) -> Any:
        return None if argument is None else check(self, name, argument)

    with mock.patch.object(transformers.ProcessorMixin, "check_argument_for_proper_class", lenient):
        yield


PINPOINTS = [[16, 32], [32, 16], [32, 32]]
TOWER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}


def llava_next(onevision: bool) -> tuple[Any, Any, str]:
    """LLaVA-NeXT (or -OneVision): a 16-pixel tower that sees an image in patches of a grid (``image_grid_pinpoints``)
    and its ``image_sizes``; a 16x32 image is 52 placeholder tokens (OneVision: 56)."""
    tower = {**TOWER, "image_size": 16, "patch_size": 4}
    text = {**_TEXT, "num_key_value_heads": 2}
    if onevision:
        config = transformers.LlavaOnevisionConfig(
            text_config={**text, "model_type": "qwen2"},
            vision_config={**tower, "model_type": "siglip_vision_model"},
            **{"image_token_index": 250, "video_token_index": 251, "image_grid_pinpoints": PINPOINTS},
            vision_feature_layer=-1,
        )
        images = image_processor("LlavaOnevisionImageProcessor", size={"height": 16, "width": 16})
        with no_video_processor():
            processor = transformers.LlavaOnevisionProcessor(
                image_processor=images,
                tokenizer=tokenizer("<image>", "<video>"),
                video_processor=None,
                num_image_tokens=16,
                vision_feature_select_strategy="full",
            )
        processor.image_processor.image_grid_pinpoints = PINPOINTS
        return config, processor, "<image>"
    config = transformers.LlavaNextConfig(
        text_config={**text, "model_type": "llama"},
        vision_config={**tower, "model_type": "clip_vision_model", "projection_dim": 32},
        **{"image_token_index": 250, "image_grid_pinpoints": PINPOINTS, "vision_feature_layer": -1},
    )
    images = image_processor(
        "LlavaNextImageProcessor",
        size={"shortest_edge": 16},
        crop_size={"height": 16, "width": 16},
        image_grid_pinpoints=PINPOINTS,
    )
    processor = transformers.LlavaNextProcessor(
        image_processor=images,
        tokenizer=tokenizer("<image>"),
        patch_size=4,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    return config, processor, "<image>"


def qwen(family: str) -> tuple[Any, Any, str]:
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5: flat patches of 2 pixels, merged 2x2, with image_grid_thw."""
    images = image_processor(
        "Qwen2VLImageProcessor", patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=256
    )
    cls = {"qwen2_vl": transformers.Qwen2VLProcessor, "qwen2_5_vl": transformers.Qwen2_5_VLProcessor}
    tok = tokenizer("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    with no_video_processor():
        processor = cls.get(family, transformers.Qwen3VLProcessor)(
            image_processor=images, tokenizer=tok, video_processor=None
        )
    if family != "qwen2_5_vl":
        return tiny_config(family), processor, "<|vision_start|><|image_pad|><|vision_end|>"
    fields = tiny_config("qwen2_vl").to_dict()  # Qwen2-VL's, with Qwen2.5-VL's windowed vision tower
    config = transformers.Qwen2_5_VLConfig(
        text_config={**fields["text_config"], "model_type": "qwen2_5_vl_text"},
        vision_config={
            **{"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 2},
            **{"spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64},
            **{"window_size": 8, "fullatt_block_indexes": [1]},
        },
        **{"image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 252, "vision_end_token_id": 253},
    )
    return config, processor, "<|vision_start|><|image_pad|><|vision_end|>"


def gemma3() -> tuple[Any, Any, str]:
    """Gemma 3: an image of 16 pixels pooled to 4 placeholder tokens, with token_type_ids."""
    tok = tokenizer(
        "<image_soft_token>",
        "<start_of_image>",
        "<end_of_image>",
        **{"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"},
    )
    images = image_processor("Gemma3ImageProcessor", size={"height": 16, "width": 16})
    processor = transformers.Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=4)
    return tiny_config("gemma3"), processor, "<start_of_image>"


def mistral3() -> tuple[Any, Any, str]:
    """Mistral 3 (Pixtral's processor, which needs torchvision): rows of patches with image_sizes."""
    pytest.importorskip("torchvision")
    images = image_processor("PixtralImageProcessor", size={"longest_edge": 32}, patch_size={"height": 4, "width": 4})
    tok = tokenizer("[IMG]", "[IMG_BREAK]", "[IMG_END]")
    processor = transformers.PixtralProcessor(image_processor=images, tokenizer=tok, patch_size=4, spatial_merge_size=2)
    return tiny_config("mistral3"), processor, "[IMG]"


def idefics3(smol: bool) -> tuple[Any, Any, str]:
    """Idefics3 (or SmolVLM, whose processor needs num2words): 16-pixel images unsplit, 4 placeholder tokens each."""
    tok = tokenizer("<image>", "<fake_token_around_image>", "<global-img>")
    sizes = {"size": {"longest_edge": 16}, "max_image_size": {"longest_edge": 16}, "do_image_splitting": False}
    config = tiny_config("idefics3")
    if not smol:
        images = image_processor("Idefics3ImageProcessor", **sizes)
        return config, transformers.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4), "<image>"
    pytest.importorskip("num2words")
    fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
    with no_video_processor():
        processor = transformers.SmolVLMProcessor(
            image_processor=image_processor("SmolVLMImageProcessor", **sizes),
            tokenizer=tok,
            video_processor=None,
            image_seq_len=4,
        )
    return transformers.SmolVLMConfig(**fields), processor, "<image>"


BUILDERS: dict[str, Callable[[], tuple[Any, Any, str]]] = {
    "llava": lambda: (tiny_config("llava"), prefixkv.models.tiny_processor(), "<image>"),
    "llava_next": lambda: llava_next(False),
    "llava_onevision": lambda: llava_next(True),
    "qwen2_vl": lambda: qwen("qwen2_vl"),
    "qwen2_5_vl": lambda: qwen("qwen2_5_vl"),
    "qwen3_vl": lambda: qwen("qwen3_vl"),
    "qwen3_5": lambda: qwen("qwen3_5"),
    "gemma3": gemma3,
    "mistral3": mistral3,
    "idefics3": lambda: idefics3(False),
    "smolvlm": lambda: idefics3(True),
}


def picture(seed: int, height: int = 16, width: int = 32) -> Any:
    return image_module.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))


def first_placeholder(model: Any, ids: torch.Tensor) -> int:
    """The index of the first image placeholder of ``ids``' first row."""
    image = prefixkv.hf.vision.placeholder_ids(model.config)["image"]
    return int((ids[0] == image).nonzero()[0])


@pytest.mark.parametrize("family", list(BUILDERS))
def test_each_layout_with_its_own_processor(family: str) -> None:
    config, processor, tag = BUILDERS[family]()
    model = build(config, dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4)
    system, question, follow = "ba be bi bo bu da de di", "fa fe fi", "go gu ka"
    a, b = picture(0), picture(1, 32, 16)

    def inputs(images: list[Any], text: str) -> dict[str, torch.Tensor]:
        return dict(processor(images=images, text=text, return_tensors="pt"))

    first = inputs([a], f"{system} {tag} {question}")
    n, before = first["input_ids"].shape[1], first_placeholder(model, first["input_ids"])
    assert before > 0
    stats, diff = run(model, store, first)
    assert stats.cached_tokens == 0 and diff < 1e-6, stats
    stats, diff = run(model, store, first)
    assert stats.cached_tokens == (before if family in RECURRENT else n - 1) and diff < 1e-6, stats
    # a chat's next turn: the first image again and a new one
    chat = inputs([a, b], f"{system} {tag} {question} {follow} {tag} {question}")
    stats, diff = run(model, store, chat)
    assert diff < 1e-6, diff
    assert stats.cached_tokens >= (before if family in RECURRENT else n - len(processor.tokenizer.tokenize(question)))
    if family == "llava_onevision":
        # two new images fed together, each encoded alone (batch_num_images of 1 each) as stock encodes them
        three = inputs(
            [a, picture(2), picture(3)], f"{system} {tag} {question} {follow} {tag} {question} {tag} {follow}"
        )
        stats, diff = run(model, store, three)
        assert stats.cached_tokens >= n - len(processor.tokenizer.tokenize(question)) and diff < 1e-6, (stats, diff)
        # the two in one row (nested): each encoded otherwise than alone, not keyed
        stats, diff = run(model, store, inputs([[a, b]], f"{system} {tag} {question} {follow} {tag} {question}"))
        assert stats.cached_tokens == before and "batch_num_images" in (stats.not_cached or "") and diff < 1e-6, stats
    # another image behind the same text: the text before it only
    stats, diff = run(model, store, inputs([b], f"{system} {tag} {question}"))
    assert stats.cached_tokens == before and diff < 1e-6, stats
    # later ordinary requests
    ids = processor.tokenizer(f"{system} {question}", return_tensors="pt")["input_ids"]
    for _ in range(2):
        stats, diff = run(model, store, {"input_ids": ids})
        assert diff < 1e-6
    assert stats.cached_tokens == ids.shape[1] - 1, stats


@pytest.mark.parametrize("family", ["llava_next", "llava_onevision"])
def test_image_sizes_key_the_image(family: str) -> None:
    """The same patches under other image_sizes (the same placeholder count) are another image to the model: its K/V
    are not reused, and generate given other sizes than the cache was built with is refused."""
    config, processor, tag = BUILDERS[family]()
    model = build(config, dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4)
    one = dict(processor(images=[picture(0, 16, 16)], text=f"ba be bi bo {tag} fa fe", return_tensors="pt"))
    other = {**one, "image_sizes": torch.tensor([[17, 14]])}  # a 1x2 grid of patches read as 2x1
    before = first_placeholder(model, one["input_ids"])
    stats, diff = run(model, store, one)
    assert diff < 1e-6
    stats, diff = run(model, store, other)
    assert stats.cached_tokens == before and diff < 1e-6, stats
    # the two are other images to stock generate too, so a reuse of one for the other would be seen
    twin = stock_outputs(model, one), stock_outputs(model, other)
    assert (twin[0] - twin[1]).abs().max() > 1e-3
    with (
        prefixkv.PagedPrefixCache(store, **one) as cache,
        pytest.raises(prefixkv.base.errors.CacheMisuseError, match="other image_sizes"),
    ):
        model.generate(**other, cache=cache, max_new_tokens=2, do_sample=False)
    stats, diff = run(model, store, {"input_ids": one["input_ids"][:, :before]})  # a later ordinary request
    assert diff < 1e-6


def stock_outputs(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The last position's logits of a stock forward (the twin of ``model``)."""
    with torch.no_grad():
        return stock_twin(model)(**inputs).logits[0, -1]


def test_a_layout_prefixkv_does_not_know_is_refused_by_name() -> None:
    """A family whose images prefixkv cannot split is refused, never read as another layout: PagedPrefixCache
    names it; under enable the call runs stock, with a warning that names it."""
    model = prefixkv.models.tiny_model("llava", dtype=torch.float64)
    inputs = dict(prefixkv.models.tiny_processor()(images=picture(0), text="ba be <image> fa", return_tensors="pt"))
    model.config.model_type = "llava_like"  # a family prefixkv has no layout for, with LLaVA's tensors
    store = prefixkv.PrefixStore(model, block_size=4)
    with pytest.raises(ValueError, match="llava_like: a layout of images prefixkv does not know"):
        prefixkv.PagedPrefixCache(store, **inputs)
    store.close()
    prefixkv.enable(model, block_size=4)
    with pytest.warns(UserWarning, match="llava_like: a layout of images prefixkv does not know"):
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
    prefixkv.disable(model)
    model.config.model_type = "llava"


def test_a_chats_second_call_with_a_new_image_under_enable() -> None:
    """LLaVA-NeXT under enable: a chat's second call, with the first image and a new one, reuses the first image and
    gives stock's logits (its image_sizes once sliced as Idefics3's tiles raised an IndexError)."""
    config, processor, tag = BUILDERS["llava_next"]()
    model = build(config, dtype=torch.float64)
    twin = stock_twin(model)
    store = prefixkv.enable(model, block_size=4)
    first = dict(processor(images=[picture(0, 16, 16)], text=f"ba be bi bo {tag} fa fe", return_tensors="pt"))
    chat = dict(
        processor(
            images=[picture(0, 16, 16), picture(1, 16, 16)],
            text=f"ba be bi bo {tag} fa fe go {tag} ka",
            return_tensors="pt",
        )
    )
    gen = {"max_new_tokens": 3, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    for inputs in (first, chat, {"input_ids": first["input_ids"][:, :4]}):
        out, ref = model.generate(**inputs, **gen), twin.generate(**inputs, **gen)
        assert max_logit_diff(out.logits, ref.logits) < 1e-6
    assert store.stats.hit_tokens >= first["input_ids"].shape[1] - 1
    prefixkv.disable(model)


def test_gemma3_pan_and_scan_crops_count_as_images() -> None:
    """Gemma 3's processor cuts a wide image into crops (do_pan_and_scan), each a row of pixel_values with its own
    placeholders: the image and its crops are reused together, another image's are not."""
    config, processor, tag = BUILDERS["gemma3"]()
    model = build(config, dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4)
    pan = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 4, "pan_and_scan_min_ratio_to_activate": 1.2}

    def inputs(seed: int) -> dict[str, torch.Tensor]:
        return dict(processor(images=[picture(seed, 16, 48)], text=f"ba be {tag} fa", return_tensors="pt", **pan))

    wide = inputs(0)
    assert wide["pixel_values"].shape[0] > 1  # the image and its crops
    n, before = wide["input_ids"].shape[1], first_placeholder(model, wide["input_ids"])
    for given, cached in ((wide, 0), (wide, n - 1), (inputs(1), before)):
        stats, diff = run(model, store, given)
        assert stats.cached_tokens == cached and diff < 1e-6, stats
    stats, diff = run(model, store, {"input_ids": wide["input_ids"][:, :before]})  # a later ordinary request
    assert diff < 1e-6
