"""Images in a prompt (docs/generate.md, "Images"): which tokens of a vision-language model's prompt are an image's
placeholders, which processed inputs belong to each image, and the keys that make an image's K/V reused only for the
same image processed alike (:func:`plan`, an :class:`ImagePlan`), and the inputs a forward that feeds only a prompt's
uncached tail gets: those of the images in it (:meth:`ImagePlan.feed`).

A placeholder run takes the keys of its image's digest (:func:`prefixkv.images.digest` of its rows of
``pixel_values`` and every other tensor the model's forward takes for it); the placeholders of an image the cache
was not given (a video, audio, a cache built from the ids alone) take the keys of a digest no image has, so nothing
is reused at or past them, and the text before them is. Nothing here mutates but :func:`reset_rope_deltas`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from .. import images
from ..tokens import image_key, token

# what a vision-language model's forward takes for its images, videos and audio, besides the ids: their K/V are
# keyed by the digests of the images (ImagePlan); the token type ids mark the placeholders, a function of the ids
IMAGE_INPUTS = frozenset(
    {
        *("pixel_values", "pixel_mask", "pixel_attention_mask", "image_sizes", "image_grid_thw", "num_patches"),
        *("pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "image_sizes_videos"),
        *("input_features", "input_features_mask", "feature_attention_mask"),
        *("aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask"),
        *("token_type_ids", "mm_token_type_ids"),
    }
)
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
    ) -> None:
        self.config = config
        self.keys = keys
        self.rows = rows
        self.inputs = {name: inputs.get(name) for name in _PER_IMAGE}
        self.digests = digests
        self.counts = counts
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
        if all(kwargs.get(name) is self.inputs[name] for name in _PER_IMAGE):
            spans = _spans(self.config, kwargs)
        else:
            self.check(kwargs, [image.number for _, image in order])
            spans = _spans(self.config, kwargs)
        fed = [n for n, (b, image) in enumerate(order) if image.begin >= starts[b]]
        if len(fed) == len(order):
            return kwargs
        out = dict(kwargs)
        for name in _PER_IMAGE:
            value = kwargs.get(name)
            if not isinstance(value, torch.Tensor):
                continue
            if not fed:
                out[name] = None
            elif kwargs["pixel_values"].dim() == 5:
                real = _real_images(kwargs["pixel_values"])
                out[name] = _pick_5d(value, [real[n] for n in fed], value.shape[0])
            elif name == "pixel_values" and spans:
                out[name] = torch.cat([value[slice(*spans[n])] for n in fed])
            else:
                out[name] = value[torch.tensor(fed, device=value.device)]
        return out

    def check(self, inputs: Mapping[str, Any], order: list[int] | None = None) -> None:
        """Raise ``ValueError`` unless ``inputs`` (by name) carry the images the plan was built from (``order``: which
        of them, in order; all by default), compared by digest where they are other tensors."""
        if not self.digests or all(inputs.get(name) is self.inputs[name] for name in _PER_IMAGE):
            return
        order = list(range(len(self.digests))) if order is None else order
        pixels = inputs.get("pixel_values")
        same = False
        if isinstance(pixels, torch.Tensor):
            per, _, _ = _split(self.config, inputs, sum(self.counts[i] for i in order))
            same = [images.digest(one) for one in per] == [self.digests[i] for i in order]
        if not same:
            raise ValueError(
                "the images generate was given are not those the PagedPrefixCache was built with: build it from the "
                "same processor outputs (pixel_values, image_grid_thw, ...) you pass to generate"
            )

    def encode_only(self, starts: list[int], kwargs: dict[str, Any]) -> dict[str, Any]:
        """``generate``'s arguments (``kwargs``) with the inputs of the images a call feeds only (prompt row ``r`` from
        its token ``starts[r]``), for ``generate`` to encode before the prefill: the cached images are not encoded
        again. Mutates the plan: it notes where the encoded images begin (:meth:`feed` picks their features)."""
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


def _split(
    config: Any, inputs: Mapping[str, Any], total: int
) -> tuple[list[dict[str, torch.Tensor]], list[int], list[tuple[int, int]]]:
    """Each image's processed inputs by name, its number of placeholder tokens, and its run of ``pixel_values``
    rows, from the processor's ``inputs`` (``total``: the image placeholders of the prompt). Raises ``ValueError``
    for a layout it does not know, naming it."""
    pixels = inputs["pixel_values"]
    grid = inputs.get("image_grid_thw")
    if isinstance(grid, torch.Tensor):  # Qwen-VL: flat patches, each image's t*h*w of them
        merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", None)
        if not isinstance(merge, int):
            raise ValueError("image_grid_thw without a vision_config.spatial_merge_size: an unknown layout")
        spans = _spans(config, inputs)
        if spans[-1][1] != pixels.shape[0]:
            raise ValueError(f"image_grid_thw holds {spans[-1][1]} patches, pixel_values {pixels.shape[0]}")
        per = [{"pixel_values": pixels[a:b], "image_grid_thw": grid[i]} for i, (a, b) in enumerate(spans)]
        return per, [(b - a) // merge**2 for a, b in spans], spans
    if pixels.dim() == 4:  # one image per row of pixel_values (LLaVA, Gemma 3, Mistral 3)
        n = pixels.shape[0]
        sizes_in = inputs.get("image_sizes")
        per = []
        for i in range(n):
            one = {name: inputs[name][i] for name in _PER_IMAGE if isinstance(inputs.get(name), torch.Tensor)}
            if isinstance(sizes_in, torch.Tensor):  # padded to the largest image of the batch: its own part
                h, w = sizes_in[i].tolist()
                one["pixel_values"] = pixels[i, :, :h, :w]
            per.append(one)
        counts = _counts_by_size(config, sizes_in, n, total)
        return per, counts, []
    if pixels.dim() == 5:  # each row's images, padded with all-zero ones (Idefics3, SmolVLM)
        masks = inputs.get("pixel_attention_mask")
        per = []
        for b, j in _real_images(pixels):
            one = {"pixel_values": pixels[b, j]}
            if isinstance(masks, torch.Tensor):
                one["pixel_attention_mask"] = masks[b, j]
            per.append(one)
        if not per or total % len(per):
            raise ValueError(f"{total} image placeholders cannot be shared among {len(per)} images of pixel_values")
        return per, [total // len(per)] * len(per), []
    raise ValueError(
        f"pixel_values of shape {tuple(pixels.shape)}: a layout prefixkv cannot split per image (it splits Qwen-VL's "
        "flat patches with image_grid_thw and one image per row of a 4-D tensor)"
    )


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


def plan(config: Any, pads: list[int], keys: list[list[int]], inputs: Mapping[str, Any]) -> ImagePlan | None:
    """The images of a prompt whose rows are ``keys`` (after ``pads``) on a model of ``config``, given the
    processor's ``inputs`` (none: every placeholder is an image the cache was not given); ``None`` for a model that
    takes no images or a prompt without placeholders. Raises ``ValueError`` where the inputs do not fit the
    placeholders, with the numbers."""
    ids = placeholder_ids(config)
    if not ids:
        return None
    media = set(ids.values())
    image_id = ids.get("image")
    at = [[t for t, k in enumerate(row) if token(k) in media] for row in keys]
    if not any(at):
        return None
    count = sum(1 for row, where in zip(keys, at) for t in where if token(row[t]) == image_id)
    per: list[dict[str, torch.Tensor]] = []
    counts: list[int] = []
    if isinstance(inputs.get("pixel_values"), torch.Tensor):
        per, counts, _ = _split(config, inputs, count)
        if sum(counts) != count:
            raise ValueError(
                f"the prompt holds {count} image placeholder tokens, but its {len(per)} images need {sum(counts)} "
                f"({counts}): build the cache from the processor's outputs for these input_ids"
            )
    digests = [images.digest(one) for one in per]
    out_keys, out_rows = [], []
    image, used = 0, 0  # the image now, and how many of its placeholders the rows used so far
    for row, where in zip(keys, at):
        row_keys, row_images = list(row), []
        unknown: bytes | None = None
        for t in where:
            k = row[t]
            if k < 0 or token(k) != image_id or image >= len(per):
                # a video, audio, an image not given, or a placeholder the mask hides: matches nothing from here
                unknown = unknown or images.unknown()
                row_keys[t] = image_key(unknown, t, token(k))
                row_images.append(Image(t, t, -1))
                continue
            row_keys[t] = image_key(digests[image], used, token(k))
            if used == 0:
                row_images.append(Image(t, t, image))
            else:
                row_images[-1] = row_images[-1]._replace(end=t)
            used += 1
            if used == counts[image]:
                image, used = image + 1, 0
        out_keys.append(row_keys)
        out_rows.append(row_images)
    if per and (image, used) != (len(per), 0):
        raise ValueError(f"the prompt's placeholders end inside image {image} of {len(per)}")
    return ImagePlan(config, out_keys, out_rows, inputs, digests, counts)


def reset_rope_deltas(model: torch.nn.Module) -> None:
    """Forget the multimodal rotary offsets (Qwen-VL's ``rope_deltas``) an earlier call left on ``model``, as a call
    with an empty cache does: ``generate`` then computes the positions of the whole prompt from its images, and a
    call that reuses part of it gets those stock computes. Mutates the model."""
    for m in (model, getattr(model, "model", None)):
        if m is not None and getattr(m, "rope_deltas", None) is not None:
            m.rope_deltas = None
