"""The family census: every causal-LM family of the installed transformers, tried as a new user would.

For each ``model_type`` of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` it builds a tiny model from the
family's own config class (2 layers, hidden size 64, random weights; the families of :func:`prefixkv.models.families`
with their own tiny configs), runs stock ``generate`` with a ``DynamicCache`` on an untouched copy, and prefixkv cold,
warm (45 shared prompt tokens), with beam search and with a left-padded batch, comparing every step's logits
(float64 within 1e-6; float32 within 1e-4 where the family's kernels refuse float64); a model with recurrent layers
first gets a prompt that leaves the cold one's path at the shared prefix (it takes the state snapshot the warm call
resumes from). One line per family:

- ``exact``: every check within the bound, and the warm call reused the shared prefix;
- ``exact, no reuse``: every check within the bound, nothing reused, and the cache's stats say why
  (:attr:`prefixkv.stats.CacheStats.not_cached`);
- ``refused``: ``PrefixStore`` raised :class:`~prefixkv.UnsupportedModelError`, with the reason;
- ``n/a``: stock ``generate`` cannot build or run the family at that size, with transformers' error;
- ``slow``: the checks ran past the time limit (``time_limit``, 60 s by default: a busy machine, or a family slow at
  that size), so they say nothing either way; not a defect (the census test does not fail on it), and
  ``python -m prefixkv families NAME --time-limit 0`` runs that family without a limit;
- ``wrong``, ``crash``, ``silent miss`` (nothing reused and no reason given): a defect of prefixkv (the census test
  fails on any).

``python -m prefixkv families`` prints the table; docs/architectures.md's census table is its ``--markdown`` output.

>>> [r.verdict for r in run(["llama", "openai-gpt"])]
['exact', 'refused']
"""

from __future__ import annotations

import contextlib
import copy
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch.nn.utils.rnn import pad_sequence

from . import models
from ._compat import GENERATE_CACHE_KWARG
from .errors import UnsupportedModelError
from .hf.cache import PagedPrefixCache
from .hf.support import REFUSAL_ADVICE
from .store import PrefixStore

VERDICTS = ("exact", "exact, no reuse", "refused", "n/a", "slow", "wrong", "crash", "silent miss")
DEFECTS = frozenset({"wrong", "crash", "silent miss"})
"""The verdicts that are prefixkv's defects: the census test fails on any of them."""

SHARED = 45  # prompt tokens the warm call, the beams and the padded batch share with the cold call
BLOCK_SIZE = 4  # a match ends inside a block: 44 tokens shared as whole blocks, 1 copied
MAX_PARAMETERS = 20_000_000  # a family whose tiny config still builds more is reported n/a, not built
_BOUND = {torch.float64: 1e-6, torch.float32: 1e-4}
# every call passes use_cache=True, as a user who wants a cache does (MPT's config turns it off by default)
_GENERATE = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True, use_cache=True)

# the sizes of a tiny model, applied to every field a family's config class (and each of its sub-configs) has
_TINY_FIELDS: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
    "tie_word_embeddings": False,
    "experts_implementation": "eager",  # grouped_mm has no float64 kernel
    # mixtures of experts and multi-head latent attention at the same scale
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    # hybrids: an attention layer among the 2 (their default period is longer)
    "full_attention_interval": 2,
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    # state-space layers at the same scale (expand 2 x hidden 64 = 8 heads of 16)
    "mamba_n_heads": 8,
    "mamba_d_state": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    # vision towers of the multimodal families that are causal LMs too
    "image_size": 32,
    "patch_size": 8,
}

