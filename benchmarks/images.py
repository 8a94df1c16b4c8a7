"""Time to first token of a follow-up question about the same image: stock ``generate`` (a fresh DynamicCache, the
whole chat recomputed, the image encoded again) against prefixkv (the chat so far, image included, reused), on a small
vision-language model built from Qwen2-VL's config, float32. Run: ``python benchmarks/images.py``."""

from __future__ import annotations

import argparse
from typing import Any

import torch
import transformers
from _common import interleaved, save, table
from transformers import DynamicCache

import prefixkv

IMAGE, START, END = 250, 252, 253


def qwen2_vl(layers: int, hidden: int) -> Any:
    """A Qwen2-VL-shaped model: its config with a narrower, shallower text model and vision tower (random weights)."""
    config = prefixkv.models.tiny_config(
        "qwen2_vl",
        text_config={
            **{"vocab_size": 4096, "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": layers},
            **{"num_attention_heads": hidden // 64, "num_key_value_heads": 2, "max_position_embeddings": 8192},
            "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 1000000.0},
        },
        vision_config={
            **{"depth": 4, "embed_dim": 256, "hidden_size": hidden, "num_heads": 4, "patch_size": 14},
            **{"spatial_merge_size": 2, "temporal_patch_size": 2},
        },
    )
    return prefixkv.models.build(config, dtype=torch.float32)


def run(grid: int, layers: int, hidden: int, system: int, question: int, repeat: int) -> dict[str, Any]:
    model = qwen2_vl(layers, hidden)
    g = torch.Generator().manual_seed(0)
    image_tokens = grid * grid // 4
    pixels = torch.randn(grid * grid, 3 * 2 * 14 * 14, generator=g)
    grid_thw = torch.tensor([[1, grid, grid]])

    def words(n: int) -> list[int]:
        return torch.randint(3, 240, (n,), generator=g).tolist()

    first = [*words(system), START, *[IMAGE] * image_tokens, END, *words(question)]
    answer, follow = words(24), words(question)
    ids = torch.tensor([first + answer + follow])
    inputs = {
        "input_ids": ids,
        "pixel_values": pixels,
        "image_grid_thw": grid_thw,
        "mm_token_type_ids": (ids == IMAGE).long(),
    }
    earlier = {**inputs, "input_ids": ids[:, : len(first) + len(answer)]}
    earlier["mm_token_type_ids"] = inputs["mm_token_type_ids"][:, : len(first) + len(answer)]
    gen = {"max_new_tokens": 1, "do_sample": False}
    store = prefixkv.PrefixStore(model, block_size=16)
    with torch.inference_mode(), prefixkv.PagedPrefixCache(store, **earlier) as cache:
        model.generate(**earlier, cache=cache, **gen)  # the chat so far: what the first turn left cached
    cached = []

    def stock() -> None:
        with torch.inference_mode():
            model.generate(**inputs, cache=DynamicCache(config=model.config), **gen)

    def paged() -> None:
        with torch.inference_mode(), prefixkv.PagedPrefixCache(store, **inputs) as cache:
            model.generate(**inputs, cache=cache, **gen)
        cached.append(cache.stats.cached_tokens)

    t = interleaved({"stock": stock, "prefixkv": paged}, repeat)
    store.close()
    return {
        "layers": layers,
        "hidden": hidden,
        "image_tokens": image_tokens,
        "prompt": ids.shape[1],
        "cached": cached[-1],
        **t,
    }


def report(r: dict[str, Any]) -> str:
    return table(
        [
            *("model (Qwen2-VL-shaped, float32)", "prompt tokens (image)", "reused"),
            *("stock TTFT ms", "prefixkv TTFT ms", "speed-up"),
        ],
        [
            [
                f"{r['layers']} layers, hidden {r['hidden']}",
                f"{r['prompt']} ({r['image_tokens']})",
                r["cached"],
                f"{r['stock']:.0f}",
                f"{r['prefixkv']:.0f}",
                f"{r['stock'] / r['prefixkv']:.1f}x",
            ]
        ],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--grid", type=int, default=40, help="the image's patches per side (tokens: grid**2 / 4)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--system", type=int, default=64)
    ap.add_argument("--question", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    result = run(args.grid, args.layers, args.hidden, args.system, args.question, args.repeat)
    save("images", result)
    print(report(result))


if __name__ == "__main__":
    main()
