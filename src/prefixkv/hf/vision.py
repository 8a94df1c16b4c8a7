"""Images in a prompt (docs/generate.md, "Images"): which tokens of a vision-language model's prompt are an image's
placeholders, which processed inputs belong to each image, and the keys that make an image's K/V reused only for the
same image processed alike (:func:`plan`, an :class:`ImagePlan`), and the inputs a forward that feeds only a prompt's
uncached tail gets: those of the images in it (:meth:`ImagePlan.feed`).

A placeholder run takes the keys of its image's digest (:func:`prefixkv.base.images.digest` of its part of
``pixel_values``, every other tensor the model's forward takes for it, its placeholders' token types and the
``generate`` keywords that change how it is encoded); the placeholders of an image the cache was not given (a video,
audio, a cache built from the ids alone) take the keys of a digest no image has, so nothing is reused at or past
them, and the text before them is. Each family's images come in a layout of their own (:data:`LAYOUTS`, by
``model_type``): a family whose layout prefixkv does not know is refused with its name, never read as another's.
Nothing here mutates but :func:`reset_rope_deltas` (and :func:`rope_deltas_aside`, which puts them back)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch

from ..base import images
from ..base.tokens import image_key, token

# the token types of a prompt's tokens (Gemma 3's token_type_ids make an image's placeholders attend each other,
# Qwen-VL's mm_token_type_ids place its multimodal rotary positions): each image's digest holds those of its span
TOKEN_TYPES = ("token_type_ids", "mm_token_type_ids")
# the generate keywords that change how an image is encoded (the LLaVA family's): keyed with every image's digest
ENCODING = ("vision_feature_layer", "vision_feature_select_strategy", "vision_aspect_ratio")
# what a vision-language model's forward takes for its images, videos and audio, besides the ids: their K/V are
# keyed by the digests of the images (ImagePlan)
IMAGE_INPUTS = frozenset(
    {
        *("pixel_values", "pixel_mask", "pixel_attention_mask", "image_sizes", "image_grid_thw", "num_patches"),
        *("batch_num_images", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "image_sizes_videos"),
        *("input_features", "input_features_mask", "feature_attention_mask"),
        *("aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask"),
        *TOKEN_TYPES,
        *ENCODING,
    }
)
# the layout of each family's image inputs, by model_type (docs/generate.md, "Images"): Qwen-VL's flat patches with
# image_grid_thw ("grid"); one image per row of a 4-D pixel_values, cut to its image_sizes where given ("rows");
# each row's images in a 5-D one, padded with all-zero ones ("tiles"); one image per row of a 5-D one of its patches,
# read to its image_sizes ("patches")
LAYOUTS = {
    **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"), "grid"),
    **dict.fromkeys(("llava", "gemma3", "mistral3"), "rows"),
    **dict.fromkeys(("idefics3", "smolvlm"), "tiles"),
    **dict.fromkeys(("llava_next", "llava_onevision"), "patches"),
}
# what the rows' keys carry on a forward of a prompt with images: its image inputs, or those images encoded
# (transformers 5's generate encodes them before the prefill; ImagePlan.feed keeps the features of those fed)
KEYED = IMAGE_INPUTS | {"mm_encoder_outputs"}
# the inputs of one image, split per image (ImagePlan.feed keeps those of the images a forward feeds)
_PER_IMAGE = ("pixel_values", "image_grid_thw", "image_sizes", "pixel_attention_mask", "pixel_mask")
# what the forward of a model takes for a video or audio: never split, so their placeholders match nothing
_OTHER_MEDIA = ("pixel_values_videos", "input_features")


def placeholder_ids(config: Any) -> dict[str, int]:
    """The token ids of ``config``'s placeholders by kind (``image``, ``video``, ``audio``); empty for a model that
    takes no images."""
    found = {}
    for kind, names in (
        ("image", ("image_token_id", "image_token_index")),
        ("video", ("video_token_id", "video_token_index")),
        ("audio", ("audio_token_id", "audio_token_index")),
    ):
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and value >= 0:
                found[kind] = value
                break
    return found


class Image(NamedTuple):
    """One image of a prompt row: the token indices (after the row's padding) of its first and last placeholder, and
    its number among the images the processor's inputs hold (``-1``: an image, video or audio the cache was not
    given)."""

    begin: int
    end: int
    number: int


class ImagePlan:
    """A prompt's images on a model of ``config``: each row's keys with its placeholders keyed by their images
    (``keys``), each row's images (``rows``), and each image's digest and placeholder count, to check and pick the
    inputs of the images a forward feeds (:meth:`feed`). Does not mutate once built."""

    def __init__(
        self,
        config: Any,
        keys: list[list[int]],
        rows: list[list[Image]],
        inputs: Mapping[str, Any],
        digests: list[bytes],
        counts: list[int],
        layout: str | None = None,
        parts: list[bytes] | None = None,
    ) -> None:
        self.config = config
        self.keys = keys
        self.rows = rows
        self.inputs = {name: inputs.get(name) for name in _PER_IMAGE}
        self.given = {name: inputs.get(name) for name in IMAGE_INPUTS}
        self.digests = digests
        self.counts = counts
        self.layout = layout
        self.parts = parts or []  # each image's digest of its tensors alone, to check a forward's images by
        self.refusal: str | None = None  # why the images given are not keyed (their placeholders match nothing)
        # where each prompt row's encoded images begin: generate encodes only those a call feeds (encode_only)
        self.encoded_from: list[int] | None = None

    def snap(self, row: int, length: int) -> int:
        """The longest reuse of row ``row`` up to ``length`` tokens that does not end inside one of its images."""
        for image in self.rows[row]:
            if image.begin < length <= image.end:
                return image.begin
        return length

    def feed(self, starts: list[int], kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` (a forward's, by name, over ``len(starts)`` rows, a whole multiple of the prompt's: ``generate``
        repeats rows for beams) with the inputs of the images it feeds only (row ``b`` from its token ``starts[b]``):
        the cached images' are dropped, as their K/V are reused. A forward that carries no ``pixel_values`` (a decode
        step) is left as it is. Raises ``ValueError`` where the forward's images are not those the plan was built
        from, or where it would feed part of an image (:meth:`snap` keeps reuse from ending inside one)."""
        if not self.digests:  # no image given: reuse ends before the first placeholder, every image is fed
            return kwargs
        per_row = max(1, len(starts) // len(self.rows))
        order = [(b, image) for b in range(len(starts)) for image in self.rows[b // per_row] if image.number >= 0]
        for b, image in order:
            if image.begin < starts[b] <= image.end:
                raise ValueError(
                    f"row {b}: a forward from token {starts[b]} would feed part of the image at tokens "
                    f"{image.begin}..{image.end}"
                )
        encoded = kwargs.get("mm_encoder_outputs")
        if kwargs.get("pixel_values") is None:
            if isinstance(encoded, Mapping) and encoded.get("image") is not None:
                return self._feed_encoded(starts, per_row, kwargs)
            if any(image.begin >= starts[b] for b, image in order):
                raise ValueError(
                    "this forward feeds image placeholders without their images (no pixel_values, no "
                    "mm_encoder_outputs), but the PagedPrefixCache was built with them"
                )
            return kwargs
        # a forward given the images raw (generate did not encode them first) is given the keywords as the call was
        other = [name for name in ENCODING if not _same(kwargs.get(name), self.given[name])]
        other += [name for name in TOKEN_TYPES if (kwargs.get(name) is None) != (self.given[name] is None)]
        if other:
            raise ValueError(
                f"this forward's {', '.join(other)} differ from what the PagedPrefixCache was built with (they change "
                "its images' K/V): build it with the same"
            )
        if all(kwargs.get(name) is self.inputs[name] for name in _PER_IMAGE):
            spans = _spans(self.config, kwargs)
        else:
            self.check(kwargs, [image.number for _, image in order])
            spans = _spans(self.config, kwargs)
        fed = [n for n, (b, image) in enumerate(order) if image.begin >= starts[b]]
        if len(fed) == len(order):
            return kwargs
        return _pick_images(kwargs, fed, self.layout, spans)

    def check(self, inputs: Mapping[str, Any], order: list[int] | None = None) -> None:
        """Raise ``ValueError`` unless ``inputs`` (by name) carry the images the plan was built from: a call's
        (``order`` ``None``) every image input and encoding keyword as the cache was given them, a forward's the
        images ``order`` names, in order, compared by digest where they are other tensors."""
        if not self.digests:
            return
        if order is None:  # a call's inputs: every one that keys the images, as the cache was built with
            other = sorted(name for name in IMAGE_INPUTS if not _same(inputs.get(name), self.given[name]))
            if other:
                raise ValueError(
                    f"the images generate was given are not those the PagedPrefixCache was built with (other "
                    f"{', '.join(other)}, which change their K/V): build it from the same processor outputs "
                    f"(pixel_values, image_grid_thw, ...) and {', '.join(ENCODING)} you pass to generate"
                )
            return
        if all(inputs.get(name) is self.inputs[name] for name in _PER_IMAGE):
            return
        pixels = inputs.get("pixel_values")
        same = False
        if isinstance(pixels, torch.Tensor) and self.layout is not None:
            counts = [self.counts[i] for i in order]
            per, _ = _split(self.layout, self.config, inputs, counts)
            same = [images.digest(one) for one in per] == [self.parts[i] for i in order]
        if not same:
            raise ValueError(
                "the images generate was given are not those the PagedPrefixCache was built with: build it from the "
                "same processor outputs (pixel_values, image_grid_thw, ...) you pass to generate"
            )

    def encode_only(self, starts: list[int], kwargs: dict[str, Any], expand: int = 1) -> dict[str, Any]:
        """``generate``'s arguments (``kwargs``) with the inputs of the images a call feeds only (prompt row ``r`` from
        its token ``starts[r]``), for ``generate`` to encode before the prefill: the cached images are not encoded
        again. A call that repeats each row ``expand`` times (beams, ``num_return_sequences``) encodes every image:
        ``generate`` splits the encoded images among the rows it repeats by the count of every placeholder of the
        prompt, which the fed images' alone do not match (no row gets any), and :meth:`feed` picks the fed ones'
        features. Mutates the plan: it notes where the encoded images begin (:meth:`feed` picks their features)."""
        if expand > 1:
            self.encoded_from = None
            return kwargs
        sliced = self.feed(starts, kwargs)
        if sliced is kwargs:
            return kwargs
        self.encoded_from = list(starts)
        return {k: v for k, v in sliced.items() if v is not None or k not in _PER_IMAGE}

    def _feed_encoded(self, starts: list[int], per_row: int, kwargs: dict[str, Any]) -> dict[str, Any]:
        """:meth:`feed` for a forward given its images encoded (``mm_encoder_outputs``, transformers 5's ``generate``
        encodes them before the prefill, those of the fed images only: :meth:`encode_only`): the features of the image
        placeholders it feeds, in order over rows."""
        image_id = placeholder_ids(self.config).get("image")
        base = self.encoded_from or [0] * len(self.rows)
        rows, n = [], 0
        for b, start in enumerate(starts):
            for t, k in enumerate(self.keys[b // per_row]):
                if token(k) == image_id and t >= base[b // per_row]:
                    if t >= start:
                        rows.append(n)
                    n += 1
                elif token(k) == image_id and t >= start:
                    raise ValueError(
                        f"row {b}: this forward feeds the image placeholder at token {t}, whose image generate did "
                        "not encode (it was cached when the call began); build a new cache for this call"
                    )
        if len(rows) == n:
            return kwargs
        encoded = dict(kwargs["mm_encoder_outputs"])
        encoded["image"] = _slice_encoded(encoded["image"], rows, n) if rows else None
        return {**kwargs, "mm_encoder_outputs": encoded}


def _slice_encoded(output: Any, rows: list[int], total: int) -> Any:
    """The features of placeholder ``rows`` (of ``total``) of an encoded image output, in the container the model
    reads (a list of one tensor, or a tensor with a batch of one), the pooled and the deepstack features (what the
    models read of it); as transformers' chunked prefill slices them."""
    index = torch.tensor(rows)

    def pick(features: Any) -> Any:
        flat = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
        if flat.shape[0] != total:
            raise ValueError(f"the encoded images hold {flat.shape[0]} features for {total} image placeholders")
        picked = flat[index.to(flat.device)]
        return picked.unsqueeze(0) if isinstance(features, torch.Tensor) else [picked]

    sliced = {"pooler_output": pick(output["pooler_output"])}
    deepstack = output.get("deepstack_features")
    if deepstack is not None:
        sliced["deepstack_features"] = [pick(layer) for layer in deepstack]
    return type(output)(**sliced)


def _spans(config: Any, inputs: Mapping[str, Any]) -> list[tuple[int, int]]:
    """Each image's run of rows of a flat ``pixel_values`` (Qwen-VL's patches, by ``image_grid_thw``); empty where
    each image is one row."""
    grid = inputs.get("image_grid_thw")
    if not isinstance(grid, torch.Tensor):
        return []
    sizes = grid.prod(dim=-1).tolist()
    stops = list(itertools.accumulate(sizes))
    return [(stop - size, stop) for size, stop in zip(sizes, stops)]


def layout_of(config: Any, inputs: Mapping[str, Any]) -> str:
    """The layout of ``inputs``' images on a model of ``config`` (:data:`LAYOUTS`). Raises ``ValueError`` naming the
    family and its ``pixel_values`` where prefixkv does not know the family's layout, or the tensors are not in it."""
    family = getattr(config, "model_type", None)
    pixels = inputs["pixel_values"]
    shape = tuple(pixels.shape)
    layout = LAYOUTS.get(str(family))
    if layout is None:
        raise ValueError(
            f"{family}: a layout of images prefixkv does not know (pixel_values of shape {shape}); it keys the images "
            f"of {', '.join(sorted(LAYOUTS))}: build the cache from input_ids alone (it reuses the text before the "
            "first image)"
        )
    sizes = inputs.get("image_sizes")
    wanted = {"grid": 2, "rows": 4, "tiles": 5, "patches": 5}[layout]
    if pixels.dim() != wanted or (layout == "grid") != isinstance(inputs.get("image_grid_thw"), torch.Tensor):
        raise ValueError(
            f"{family}: pixel_values of shape {shape} are not in its layout ({layout}: {wanted}-D"
            f"{' with image_grid_thw' if layout == 'grid' else ''})"
        )
    if layout == "patches" and not (isinstance(sizes, torch.Tensor) and tuple(sizes.shape) == (shape[0], 2)):
        got = tuple(sizes.shape) if isinstance(sizes, torch.Tensor) else None
        raise ValueError(
            f"{family}: pixel_values of shape {shape} need image_sizes of shape ({shape[0]}, 2), got {got}"
        )
    return layout


def _split(
    layout: str, config: Any, inputs: Mapping[str, Any], runs: list[int]
) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    """Each image's processed inputs by name and its number of placeholder tokens, from the processor's ``inputs``
    in ``layout`` (``runs``: the lengths of the prompt's runs of image placeholders, in order). Raises
    ``ValueError`` where the inputs do not fit the placeholders."""
    pixels = inputs["pixel_values"]
    total = sum(runs)
    if layout == "grid":  # Qwen-VL: flat patches, each image's t*h*w of them
        grid = inputs["image_grid_thw"]
        merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", None)
        if not isinstance(merge, int):
            raise ValueError("image_grid_thw without a vision_config.spatial_merge_size: an unknown layout")
        spans = _spans(config, inputs)
        if spans[-1][1] != pixels.shape[0]:
            raise ValueError(f"image_grid_thw holds {spans[-1][1]} patches, pixel_values {pixels.shape[0]}")
        per = [{"pixel_values": pixels[a:b], "image_grid_thw": grid[i]} for i, (a, b) in enumerate(spans)]
        return per, [(b - a) // merge**2 for a, b in spans]
    if layout == "rows":  # one image per row of pixel_values (LLaVA, Gemma 3, Mistral 3)
        n = pixels.shape[0]
        sizes_in = inputs.get("image_sizes")
        per = []
        for i in range(n):
            one = {name: inputs[name][i] for name in _PER_IMAGE if isinstance(inputs.get(name), torch.Tensor)}
            if isinstance(sizes_in, torch.Tensor):  # padded to the largest image of the batch: its own part
                h, w = sizes_in[i].tolist()
                one["pixel_values"] = pixels[i, :, :h, :w]
            per.append(one)
        return per, _counts_by_size(config, sizes_in, n, total)
    if layout == "patches":  # one image per row of its patches, padded with all-zero ones (LLaVA-NeXT, -OneVision)
        if len(runs) != pixels.shape[0]:
            raise ValueError(
                f"{config.model_type}: {len(runs)} runs of image placeholders for {pixels.shape[0]} images (an image "
                "is one run: text between images tells them apart)"
            )
        per = [
            {"pixel_values": _real_patches(pixels[i]), "image_sizes": inputs["image_sizes"][i]}
            for i in range(len(runs))
        ]
        return per, list(runs)
    masks = inputs.get("pixel_attention_mask")  # tiles: each row's images, padded with all-zero ones (Idefics3)
    per = []
    for b, j in _real_images(pixels):
        one = {"pixel_values": pixels[b, j]}
        if isinstance(masks, torch.Tensor):
            one["pixel_attention_mask"] = masks[b, j]
        per.append(one)
    if not per or total % len(per):
        raise ValueError(f"{total} image placeholders cannot be shared among {len(per)} images of pixel_values")
    return per, [total // len(per)] * len(per)


def _real_patches(patches: torch.Tensor) -> torch.Tensor:
    """One image's patches (LLaVA-NeXT's ``[patches, 3, h, w]``) without the all-zero ones that pad it to the batch's
    most: the model reads the first of them its ``image_sizes`` give, which the digest holds too."""
    real = (patches != 0).flatten(1).any(dim=1).nonzero()
    return patches[: int(real[-1]) + 1 if len(real) else 0]


def _real_images(pixels: torch.Tensor) -> list[tuple[int, int]]:
    """The (row, slot) of each image of a 5-D ``pixel_values`` that is not padding (all zeros, as Idefics3 tells them
    apart), in order."""
    real = (pixels != 0).flatten(2).any(dim=-1)
    return [(b, j) for b, j in real.nonzero().tolist()]


def _pick_5d(value: torch.Tensor, kept: list[tuple[int, int]], rows: int) -> torch.Tensor:
    """A 5-D ``pixel_values`` (or its 4-D mask) holding only the images ``kept`` (their row, slot), each row's first,
    padded with zeros to the same count (one at least)."""
    per_row: list[list[int]] = [[] for _ in range(rows)]
    for b, j in kept:
        per_row[b].append(j)
    out = value.new_zeros((rows, max(1, *map(len, per_row)), *value.shape[2:]))
    for b, slots in enumerate(per_row):
        for i, j in enumerate(slots):
            out[b, i] = value[b, j]
    return out


def _counts_by_size(config: Any, sizes: Any, n: int, total: int) -> list[int]:
    """The placeholder tokens of each of ``n`` images: by its ``image_sizes`` where the model cuts an image into
    merged patches (Mistral 3: ``patch_size`` and ``spatial_merge_size``), else an equal share of ``total``."""
    patch = getattr(getattr(config, "vision_config", None), "patch_size", None)
    merge = getattr(config, "spatial_merge_size", None)
    if isinstance(sizes, torch.Tensor) and isinstance(patch, int) and isinstance(merge, int):
        cell = patch * merge
        return [(h // cell) * (w // cell) for h, w in sizes.tolist()]
    if total % n:
        raise ValueError(f"{total} image placeholders cannot be shared among {n} images of pixel_values")
    return [total // n] * n


def _same(a: Any, b: Any) -> bool:
    """Whether two inputs of one name are the same: both absent, one object, or tensors of one dtype, shape and
    values (a tensor in place of a number or a string is another)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return bool(a == b)


def _encoding(inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The keywords of ``inputs`` that change how an image is encoded (:data:`ENCODING`), as tensors for a digest:
    the bytes of each value's ``repr``."""
    return {
        name: torch.tensor(list(repr(inputs[name]).encode()), dtype=torch.uint8)
        for name in ENCODING
        if inputs.get(name) is not None
    }


def _unkeyed(config: Any, inputs: Mapping[str, Any]) -> str | None:
    """Why the images of ``inputs`` are not keyed, in a layout prefixkv knows, or ``None``: their placeholders then
    match nothing, as those of images the cache was not given."""
    several = inputs.get("batch_num_images")
    if isinstance(several, torch.Tensor) and bool((several > 1).any()):
        return (
            f"{config.model_type} encodes each image of a row with several (batch_num_images={several.tolist()}) "
            "otherwise than one alone, which prefixkv does not key: the images of this call are not reused"
        )
    return None


def _runs(keys: list[list[int]], image_id: int | None) -> list[int]:
    """The lengths of the runs of image placeholders (``image_id``, shown or hidden) of the rows ``keys``, in order."""
    runs: list[int] = []
    for row in keys:
        last = -2
        for t, k in enumerate(row):
            if token(k) == image_id:
                if t == last + 1:
                    runs[-1] += 1
                else:
                    runs.append(1)
                last = t
    return runs


def _token_types(
    inputs: Mapping[str, Any], pads: list[int], keys: list[list[int]], media: set[int], found: list[tuple[int, Image]]
) -> list[dict[str, torch.Tensor]]:
    """The token types of each image's placeholders (``found``: each image's row and span), by name
    (:data:`TOKEN_TYPES`: the model reads them for the attention within an image and its rotary positions). Raises
    ``ValueError`` where a type marks a token that is no placeholder, or two images' placeholders touch: the types of
    one image would then change another's K/V."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in found]
    for name in TOKEN_TYPES:
        types = inputs.get(name)
        if types is None:
            continue
        width = max(p + len(row) for p, row in zip(pads, keys))
        if not isinstance(types, torch.Tensor) or tuple(types.shape) != (len(keys), width):
            got = tuple(types.shape) if isinstance(types, torch.Tensor) else type(types).__name__
            raise ValueError(f"{name} of shape {got} for input_ids of shape {(len(keys), width)}")
        rows = types.detach().cpu()
        for b, (pad, row) in enumerate(zip(pads, keys)):
            marked = [t for t, v in enumerate(rows[b, pad:].tolist()) if v != 0 and token(row[t]) not in media]
            if marked:
                t = marked[0]
                raise ValueError(
                    f"{name} marks token {t} of row {b} (id {token(row[t])}, type {int(rows[b, pad + t])}), which is "
                    "no image placeholder: prefixkv keys an image by its placeholders' types"
                )
        for (b, image), extra in zip(found, out):
            extra[name] = rows[b, pads[b] + image.begin : pads[b] + image.end + 1]
        for (b, one), (c, two) in itertools.pairwise(found):
            if b == c and one.end + 1 == two.begin and bool(rows[b, pads[b] + two.begin] != 0):
                raise ValueError(
                    f"{name}: the images at tokens {one.begin}..{one.end} and {two.begin}..{two.end} of row {b} touch, "
                    "and the model reads their placeholders as one image: put a token between them"
                )
    return out


def _pick_images(
    kwargs: dict[str, Any], fed: list[int], layout: str | None, spans: list[tuple[int, int]]
) -> dict[str, Any]:
    """``kwargs`` (a forward's, by name) with the inputs of the images numbered ``fed`` only (in the images'
    ``layout``; ``spans``: each image's rows of a flat ``pixel_values``). Does not mutate."""
    out = dict(kwargs)
    for name in _PER_IMAGE:
        value = kwargs.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        if not fed:
            out[name] = None
        elif layout == "tiles":
            real = _real_images(kwargs["pixel_values"])
            out[name] = _pick_5d(value, [real[n] for n in fed], value.shape[0])
        elif name == "pixel_values" and spans:
            out[name] = torch.cat([value[slice(*spans[n])] for n in fed])
        else:
            out[name] = value[torch.tensor(fed, device=value.device)]
    several = kwargs.get("batch_num_images")
    if isinstance(several, torch.Tensor):
        # LLaVA-OneVision encodes an image alone (in patches) where its count is 1, as every keyed one's is (plan)
        out["batch_num_images"] = several.new_ones(len(fed))
    return out


def plan(config: Any, pads: list[int], keys: list[list[int]], inputs: Mapping[str, Any]) -> ImagePlan | None:
    """The images of a prompt whose rows are ``keys`` (after ``pads``) on a model of ``config``, given the
    processor's ``inputs`` (none: every placeholder is an image the cache was not given) and the ``generate``
    keywords that change how they are encoded (:data:`ENCODING`); ``None`` for a model that takes no images or a
    prompt without placeholders. Raises ``ValueError`` where the inputs do not fit the placeholders, with the numbers,
    or their layout is not one prefixkv knows (:func:`layout_of`), naming it."""
    ids = placeholder_ids(config)
    if not ids:
        return None
    media = set(ids.values())
    image_id = ids.get("image")
    at = [[t for t, k in enumerate(row) if token(k) in media] for row in keys]
    if not any(at):
        return None
    per: list[dict[str, torch.Tensor]] = []
    counts: list[int] = []
    layout = None
    refusal = None
    if isinstance(inputs.get("pixel_values"), torch.Tensor):
        layout = layout_of(config, inputs)
        refusal = _unkeyed(config, inputs)
    if refusal is None and layout is not None:
        runs = _runs(keys, image_id)
        per, counts = _split(layout, config, inputs, runs)
        if sum(counts) != sum(runs):
            raise ValueError(
                f"the prompt holds {sum(runs)} image placeholder tokens, but its {len(per)} images need {sum(counts)} "
                f"({counts}): build the cache from the processor's outputs for these input_ids"
            )
    found, out_rows, placed = _place(keys, at, image_id, len(per), counts)
    types = _token_types(inputs, pads, keys, media, found) if per else []
    encoding = _encoding(inputs)
    parts = [images.digest(one) for one in per]
    digests = [images.digest({**one, **extra, **encoding}) for one, extra in zip(per, types)]
    out_keys = [_keyed(row, row_placed, digests) for row, row_placed in zip(keys, placed)]
    out = ImagePlan(config, out_keys, out_rows, inputs if per else {}, digests, counts, layout, parts)
    out.refusal = refusal
    return out


# a row's placeholders: each one's token index, its image (-1: none) and its index among that image's placeholders
_Placed = list[tuple[int, int, int]]


def _place(
    keys: list[list[int]], at: list[list[int]], image_id: int | None, given: int, counts: list[int]
) -> tuple[list[tuple[int, Image]], list[list[Image]], list[_Placed]]:
    """The ``given`` images the placeholders ``at`` of each row of ``keys`` hold, in order, each taking ``counts``
    of them: each image's row and span, each row's images and each row's placeholders (:data:`_Placed`). Raises
    ``ValueError`` where they end inside an image. Does not mutate."""
    found: list[tuple[int, Image]] = []  # each image's row and span
    out_rows: list[list[Image]] = []
    placed: list[_Placed] = []
    image, used = 0, 0  # the image now, and how many of its placeholders the rows used so far
    for b, (row, where) in enumerate(zip(keys, at)):
        row_images: list[Image] = []
        row_placed: _Placed = []
        for t in where:
            k = row[t]
            if k < 0 or token(k) != image_id or image >= given:
                # a video, audio, an image not given, or a placeholder the mask hides: matches nothing from here
                row_images.append(Image(t, t, -1))
                row_placed.append((t, -1, 0))
                continue
            if used == 0:
                row_images.append(Image(t, t, image))
                found.append((b, row_images[-1]))
            else:
                row_images[-1] = row_images[-1]._replace(end=t)
                found[-1] = (b, row_images[-1])
            row_placed.append((t, image, used))
            used += 1
            if used == counts[image]:
                image, used = image + 1, 0
        out_rows.append(row_images)
        placed.append(row_placed)
    if given and (image, used) != (given, 0):
        raise ValueError(f"the prompt's placeholders end inside image {image} of {given}")
    return found, out_rows, placed


def _keyed(row: list[int], placed: _Placed, digests: list[bytes]) -> list[int]:
    """``row``'s keys with its ``placed`` placeholders keyed by their images' ``digests`` (one no image has for a
    placeholder of none). Does not mutate."""
    out, unknown = list(row), images.unknown()
    for t, number, index in placed:
        out[t] = image_key(unknown if number < 0 else digests[number], t if number < 0 else index, token(row[t]))
    return out


def reset_rope_deltas(model: torch.nn.Module) -> None:
    """Forget the multimodal rotary offsets (Qwen-VL's ``rope_deltas``) an earlier call left on ``model``, as a call
    with an empty cache does: ``generate`` then computes the positions of the whole prompt from its images, and a
    call that reuses part of it gets those stock computes. Mutates the model."""
    for m in (model, getattr(model, "model", None)):
        if m is not None and getattr(m, "rope_deltas", None) is not None:
            m.rope_deltas = None


@contextlib.contextmanager
def rope_deltas_aside(model: torch.nn.Module) -> Iterator[None]:
    """Run the body as a call with an empty cache starts (:func:`reset_rope_deltas`), and put the offsets an earlier
    call left back after it: a forward prefixkv runs on its own (the store's measuring forwards, hf/shapes.py)
    resumes its cache with no offsets of a call of another batch size, and leaves the model as it found it."""
    modules = [m for m in (model, getattr(model, "model", None)) if isinstance(m, torch.nn.Module)]
    held = [(m, m.rope_deltas) for m in modules if hasattr(m, "rope_deltas")]
    reset_rope_deltas(model)
    try:
        yield
    finally:
        for m, deltas in held:
            m.rope_deltas = deltas