# hybrids whose 2 tiny layers would otherwise be of one kind (their attention comes every 4th to 8th layer): one
# layer of each kind, named as each family's config names them
_ONE_OF_EACH = ["linear_attention", "full_attention"]
_FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    **{t: {"layer_types": _ONE_OF_EACH} for t in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # hybrids whose attention layers are latent (MLA): as many KV heads as query heads, as below
    **{t: {"layer_types": _ONE_OF_EACH, "num_key_value_heads": 4} for t in ("kimi_linear", "bailing_hybrid")},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "bamba": {"attn_layer_indices": [1]},
    "lfm2": {"full_attn_idxs": [1]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "zamba": {"layer_types": ["linear_attention", "hybrid"]},
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"]},  # its layer_types alias comes too late
    "mamba2": {"num_heads": 8, "head_dim": 16},
    # Gemma 3n and 4: layers that read an earlier layer's K/V (the last 2 of 4), per-layer inputs from a table of the
    # tiny vocabulary's size, full-attention layers wider than sliding ones (Gemma 4)
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
        "activation_sparsity_pattern": [0.0] * 4,
        "vocab_size_per_layer_input": 256,
        "hidden_size_per_layer_input": 16,
        "laurel_rank": 8,
        "head_dim": 16,
    },
    "gemma4_text": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
        "vocab_size_per_layer_input": 256,
        "hidden_size_per_layer_input": 16,
        "head_dim": 16,
        "global_head_dim": 32,
    },
    # multi-head latent attention expands its latent to every query head: transformers' sdpa repeats K/V by
    # heads // num_key_value_heads all the same, so a resumed forward of several ids fails unless they are equal (as
    # in every released checkpoint)
    **{
        t: {"num_key_value_heads": 4}
        for t in (
            "deepseek_v2",
            "deepseek_v3",
            "glm4_moe_lite",
            "minicpm3",
            "sarvam_mla",
            "youtu",
            "deepseek_v32",
            "glm_moe_dsa",
        )
    },
    # families whose tiny config, not stock, was what failed: a head size or rotary size left at the real model's,
    # expert groups more than the 4 experts, per-layer-kind rotary parameters, a vision tower left full size
    **{t: {"head_dim": 16} for t in ("helium", "hunyuan_v1_dense", "hunyuan_v1_moe", "ministral")},
    "codegen": {"rotary_dim": 8},
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 24,
        "rope_parameters": {
            kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in ("sliding_attention", "full_attention")
        },
    },
    # DBRX maps hidden_size to d_model only after sizing its experts; its attention reads rope_theta and clip_qkv
    # from attn_config (the class declares neither)
    "dbrx": {"d_model": 64, "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "gemma3": {
        "vision_config": {
            "model_type": "siglip_vision_model",
            **{k: _TINY_FIELDS[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")},
            **{k: _TINY_FIELDS[k] for k in ("num_attention_heads", "image_size", "patch_size")},
        },
        "mm_tokens_per_image": 16,  # (image_size / patch_size) ** 2
    },
    # latent attention expands its latent to every query head (num_key_value_heads equal, as in the released
    # checkpoints); DeepSeek's grouped routing needs no more groups than experts
    **{t: {"num_key_value_heads": 4} for t in ("deepseek_v32", "glm_moe_dsa", "axk2")},
    "axk1": {"num_key_value_heads": 4, "n_group": 1, "topk_group": 1},
    "longcat_flash": {"num_layers": 1, "head_dim": 8, "num_key_value_heads": 4},  # 2 layers: 2 per num_layers; MLA
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 24},
    "xlnet": {"d_head": 16},
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [16, 32]},
    **{t: {"unpadded_vocab_size": 256, "eos_token_id": 2} for t in ("inkling2_text", "inkling2_loop_text")},
    "xlstm": {"num_heads": 4, "qk_dim_factor": 1.0},  # its cache's matrix state is sized for query heads of v's size
}


@dataclass(frozen=True)
class FamilyResult:
    """The census's line for one family: its ``verdict`` (one of :data:`VERDICTS`), ``detail`` (the reason, the
    error or the path), the dtype it ran in, the largest logit difference from stock over every check, the prompt
    tokens the warm call reused, and the seconds it took."""

    family: str
    verdict: str
    detail: str
    dtype: str = ""
    max_diff: float | None = None
    reused: int = 0
    seconds: float = 0.0

    @property
    def defect(self) -> bool:
        """Whether the line is prefixkv's defect (wrong, crash or silently nothing reused)."""
        return self.verdict in DEFECTS


def families() -> list[str]:
    """Every causal-LM ``model_type`` of the installed transformers that has a config class, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t in transformers.CONFIG_MAPPING)


def tiny_config(model_type: str) -> Any:
    """A tiny config of ``model_type`` from its own config class: :func:`prefixkv.models.tiny_config` for the families
    it knows, else the class's defaults with :data:`_TINY_FIELDS` set wherever the class (or a sub-config) has the
    field, and a hybrid's layer kinds from :data:`_FAMILY_FIELDS`. Raises what the config class raises."""
    if model_type in models.families():
        return models.tiny_config(model_type)
    cls = transformers.CONFIG_MAPPING[model_type]
    subs = {name: _fields_of(sub) for name, sub in (getattr(cls, "sub_configs", None) or {}).items()}
    kwargs = {**_fields_of(cls), **_FAMILY_FIELDS.get(model_type, {})}
    kwargs.update(
        {
            name: {**fields, **_FAMILY_FIELDS.get(getattr(sub, "model_type", ""), {})}
            for name, sub in (getattr(cls, "sub_configs", None) or {}).items()
            if (fields := subs[name])
        }
    )
    try:
        return cls(**kwargs)
    except Exception:  # a sub-config that validates against its parent: the class's own sub-configs
        return cls(**_fields_of(cls))


