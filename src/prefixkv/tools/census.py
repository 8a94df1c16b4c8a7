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
  (:attr:`prefixkv.base.stats.CacheStats.not_cached`);
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

from .. import models
from ..base.errors import UnsupportedModelError, refuses_float64
from ..compat.releases import GENERATE_CACHE_KWARG
from ..hf import kinds
from ..hf.cache import PagedPrefixCache
from ..hf.support import REFUSAL_ADVICE
from ..store.prefix_store import PrefixStore

VERDICTS = ("exact", "exact, no reuse", "refused", "n/a", "slow", "wrong", "crash", "silent miss")
DEFECTS = frozenset({"wrong", "crash", "silent miss"})
"""The verdicts that are prefixkv's defects: the census test fails on any of them."""

SHARED = 45  # prompt tokens the warm call, the beams and the padded batch share with the cold call
BLOCK_SIZE = 4  # a match ends inside a block: 44 tokens shared as whole blocks, 1 copied
MAX_PARAMETERS = 20_000_000  # a family whose tiny config still builds more is reported n/a, not built
_BOUND = {torch.float64: 1e-6, torch.float32: 1e-4}
# every call passes use_cache=True, as a user who wants a cache does (MPT's config turns it off by default)
_GENERATE = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True, use_cache=True)


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
    """The census's tiny config of ``model_type``: :func:`prefixkv.models.tiny_config`, which builds every causal-LM
    family of the installed transformers from its own config class. Raises what the config class raises."""
    return models.tiny_config(model_type)


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
            if dtype == torch.float64 and refuses_float64(e):
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
    if kinds.stateful(store.layer_kinds):
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
    if kinds.stateful(store.layer_kinds):
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
    from ..attention import interface

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
    """One census line as text: the family, the verdict, the dtype it was checked in (float32 where the family's
    kernels refuse float64; ``-`` where nothing ran), and the detail."""
    return f"{result.family:28} {result.verdict:15} {result.dtype or '-':8} {result.detail}"


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