def _fields_of(cls: Any) -> dict[str, Any]:
    """:data:`_TINY_FIELDS` that config class ``cls`` has (by name or through its ``attribute_map``)."""
    try:
        known = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}) or {})
    except Exception:
        return {}
    return {k: v for k, v in _TINY_FIELDS.items() if k in known}


class _TimeLimit(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`_TimeLimit` in the block after ``seconds`` (only in the main thread, where signals arrive)."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(*_: Any) -> None:
        raise _TimeLimit(f"ran past the time limit of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _prompts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cold prompt, the warm one, the beams' one, and a left-padded batch (ids, mask): all share the first
    :data:`SHARED` tokens."""
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(3, 200, (n,), generator=g)

    system = tokens(SHARED)
    cold, warm, beams = (torch.cat([system, tokens(n)])[None] for n in (6, 9, 5))
    rows = [torch.cat([system, tokens(4)]), torch.cat([system, tokens(7)])]
    ids = pad_sequence(rows, batch_first=True, padding_value=0, padding_side="left")
    mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_value=0, padding_side="left")
    return cold, warm, beams, ids, mask


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor | None, cache: Any = None, **kw: Any) -> Any:
    if mask is None:
        mask = torch.ones_like(ids)
    extra = {} if cache is None else {GENERATE_CACHE_KWARG: cache}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, attention_mask=mask, pad_token_id=0, **_GENERATE, **extra, **kw)


def _diff(ref: Any, out: Any) -> float:
    """The largest logit difference over every step (``inf`` where the steps or tokens differ)."""
    if out.sequences.shape != ref.sequences.shape or not bool((out.sequences == ref.sequences).all()):
        return float("inf")
    return float(max((a.double() - b.double()).abs().max().item() for a, b in zip(ref.logits, out.logits)))


def _build(config: Any, dtype: torch.dtype) -> Any:
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    size = sum(p.numel() for p in meta.parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"{size / 1e6:.0f}M parameters at the tiny config's sizes (the census builds at most 20M)")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _refuses_float64(error: BaseException) -> bool:
    text = str(error)
    return any(w in text for w in ("Double", "double", "float64"))


def check_family(model_type: str, *, time_limit: float | None = 60.0) -> FamilyResult:
    """The census line of ``model_type`` (see the module's docstring). Builds and runs tiny models; changes
    nothing outside them."""
    start = time.perf_counter()
    try:
        with _time_limit(time_limit):
            result = _check(model_type)
    except _TimeLimit as e:  # the machine's load is no verdict on prefixkv: say so, never "crash"
        result = FamilyResult(model_type, "slow", f"{e}; not checked (--time-limit 0 runs it without a limit)")
    return FamilyResult(**{**vars(result), "seconds": time.perf_counter() - start})


def _check(model_type: str) -> FamilyResult:
    cold, warm, beams, padded, mask = _prompts()
    try:
        config = tiny_config(model_type)
    except Exception as e:
        return FamilyResult(model_type, "n/a", f"its config class cannot be built tiny: {_one_line(e)}")
    dtype = torch.float64
    while True:
        try:
            model = _build(config, dtype)
            twin = copy.deepcopy(model)
            refs = [_generate(twin, cold, None), _generate(twin, warm, None)]
            break
        except Exception as e:
            if dtype == torch.float64 and _refuses_float64(e):
                dtype = torch.float32
                continue
            return FamilyResult(model_type, "n/a", f"stock generate cannot run it at this size: {_one_line(e)}")
    name = str(dtype).removeprefix("torch.")
    try:
        store = PrefixStore(model, block_size=BLOCK_SIZE)
    except UnsupportedModelError as e:
        reason = str(e).removeprefix(f"{model_type} ").removesuffix(REFUSAL_ADVICE)
        return FamilyResult(model_type, "refused", _one_line(reason), name)
    try:
        return _compare(model_type, model, twin, store, refs, (cold, warm, beams, padded, mask), dtype)
    except Exception as e:
        return FamilyResult(model_type, "crash", f"{type(e).__name__}: {_one_line(e)}", name)
    finally:
        store.close()


def _compare(
    model_type: str, model: Any, twin: Any, store: PrefixStore, refs: list[Any], prompts: Sequence[Any], dtype: Any
) -> FamilyResult:
    cold, warm, beams, padded, mask = prompts
    name = str(dtype).removeprefix("torch.")
    diffs: dict[str, float] = {}
    reused, why = 0, None
    calls = [("cold", cold, refs[0]), ("warm", warm, refs[1])]
    if store.layer_kinds is not None:
        # recurrent layers resume only where a state snapshot was taken: the first prompt that leaves the cold one's
        # path at the shared prefix takes it there (docs/architectures.md, "Recurrent and hybrid layers"), so that
        # the warm call resumes at the shared prefix
        calls.insert(1, ("junction", beams, _generate(twin, beams, None)))
    for label, ids, ref in calls:
        with PagedPrefixCache(store, ids) as cache:
            diffs[label] = _diff(ref, _generate(model, ids, None, cache))
        reused, why = cache.stats.cached_tokens, why or cache.stats.not_cached
    with PagedPrefixCache(store, beams) as cache:
        diffs["beams"] = _diff(
            _generate(twin, beams, None, num_beams=3), _generate(model, beams, None, cache, num_beams=3)
        )
    refused = ""
    try:
        with PagedPrefixCache(store, padded, mask) as cache:
            out = _generate(model, padded, mask, cache)
    except UnsupportedModelError as e:  # a model that cannot be served a padded batch exactly says so
        refused = f"; a padded batch refused: {_one_line(e).removeprefix('this model ')}"
    else:
        ref = _generate(twin, padded, mask)
        if any(bool(step.isnan().any()) for step in ref.logits):  # stock's own NaN for padded rows in float64
            diffs["padded"] = _rows_alone(twin, padded, mask, out)
        else:
            diffs["padded"] = _diff(ref, out)
    store.check_invariants()
    worst = max(diffs.values())
    bad = [k for k, v in diffs.items() if not v <= _BOUND[dtype]]
    if bad:
        detail = ", ".join(f"{k} {diffs[k]:.1e}" for k in bad)
        return FamilyResult(model_type, "wrong", f"logits off stock: {detail} ({name})", name, worst, reused)
    path = "the model's own attention on whole rows" if not _reads_blocks(model) else "reads the blocks"
    if store.layer_kinds is not None:
        path += "; recurrent layers resume from state snapshots"
    if reused == 0 and why is not None:
        return FamilyResult(model_type, "exact, no reuse", f"{path}; not cached: {why}", name, worst, reused)
    if reused == 0:
        return FamilyResult(
            model_type, "silent miss", f"the warm call reused nothing, and no reason{refused}", name, worst, 0
        )
    return FamilyResult(model_type, "exact", path + refused, name, worst, reused)


def _rows_alone(twin: Any, padded: torch.Tensor, mask: torch.Tensor, out: Any) -> float:
    """The largest difference of each row of a padded prefixkv batch from that row generated alone by stock."""
    worst = 0.0
    for i in range(padded.shape[0]):
        keep = mask[i].bool()
        ref = _generate(twin, padded[i : i + 1, keep], None)
        tokens = out.sequences[i, padded.shape[1] :]
        if not torch.equal(tokens, ref.sequences[0, keep.sum().item() :]):
            return float("inf")
        worst = max(
            worst, max((a[0].double() - b[i].double()).abs().max().item() for a, b in zip(ref.logits, out.logits))
        )
    return worst


def _reads_blocks(model: Any) -> bool:
    from .attention import interface

    return interface.serves(model) and interface.verified(model)


def _one_line(error: BaseException | str) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 200 else text[:197] + "..."


def run(
    names: Sequence[str] | None = None,
    *,
    time_limit: float | None = 60.0,
    progress: Callable[[FamilyResult], None] | None = None,
) -> list[FamilyResult]:
    """The census lines of ``names`` (default: every family, :func:`families`), each reported to ``progress`` as it
    ends."""
    results = []
    for name in families() if names is None else names:
        result = check_family(name, time_limit=time_limit)
        if progress is not None:
            progress(result)
        results.append(result)
    return results


def line(result: FamilyResult) -> str:
    """One census line as text."""
    return f"{result.family:28} {result.verdict:15} {result.detail}"


def counts(results: Sequence[FamilyResult]) -> dict[str, int]:
    """How many families got each verdict, in the order of :data:`VERDICTS`."""
    return {v: n for v in VERDICTS if (n := sum(r.verdict == v for r in results))}


def markdown(results: Sequence[FamilyResult]) -> str:
    """The census as docs/architectures.md shows it: a count line and one table row per family."""
    summary = ", ".join(f"{n} {v}" for v, n in counts(results).items())
    rows = [f"transformers {transformers.__version__}, {len(results)} families: {summary}.", ""]
    rows += ["| family (`model_type`) | outcome | why, or how it is served |", "|---|---|---|"]
    for r in results:
        detail = r.detail.replace("|", "\\|")
        rows.append(f"| `{r.family}` | {r.verdict}{'' if r.dtype in ('', 'float64') else f' ({r.dtype})'} | {detail} |")
    return "\n".join(rows)
