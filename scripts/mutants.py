"""Mutation check: does the test suite notice a realistic bug? (tests/README.md, "Mutants")

Each mutation replaces one exact text of ``src/prefixkv`` (it must occur exactly once) in a copy of ``src/`` made in a
temporary directory, then runs the test files that should catch it there (``pytest -x -q`` with ``PYTHONPATH``
pointing at the copy, one thread). A mutation is *caught* when those tests fail, *survived* when they pass. The working
tree is never modified.

    python scripts/mutants.py              # every mutation, then a summary
    python scripts/mutants.py --list       # the mutations, their files and tests
    python scripts/mutants.py --only NAME  # one mutation (repeat --only for several)

Exits 1 when a mutation survived or its original text was not found exactly once (the source moved on: update the
text here), 0 when every mutation run was caught. Too slow for .ci/run (minutes); run it before a release and after
changing the code a mutation names."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    """Replace ``old`` (found exactly once in ``src/prefixkv/<file>``) by ``new``; ``tests`` should then fail."""

    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str


MUTATIONS = [
    # -- the five bugs of issue 32, which the suite once let through
    Mutation(
        "rows-reuse-floored-to-block",
        "hf/resume.py",
        "choose = Offset(pads, caps, chunk, plan)",
        "choose = Offset(pads, caps, chunk and blocks.block_size, plan)",
        ("tests/test_invariance.py::test_a_match_that_ends_inside_a_chunk_reuses_only_whole_chunks",),
        "an invariant store reuses a match that ends inside a chunk up to its block: not the canonical schedule",
    ),
    Mutation(
        "many-lone-prefill-without-namespace",
        "many/scheduler.py",
        "self.store.warm([prompt[:shared]], progress=False, namespace=self.namespace)",
        "self.store.warm([prompt[:shared]], progress=False)",
        ("tests/test_many.py::test_refilling_keeps_a_users_prefixes_in_its_namespace",),
        "refill's lone shared-prefix prefill is published in the shared namespace, not the caller's",
    ),
    Mutation(
        "tier-identity-without-chunk-size",
        "store/files.py",
        "meta = file_meta(settings, specs, model, model_print, BLOCK_FORMAT)",
        "meta = persist.store_meta(settings, specs, model, model_print, BLOCK_FORMAT)",
        ("tests/test_tier.py::test_a_disk_tier_of_another_store_is_not_read",),
        "a disk tier written in one prefill schedule is restored by a store of another",
    ),
    Mutation(
        "flex-full-one-column-early-at-window-edge",
        "attention/flex_kernel.py",
        "full &= start > last[..., None] - window",
        "full &= start >= last[..., None] - window",
        ("tests/test_flex.py::test_compiled_decode_where_a_sliding_windows_edge_falls_on_a_block_start",),
        "a block whose first column is just outside a sliding window is marked full (its mask skipped)",
    ),
    Mutation(
        "trie-priority-lowest-retain",
        "kv/eviction.py",
        "return max(retains) if retains else DEFAULT_PRIORITY",
        "return min(retains) if retains else DEFAULT_PRIORITY",
        ("tests/test_trie.py::test_nested_retains_keep_the_highest_priority_on_their_common_path",),
        "a prefix pinned high under one pinned low is evicted at the low priority",
    ),
    # -- the proof, the claim contract, namespaces, eviction, generate_many and the id checks
    Mutation(
        "proof-use-cache-false-proven",
        "hf/proof.py",
        '    if forward.use_cache is False:\n        return "use_cache=False"',
        '    if forward.use_cache is False and forward.decode_step:\n        return "use_cache=False"',
        ("tests/test_proof.py", "tests/test_never_wrong.py"),
        "a forward with use_cache=False (which re-feeds the sequence) is taken as proven",
    ),
    Mutation(
        "claim-locks-where-the-match-ends",
        "kv/manager.py",
        "claim.node = self.holdings.lock_end(row[: r // bs * bs], space)",
        "claim.node = self.holdings.lock_end(row[: m.length], space)",
        ("tests/test_edges.py", "tests/test_store_contract.py"),
        "a claim locks the node where the match ends, not where its reused whole blocks end (issue 32, #2)",
    ),
    Mutation(
        "namespace-roots-kept-forever",
        "kv/trie.py",
        "            self._roots.emptied(parent)",
        "            pass",
        ("tests/test_namespaces.py",),
        "an emptied namespace's root is never dropped: memory grows with the number of users (issue 32, #5)",
    ),
    Mutation(
        "trie-lookup-makes-a-root",
        "kv/trie.py",
        "root = self._roots.find(space)",
        "root = self._roots.get(space)",
        (
            "tests/test_trie.py::test_a_namespace_per_request_leaves_nothing_once_its_prefixes_are_gone",
            "tests/test_namespaces.py::test_looking_up_a_namespace_leaves_no_trace",
        ),
        "a lookup in a namespace that holds nothing makes its root, kept forever (issue 43, review #5)",
    ),
    Mutation(
        "namespace-root-tables-never-shrink",
        "kv/nodes.py",
        "if every or 4 * len(self._roots) < self._high:",
        "if False:",
        ("tests/test_trie.py::test_a_namespace_per_request_leaves_nothing_once_its_prefixes_are_gone",),
        "the tables of the namespaces' roots keep the size of their peak after clear() (issue 43, review #5)",
    ),
    Mutation(
        "tier-file-tensors-unchecked",
        "kv/tier.py",
        "why = None if self._check is None else self._check(tensors)",
        "why = None",
        ("tests/test_tier.py::test_a_block_file_with_a_right_checksum_but_wrong_tensors_is_dropped_and_recomputed",),
        "a tier file with a right checksum but a wider K, a missing V or NaN is served (issue 43, review #6)",
    ),
    Mutation(
        "scheduler-cached-of-the-last-call",
        "many/scheduler.py",
        "            if row.cached is None:\n                row.cached = cached[j]",
        "            row.cached = cached[j]",
        ("tests/test_many.py::test_refilling_rows_equal_their_own_calls",),
        "a row carried on into later calls reports the cached tokens of its last call, its own new ones included",
    ),
    Mutation(
        "eviction-overflow-before-priority",
        "kv/eviction.py",
        "(hot[0], not overflow) < (cold[0], True)",
        "(overflow or hot[0] < cold[0])",
        ("tests/test_trie.py::test_priorities_come_before_the_protected_share",),
        "under overflow of the protected share a protected leaf goes first whatever the priorities",
    ),
    Mutation(
        "eviction-share-of-what-is-left",
        "kv/eviction.py",
        "self.protected_occurrences > self.protected_share * self.peak",
        "self.protected_occurrences > self.protected_share * self.occurrences",
        ("tests/test_trie.py::test_the_protected_share_is_of_the_most_held_not_of_what_is_left",),
        "the protected share is taken of what is held now: a reused prefix goes while a one-off stays",
    ),
    Mutation(
        "weights-state-without-version",
        "kv/key_space.py",
        "else (t.data_ptr(), version))",
        "else (t.data_ptr(), 0))",
        ("tests/test_edges.py::test_a_weight_edited_in_part_in_place_starts_a_new_namespace",),
        "an in-place edit of part of a weight (w[1, 1] += 0.5) goes unseen: stale K/V reused",
    ),
    Mutation(
        "options-offload-dir-alone-no-tier",
        "store/options.py",
        '    if offload_dir is not None:\n        return "disk"',
        "    if offload_dir is not None:\n        return None",
        ("tests/test_tier.py::test_offload_dir_alone_keeps_evicted_blocks_on_disk",),
        "offload_dir= without offload= is taken and the store has no second tier: 0 files written",
    ),
    Mutation(
        "reader-ignores-the-stores-backend",
        "attention/reader.py",
        "registry.build(settings.backend, settings.block_size)",
        'registry.build("blocks", settings.block_size)',
        ("tests/test_backend_choice.py::test_the_backend_the_store_names_is_the_one_that_runs",),
        "each cache decides its backend again: an invariant or 8-bit store says 'gather' and reads the blocks in place",
    ),
    Mutation(
        "whole-rows-index-kept-across-changed-tables",
        "attention/reader.py",
        "t[: len(old)] != old for t, old in zip(tables, self._tables)",
        "len(t) < len(old) for t, old in zip(tables, self._tables)",
        ("tests/test_generate_core.py::test_the_whole_row_index_is_the_slot_table_of_every_layout_it_is_given",),
        "a row whose block was replaced (a copy on write) keeps reading the old block's slots",
    ),
    Mutation(
        "whole-rows-index-fills-the-step-one-column-late",
        "attention/reader.py",
        "            index[:, filled:columns] = new\n",
        "            index[:, filled + 1 : columns + 1] = new\n",
        ("tests/test_generate_core.py",),
        "a decode step's own slot lands one column past where the read looks: it reads the null block",
    ),
    Mutation(
        "lone-fold-past-the-fold-limit",
        "attention/planner.py",
        "    if held <= 0 or held > _FOLD_TOKENS:\n",
        "    if held <= 0:\n",
        ("tests/test_blocks_attention.py::test_a_lone_fold_is_exactly_a_step_the_planner_reads_in_one_gather",),
        "a long lone row read in place by views is copied out whole at every step instead",
    ),
    Mutation(
        "reader-keeps-the-plan-past-the-forward",
        "hf/forward.py",
        "        self._reader.end()\n",
        "",
        ("tests/test_generate_core.py",),
        "an idle cache keeps its last step's read plan, and with it the pool's tensors of before a growth",
    ),
    Mutation(
        "kv-slots-kept-across-a-growth",
        "kv/pool.py",
        "    pool.kv_slots = _kv_slots(pool._views)\n",
        "",
        (
            "tests/test_slots.py",
            "tests/test_compiled.py::test_a_compiled_step_after_a_growth_holds_the_new_pool_and_gives_eagers_tokens",
        ),
        "a step's plan takes the slot views of the pool before its growth: the step writes and reads the old tensors",
    ),
    Mutation(
        "refcounts-read-from-a-copy",
        "kv/allocator.py",
        "self.refcount: Callable[[int], int] = self._refcount.__getitem__",
        "self.refcount: Callable[[int], int] = list(self._refcount).__getitem__",
        ("tests/test_allocator.py", "tests/test_generate_core.py"),
        "the copy-on-write check reads the refcounts of the allocator's start: a row writes into a block others hold",
    ),
    Mutation(
        "flex-failure-refuses-every-block-size",
        "attention/flex_kernel.py",
        "    failed = _failed.get((kind, dtype, block_size))",
        "    failed = next((why for (d, t, _), why in _failed.items() if (d, t) == (kind, dtype)), None)",
        ("tests/test_flex.py::test_a_compile_failure_raises_and_is_then_refused",),
        "one block size that FlexAttention's kernel cannot tile (blocks of 16 on an H100) turns flex off at every size",
    ),
    Mutation(
        "eviction-newest-first",
        "kv/eviction.py",
        "heapq.heappush(queue, (self.priority(node), node.last_access, next(self._tiebreak), node))",
        "heapq.heappush(queue, (self.priority(node), -node.last_access, next(self._tiebreak), node))",
        ("tests/test_trie.py", "tests/test_store_stateful.py"),
        "eviction takes the most recently used leaf first",
    ),
    Mutation(
        "extend-last-writer-copies-too",
        "kv/manager.py",
        "taking_over = {ids[-1] for block, ids in writers.items() if rc(block) == len(ids)}",
        "taking_over: set[int] = set()",
        ("tests/test_store_contract.py",),
        "extend copies a shared part-block for its last writer too, which could write in place (a block wasted)",
    ),
    Mutation(
        "many-invariant-plan-follows-pins",
        "many/batches.py",
        "return store.max_blocks // 2 if store.invariant else (store.max_blocks - store.stats.blocks_pinned) // 2",
        "return (store.max_blocks - store.stats.blocks_pinned) // 2",
        ("tests/test_many.py", "tests/test_many_arguments.py"),
        "an invariant store's generate_many batches are sized by what is pinned (issue 32, #1)",
    ),
    Mutation(
        "many-pad-inside-a-prompt-attended",
        "many/generation.py",
        "return [1] * len(prompt) if inferred is None else inferred[0].long().tolist()",
        "return [1] * len(prompt)",
        ("tests/test_many.py", "tests/test_many_arguments.py"),
        "generate_many attends a pad token inside a prompt, which generate masks (issue 32, #7)",
    ),
    Mutation(
        "ids-floats-truncated",
        "base/tokens.py",
        "value = operator.index(t)  # ints of any kind (numpy's too); never a float truncated",
        "value = int(t)",
        ("tests/test_many_arguments.py", "tests/test_score.py", "tests/test_errors.py"),
        "float token ids are truncated instead of refused (issue 32, #3, #4)",
    ),
    # -- found in review (issue 34): the fingerprint read the PEFT wrapper, which always says "disabled"
    Mutation(
        "fingerprint-adapters-always-disabled",
        "kv/fingerprint.py",
        'json.dumps({"active": list(active), "disabled": disabled, "merged": list(merged)})',
        'json.dumps({"active": list(active), "disabled": True, "merged": list(merged)})',
        ("tests/test_never_wrong.py::test_a_file_saved_with_the_adapters_disabled_does_not_load_with_them_enabled",),
        "a file saved with the adapters disabled loads where they are enabled: its K/V give wrong output",
    ),
    # -- found in review (issue 36): compiled steps were tested on llama alone
    Mutation(
        "compiled-steps-prove-the-4d-masks",
        "hf/hooks.py",
        "        cache.forward.built_masks = (mask, built)\n",
        "        cache.forward.built_masks = None\n",
        ("tests/test_compiled.py::test_every_family_takes_compiled_steps_or_says_why",),
        "a compileable cache on a model with sliding or per-kind layers publishes nothing: no reuse, silently",
    ),
    Mutation(
        "compiled-steps-on-a-models-own-attention",
        "hf/forward.py",
        "    if not interface.serves(store.hf_model) and not hybrid_sdpa:\n",
        "    if False:\n",
        ("tests/test_compiled.py::test_every_family_takes_compiled_steps_or_says_why",),
        "Falcon-RW and Bloom take compiled steps their own attention cannot read: errors on ALiBi and padding",
    ),
    Mutation(
        "compiled-steps-prove-a-stale-mask",
        "hf/hooks.py",
        '        if built is not None and inputs.get("attention_mask") is built:\n',
        "        if built is not None:\n",
        ("tests/test_compiled.py::test_the_proof_reads_generates_2d_mask_only_for_the_masks_built_from_it",),
        "a prepare whose forward never came leaves its 2-D mask, and the next forward is proven with it, not its own",
    ),
    # -- issue 36: a default cache's steps are compiled steps in, and only in, a call generate compiles
    Mutation(
        "compiled-steps-not-told-of-the-compile",
        "hf/hooks.py",
        "        note_generate_compile(self, model_kwargs, bool(compiled))\n",
        "        note_generate_compile(self, model_kwargs, False)\n",
        ("tests/test_compiled.py::test_by_default_generate_compiles_the_steps_and_an_eager_call_reads_as_before",),
        "generate compiles a default cache's forwards with the eager read plan: graph breaks at every layer",
    ),
    Mutation(
        "compiled-steps-in-eager-calls",
        "hf/forward.py",
        "self._takes = self.asked is True or self._compiled_call is True or patching.compiled_forward(model)",
        "self._takes = True",
        ("tests/test_compiled.py::test_by_default_generate_compiles_the_steps_and_an_eager_call_reads_as_before",),
        "every eager decode step gathers a bucket of columns per row: the blocks reader's shared-prefix read is lost",
    ),
    Mutation(
        "compiled-steps-outlive-their-call",
        "hf/forward.py",
        "        if not self._compile_noted:\n            self._compiled_call = False\n",
        "",
        ("tests/test_compiled.py::test_by_default_generate_compiles_the_steps_and_an_eager_call_reads_as_before",),
        "a beam search after a compiled call on the same cache takes compiled steps and generate's masks, eagerly",
    ),
    Mutation(
        "compiled-steps-not-in-a-users-compiled-forward",
        "hf/forward.py",
        " or patching.compiled_forward(model)\n",
        "\n",
        ("tests/test_compiled.py::test_a_forward_compiled_by_its_user_takes_compiled_steps_with_a_default_cache",),
        "torch.compile(model.forward) with a default cache runs the eager read in pieces: graph breaks at every layer",
    ),
    # -- found in review (issue 36's round): a release after eviction left the parent with a stale queue entry
    Mutation(
        "release-offers-only-the-dead-node",
        "kv/eviction.py",
        "        while live is not None and not live.alive:\n            live = live.parent\n",
        "",
        ("tests/test_trie.py::test_releasing_a_node_evicted_while_retained_leaves_its_parent_evictable",),
        "a leaf whose retained child was evicted and then released is never evicted: a CapacityError with room left",
    ),
    Mutation(
        "compiled-steps-never-after-an-eager-call",
        "hf/hooks.py",
        "        note_generate_compile(self, model_kwargs, None)\n",
        "",
        ("tests/test_compiled.py::test_by_default_generate_compiles_the_steps_and_an_eager_call_reads_as_before",),
        "a cache that had an eager call says it is not compileable to the next call's choice: never compiled again",
    ),
    # -- issue 43: TRL at its own defaults, and the inputs no test varied
    Mutation(
        "trl-router-jitter-not-random",
        "integrations/trl.py",
        '_RANDOM_WORDS = ("drop", "jitter")',
        '_RANDOM_WORDS = ("drop",)',
        ("tests/test_integrations.py::test_trl_generates_as_trl_does_where_training_mode_is_random",),
        "a Mixtral with router_jitter_noise generates under TRL as the eval-mode model: one logit set for every seed",
    ),
    Mutation(
        "trl-modes-restored-only-on-return",
        "integrations/trl.py",
        "    try:\n        with _mixed_precision(model):\n            return original(*args, **kwargs)\n    finally:\n"
        "        for module, mode in modes:\n            module.training = mode\n",
        "    with _mixed_precision(model):\n        out = original(*args, **kwargs)\n"
        "    for module, mode in modes:\n        module.training = mode\n    return out\n",
        ("tests/test_integrations.py::test_trl_restores_every_module_mode_when_generate_raises",),
        "after a CapacityError inside TRL's generate every module stays in eval mode: training goes on without dropout",
    ),
    Mutation(
        "autocast-not-in-the-namespace",
        "kv/key_space.py",
        "        if autocast is not None:  # inside WeightsChanged",
        "        if False:  # inside WeightsChanged",
        ("tests/test_autocast.py",),
        "K/V computed under autocast are served to calls without it and the other way round",
    ),
    Mutation(
        "shared-prefill-in-training-mode",
        "hf/runner.py",
        "    if store.hf_model.training:\n        return []",
        "    if False:\n        return []",
        ("tests/test_enable.py::test_a_cache_in_training_mode_runs_no_forward_of_its_own",),
        "a cache on a model in training mode runs a forward of its own first, drawing from dropout's random stream",
    ),
    # -- issue 43, finding 9: generate_many's processors that read the prompt
    Mutation(
        "refill-reads-a-carried-rows-tokens-as-its-prompt",
        "many/scheduler.py",
        "            sources=[r.prompt for r in rows],\n",
        "            sources=prompts,\n",
        ("tests/test_many_arguments.py::test_processors_that_read_the_prompt_read_each_rows_own",),
        "encoder_no_repeat_ngram_size bans a carried-on row's own new tokens: other tokens than its own call",
    ),
    Mutation(
        "encoder-penalty-reads-the-batchs-padding",
        "many/generation.py",
        "s + s[:1] * (width - len(s))",
        "[0] * (width - len(s)) + s",
        ("tests/test_many_arguments.py::test_processors_that_read_the_prompt_read_each_rows_own",),
        "encoder_repetition_penalty favours token 0 in a row shorter than its batch: other scores than its own call",
    ),
    Mutation(
        "forced-bos-beside-longer-prompts-accepted",
        "many/generation.py",
        "    refused = prompts_refusal(model, generate_kwargs, rows)\n",
        "    refused = None\n",
        (
            "tests/test_many_arguments.py::test_a_forced_first_token_is_refused_for_a_one_token_prompt_among_longer_ones",
        ),
        "forced_bos_token_id: a one-token prompt padded beside longer ones is not forced, where its own call is",
    ),
    Mutation(
        "refill-carries-a-prompt-ending-in-the-pad-token",
        "many/generation.py",
        "    refusal = refill_refusal(model, generate_kwargs, store) or _carry_refusal(",
        "    refusal = refill_refusal(model, generate_kwargs, store) or None and _carry_refusal(",
        ("tests/test_many_arguments.py::test_a_prompt_ending_in_the_pad_token_is_not_carried_on",),
        "a row after a trailing masked pad token is carried on with other positions than its own call: 2.9e-3 off",
    ),
    # -- issue 43, finding 11: the cache= alias of transformers 4.57-5.23
    Mutation(
        "alias-takes-cache-none-for-a-cache",
        "compat/releases.py",
        'if kwargs.get("cache") is not None and "cache" not in',
        'if "cache" in kwargs and "cache" not in',
        ("tests/test_compat.py::test_the_cache_alias_renames_only_what_would_fail",),
        "generate(cache=None, past_key_values=DynamicCache(...)) raises 'got a cache twice' where stock runs it",
    ),
    # -- issue 43: the compiled step and torch.compile
    Mutation(
        "compiled-step-writes-lost-in-a-growth",
        "hf/forward.py",
        "            step.carry_over(blocks.pool)\n",
        "            pass\n",
        ("tests/test_compiled.py::test_a_step_carries_its_writes_over_a_growth_of_the_pool",),
        "a growth of the pool during a compiled step (another thread's request) loses the step's K/V: wrong logits",
    ),
    Mutation(
        "compiled-step-writes-join-autograd",
        "attention/static.py",
        "        k.index_copy_(1, self.slots, key.detach().transpose(0, 1)",
        "        k.index_copy_(1, self.slots, key.transpose(0, 1)",
        ("tests/test_compiled.py::test_a_step_with_gradients_on_keeps_the_pool_out_of_autograd",),
        "the shared pool joins a request's autograd graph: another request's backward runs through it, and fails",
    ),
    Mutation(
        "compiled-steps-not-compileable-when-eager",
        "hf/forward.py",
        "(self._compiled_call is not False or self.takes_steps())",
        "(self.asked is True or self._compiled_call is not False)",
        ("tests/test_compiled.py::test_a_compiled_forward_run_eagerly_by_torch_gets_the_mask_of_its_steps",),
        "a compiled forward that torch runs eagerly takes bucket-wide steps without a mask: wrong K/V published",
    ),
    Mutation(
        "stock-calls-through-paged-attention",
        "attention/interface.py",
        " or getattr(key, reads.TAG, None) is None:",
        ":",
        ("tests/test_compiled.py::test_a_store_leaves_stock_compiled_calls_alone",),
        "with a store on a model, a stock StaticCache call breaks the graph at every layer, and fullgraph refuses it",
    ),
    Mutation(
        "paged-forwards-in-generates-compiled-call",
        "hf/hooks.py",
        "            return (plain if runs_eagerly(self, k) else compiled)(*a, **k)\n",
        "            return compiled(*a, **k)\n",
        ("tests/test_compiled.py::test_generates_fullgraph_compile_runs_only_the_steps_compiled",),
        "a fullgraph compile with prefill_chunk_size= or assistant_model= raises Unsupported at the first chunk",
    ),
    Mutation(
        "paged-forwards-in-model-compile",
        "hf/hooks.py",
        "        _StepsOnly.wrap(model)\n",
        "        pass\n",
        ("tests/test_compiled.py::test_a_compiled_model_call_compiles_only_the_steps",),
        "after a store, model.compile() traces prefixkv's Python at every layer: graph breaks and a spent recompile "
        "budget on transformers' shared decorators",
    ),
    # -- issue 43: what the layers hand a cache, measured (hf/shapes.py)
    Mutation(
        "shapes-from-the-config",
        "store/prefix_store.py",
        "measured = shapes.measure(self.hf_model, layer_shapes(model.config), devices[0], self.layer_kinds)",
        "measured = layer_shapes(model.config)",
        ("tests/test_family_defects.py::test_a_config_that_misnames_the_heads_is_served_from_the_tensors",),
        "the pool sized from config fields the layers do not use: a store that crashes on its own model",
    ),
    Mutation(
        "shapes-columns-unchecked",
        "hf/shapes.py",
        "    if columns != [fed]:",
        "    if False:",
        ("tests/test_family_defects.py::test_caches_that_are_not_one_column_per_id_are_refused",),
        "a model whose cache columns are not one per id (learned prompt tokens, sliced ids) crashes mid-generate",
    ),
    Mutation(
        "shapes-probe-draws-randomness",
        "hf/shapes.py",
        "with eval_mode(model), vision.rope_deltas_aside(model), "
        "torch.random.fork_rng(devices=devices), torch.no_grad():\n"
        "        for n in fed:",
        "with vision.rope_deltas_aside(model), torch.no_grad():\n        for n in fed:",
        ("tests/test_family_defects.py::test_the_measuring_forwards_leave_the_random_state_alone",),
        "the measuring forwards run in the model's mode with the random stream as it is: a store built on a model in "
        "training mode moves the stream (other samples than stock) and LayerDrop skips the layers it measures",
    ),
    Mutation(
        "probe-kv-operations-unnoted",
        "attention/reads.py",
        "                    where[0].touched.add(where[1])",
        "                    pass",
        ("tests/test_family_defects.py::test_a_model_that_computes_from_the_handed_out_kv_gets_whole_rows",),
        "a model that computes its mask from the V update hands out (Doge) is read in place: a crash warm",
    ),
    Mutation(
        "whole-rows-not-contiguous",
        "hf/forward.py",
        "        keys, values = keys.contiguous(), values.contiguous()",
        "        pass",
        ("tests/test_family_defects.py::test_a_model_that_views_the_rows_update_returns_is_exact_with_beams",),
        "a model's own attention that .views the rows (gpt_neox_japanese) crashes on a batch",
    ),
    Mutation(
        "padded-reuse-of-column-positions",
        "hf/call.py",
        "        if why is None and padded is not None and any(row.pad for row in held):",
        "        if False:",
        (
            "tests/test_family_defects.py::"
            "test_a_model_that_counts_positions_in_columns_reuses_nothing_for_a_padded_batch",
        ),
        "a padded row of a model that counts positions in columns (TrOCR) reuses unpadded K/V: wrong logits",
    ),
    Mutation(
        "padded-batch-of-a-pad-attending-model",
        "hf/call.py",
        "        if padded is not None and padded[1] and any(row.pad for row in held):",
        "        if False:",
        ("tests/test_family_defects.py::test_a_model_that_attends_cached_pad_columns_refuses_a_padded_batch",),
        "a padded batch of a model that attends cached pad columns (GIT) is served with zeros for pads: wrong",
    ),
    Mutation(
        "padded-check-under-dropout",
        "hf/shapes.py",
        "    with eval_mode(model), vision.rope_deltas_aside(model), "
        "torch.random.fork_rng(devices=devices), torch.no_grad():\n"
        "        _PADDED[model]",
        "    with vision.rope_deltas_aside(model), torch.random.fork_rng(devices=devices), torch.no_grad():\n"
        "        _PADDED[model]",
        (
            "tests/test_family_defects.py::"
            "test_a_model_in_training_mode_is_measured_without_dropout_and_keeps_its_modes",
            "tests/test_family_defects.py::test_a_model_in_training_mode_is_refused_what_it_is_refused_in_eval_mode",
        ),
        "a store built on a model in training mode measures padded reuse under dropout, whose noise swallows the "
        "difference of a model that counts positions in columns",
    ),
    Mutation(
        "slots-past-the-blocks-of-a-few-columns",
        "base/slots.py",
        "if 0 <= c - pad < end else 0",
        "if 0 <= c - pad else 0",
        ("tests/test_slots.py::test_the_slot_table_is_the_naive_one_per_column",),
        "a decode step's few columns past a row's blocks read another row's block instead of the null block",
    ),
    Mutation(
        "slots-past-the-blocks-of-many-columns",
        "base/slots.py",
        "valid = (t >= 0) & (t < held)",
        "valid = t >= 0",
        ("tests/test_slots.py::test_the_slot_table_is_the_naive_one_per_column",),
        "a compiled step's table maps the columns past a row's blocks to its last block, not the null block",
    ),
    Mutation(
        "compat-alias-not-recorded",
        "compat/releases.py",
        'install(_generation.GenerationMixin, "generate", _taking_cache(_generation.GenerationMixin.generate))',
        "_generation.GenerationMixin.generate = _taking_cache(_generation.GenerationMixin.generate)",
        ("tests/test_compat.py::test_only_patching_changes_transformers_and_torch_objects",),
        "the cache= alias changes transformers' GenerationMixin with no record: nothing can undo it",
    ),
    Mutation(
        "compat-range-not-pyprojects",
        "compat/releases.py",
        "TRANSFORMERS_RANGE = ((4, 57), (6, 0))",
        "TRANSFORMERS_RANGE = ((4, 57), (7, 0))",
        ("tests/test_compat.py::test_the_ranges_checked_at_import_are_the_ones_pyproject_declares",),
        "the import check lets in a transformers that pyproject.toml (what pip installs) excludes",
    ),
    Mutation(
        "attention-registered-unrecorded",
        "attention/interface.py",
        "register(AttentionInterface, NAME, prefixkv_attention_forward)",
        "AttentionInterface.register(NAME, prefixkv_attention_forward)",
        ("tests/test_compat.py::test_only_patching_changes_transformers_and_torch_objects",),
        "prefixkv's attention enters transformers' registry with no record: nothing can take it out again",
    ),
    # -- tensor parallelism (issue 47): torchrun with 2 processes on CPU, about a minute each
    Mutation(
        "tp-weights-state-of-the-whole-dtensor",
        "kv/key_space.py",
        "                t = local_part(t)\n",
        "",
        ("tests/test_tensor_parallel.py",),
        "the key space samples a split weight as a DTensor: 'as_strided not supported with DTensor'",
    ),
    Mutation(
        "tp-budget-not-agreed",
        "store/parallel.py",
        "    return least if bounded else None",
        "    return max_blocks",
        ("tests/test_tensor_parallel.py",),
        "each process keeps the budget it was given: one evicts where the other does not, and their stores part",
    ),
    Mutation(
        "tp-file-of-another-rank",
        "store/files.py",
        "    _check_ranks(file, path, model)\n",
        "",
        ("tests/test_tensor_parallel.py::test_a_file_of_another_rank_is_refused_with_the_reason",),
        "a file of another rank is refused only as 'another model', without saying to load each rank's own",
    ),
    # -- issue 45: latent attention and mixed shapes, K and V kept per layer at their own shapes
    Mutation(
        "v-stored-with-k-shape",
        "kv/pool.py",
        "    return LayerSpec(*key, device, dtype, *value, extra=tuple(extra))\n",
        "    return LayerSpec(*key, device, dtype, extra=tuple(extra))\n",
        ("tests/test_latent.py::test_each_layer_keeps_the_shapes_it_hands_over",),
        "V is kept at K's heads and size: MLA's rotary key and MiMo's narrower V do not fit their pool",
    ),
    Mutation(
        "layer-spec-from-layer-0",
        "store/prefix_store.py",
        "kinds.of(self.layer_kinds, i).spec(s, d, self.dtype) for",
        "kinds.of(self.layer_kinds, i).spec(measured[0], d, self.dtype) for",
        ("tests/test_family_defects.py::test_layers_of_different_shapes_are_served",),
        "every layer's pool is shaped as layer 0's: a layer of other heads or size does not fit it",
    ),
    Mutation(
        "shared-kv-query-read-in-place",
        "attention/interface.py",
        "            if query.shape[-2] == key.shape[-2] and backend.servable(forward, call):",
        "            if backend.servable(forward, call):",
        ("tests/test_latent.py::test_cold_then_warm",),
        "Gemma 4's KV-shared layers, attending a prompt's last position, read the blocks by a plan of every column",
    ),
    Mutation(
        "switch-back-one-name",
        "attention/interface.py",
        "    model.set_attn_implementation(before if isinstance(before, dict) else _base(model.config))",
        "    model.set_attn_implementation(_base(model.config))",
        ("tests/test_latent.py::test_towers_on_other_attention_are_switched_back",),
        "a store's close sets every sub-model to the text model's sdpa: Gemma 4's eager-only audio tower raises",
    ),
    # -- the families of issue 45 with a cache of their own kind (tests/test_oddballs.py)
    Mutation(
        "oddball-refusals-generic",
        "hf/support.py",
        "    own = _cache_of_its_own(model, text)\n",
        "    own = None\n",
        ("tests/test_oddballs.py",),
        "RWKV, MiniMax, DeepSeek-V4, sparse attention refused with a generic reason, not what their cache holds",
    ),
    Mutation(
        "later-tokens-any-change",
        "hf/support.py",
        "return bool(earlier.max() > share * last.max())",
        "return bool(earlier.max() > 0)",
        (
            "tests/test_oddballs.py::test_dbrx_is_served_exactly",
            "tests/test_oddballs.py::test_encoders_and_experts_are_told_apart",
        ),
        "any change of an earlier row counts as attention to later tokens: DBRX's experts' rounding (4e-16) refuses it",
    ),
    Mutation(
        "later-tokens-float64-share-of-float32",
        "hf/support.py",
        "{torch.float64: 1e-9, None: 1e-4}",
        "{torch.float64: 1e-4, None: 1e-4}",
        ("tests/test_oddballs.py::test_a_small_leak_of_later_tokens_counts_in_float64",),
        "a float64 model whose earlier rows see a later token by 1e-5 of its move is served: warm logits 1e-5 off",
    ),
    # -- recurrent layers' state snapshots (issue 45)
    Mutation(
        "states-snapshot-one-token-late",
        "hf/resume.py",
        "states.take(held.states, 0, end), junction=junction",
        "states.take(held.states, 0, end - 1), junction=junction",
        ("tests/test_recurrent.py::test_cold_warm_beams_and_a_padded_batch_match_stock",),
        "the runner's snapshot holds the states after one more token than its position says",
    ),
    Mutation(
        "states-snapshot-of-another-prefix",
        "hf/states.py",
        "found = self._held.get((space, tuple(keys[:p])))",
        "found = next((v for (sp, path), v in self._held.items() if sp == space and len(path) == p), None)",
        ("tests/test_recurrent.py::test_a_snapshot_is_never_used_for_another_prefix_or_namespace",),
        "a snapshot is looked up by its position alone, so a prompt resumes from another prefix's states",
    ),
    Mutation(
        "states-padded-rows-always-reuse",
        "hf/shapes.py",
        "_PADDED[model] = _padded_states(model, text, name, device)",
        "_PADDED[model] = None",
        ("tests/test_recurrent.py::test_padded_rows_reuse_nothing_where_pads_reach_the_state",),
        "left-padded rows resume their unpadded prefix's state in a model whose pads reach the state",
    ),
    # -- the snapshots' defects of issue 52 (the first two were bugs; the others, injected bugs no test caught)
    Mutation(
        "snapshots-outlive-evicted-paths",
        "store/prefix_store.py",
        "self.blocks.holdings.trie.watchers.append(",
        "list().append(",
        ("tests/test_recurrent.py::test_snapshots_go_with_their_paths_in_every_namespace_and_weight_version",),
        "the trie evicts a path's K/V without telling the snapshots: they outlive it, in every namespace",
    ),
    Mutation(
        "snapshots-add-walks-every-path",
        "hf/resume.py",
        "    snapshots.add(held.space, row.keys, states.take(held.states, 0, end), junction=junction)",
        "    [held.blocks.cached_length(list(p), s) for s, p in list(snapshots._held)]\n"
        "    snapshots.add(held.space, row.keys, states.take(held.states, 0, end), junction=junction)",
        ("tests/test_recurrent.py::test_adding_a_snapshot_costs_the_same_however_many_are_held",),
        "each snapshot added walks every snapshot's path (the old drop check): quadratic in the snapshots held",
    ),
    Mutation(
        "snapshots-budget-drops-the-newest",
        "hf/states.py",
        'self._drop(next(iter(order)), "budget")',
        'self._drop(next(reversed(order)), "budget")',
        (
            "tests/test_recurrent.py::test_a_tight_snapshot_budget_drops_the_oldest_never_the_newest",
            "tests/test_differential.py::test_the_snapshot_budget_drops_the_least_recently_used_first",
        ),
        "past the snapshots' budget the newest snapshot goes first: the last prompt asked again reuses nothing",
    ),
    Mutation(
        "snapshots-pool-sized-from-all-of-max-memory",
        "store/prefix_store.py",
        "kv_memory = max_memory if max_memory is None or spare is None else parse_bytes(max_memory) - spare",
        "kv_memory = max_memory",
        ("tests/test_recurrent.py::test_the_pool_and_the_snapshots_together_stay_within_max_memory",),
        "a recurrent model's pool takes all of max_memory and the snapshots' share comes on top",
    ),
    Mutation(
        "snapshots-bytes-counted-in-elements",
        "hf/states.py",
        "return sum(t.numel() * t.element_size() for t in self.tensors.values())",
        "return sum(t.numel() for t in self.tensors.values())",
        ("tests/test_recurrent.py::test_snapshot_bytes_are_counted_in_bytes",),
        "a snapshot's bytes are counted in elements: an 8x overrun of the budget in float64",
    ),
    Mutation(
        "snapshots-split-prefill-without-namespace",
        "hf/resume.py",
        "store.runner.prefill_states(prompt[: at[-1]], at, namespace, junctions)",
        "store.runner.prefill_states(prompt[: at[-1]], at, None, junctions)",
        ("tests/test_recurrent.py::test_a_private_namespaces_split_prefill_stays_private",),
        "the prefill that splits a recurrent model's prompt runs in the shared namespace: a private prompt leaks",
    ),
    Mutation(
        "snapshots-call-end-of-row-zero",
        "hf/resume.py",
        "snapshots.add(held.space, row.keys, states.take(held.states, b, end))",
        "snapshots.add(held.space, row.keys, states.take(held.states, 0, end))",
        ("tests/test_recurrent.py::test_each_row_of_a_batch_keeps_its_own_state_for_its_next_turn",),
        "the end-of-call snapshots of a batch take row 0's state for every row: row 1's next turn is off stock",
    ),
    # -- images in the prompt (issue 46)
    Mutation(
        "images-digest-ignores-grid",
        "hf/vision.py",
        'per = [{"pixel_values": pixels[a:b], "image_grid_thw": grid[i]} for i, (a, b) in enumerate(spans)]',
        'per = [{"pixel_values": pixels[a:b]} for i, (a, b) in enumerate(spans)]',
        ("tests/test_images.py::test_digest_keys_the_grid",),
        "the same patches in another grid (other positions, another image to the model) take the same keys",
    ),
    Mutation(
        "images-match-ends-inside-an-image",
        "hf/resume.py",
        "        while plan is not None:  # nor inside any row's image",
        "        while False:  # nor inside any row's image",
        ("tests/test_images.py::test_a_prompt_ending_in_an_image_recomputes_the_whole_image",),
        "a reuse capped one token short of a prompt that ends in an image ends inside the image",
    ),
    Mutation(
        "images-keys-ignore-the-image",
        "base/tokens.py",
        'drawn = hashlib.blake2b(digest + index.to_bytes(8, "little"), digest_size=8).digest()',
        'drawn = hashlib.blake2b(index.to_bytes(8, "little"), digest_size=8).digest()',
        ("tests/test_images.py::test_same_image_reused_another_never",),
        "an image's placeholders are keyed by their index alone: another image behind the same text reuses its K/V",
    ),
    Mutation(
        "images-invariant-chunks-past-an-image",
        "hf/resume.py",
        "hidden = next((t for t, k in enumerate(keys) if k < 0 or is_image_key(k)), len(keys))",
        "hidden = next((t for t, k in enumerate(keys) if k < 0), len(keys))",
        ("tests/test_images.py::test_an_invariant_store_reuses_the_text_before_the_first_image",),
        "an invariant store's canonical prefill of ids alone runs past an image placeholder, with no image",
    ),
    Mutation(
        "images-shared-prefill-past-an-image",
        "hf/runner.py",
        "prefix = prefix[: next((t for t, k in enumerate(prefix) if is_image_key(k)), len(prefix))]",
        "prefix = prefix[: len(prefix)]",
        ("tests/test_images.py::test_two_images_batches_and_beams",),
        "in-batch sharing prefills a prefix of ids alone past an image placeholder, with no image",
    ),
    Mutation(
        "images-cached-image-encoded-again",
        "hf/hooks.py",
        "fed = plan.encode_only([held.length - row.pad for row in held.rows], model_kwargs, expand)",
        "fed = model_kwargs",
        ("tests/test_images.py::test_a_cached_image_is_not_encoded_again",),
        "generate encodes every image of a warm call, the cached ones again (the features of the tail are picked)",
    ),
    Mutation(
        "images-beams-encode-the-fed-only",
        "hf/vision.py",
        "        if expand > 1:\n            self.encoded_from = None\n            return kwargs\n",
        "",
        ("tests/test_differential.py::test_beams_over_a_cached_image_and_a_new_one",),
        "a call that repeats its rows for beams encodes only its fed images, which generate's split gives no row",
    ),
    Mutation(
        "measure-resumes-the-last-calls-rope-deltas",
        "hf/vision.py",
        "    reset_rope_deltas(model)\n    try:\n        yield",
        "    try:\n        yield",
        ("tests/test_differential.py::test_a_store_built_after_a_batch_of_qwen2_vl_serves_it",),
        "the store's measuring forwards resume a cache with Qwen2-VL's rope_deltas of a batch of another size",
    ),
    Mutation(
        "images-empty-encoder-outputs-unproven",
        "hf/proof.py",
        "            and not (isinstance(v, Mapping) and not v)",
        "",
        ("tests/test_images.py::test_same_image_reused_another_never",),
        "a vision-language model's text-only calls never publish: generate passes them an empty mm_encoder_outputs",
    ),
    Mutation(
        "images-replan-ignores-image-keys",
        "hf/call.py",
        "        keys = [relabel(k, r.keys) for k, r in zip(keys, held)]",
        "",
        ("tests/test_images.py::test_same_image_reused_another_never",),
        "a call's first step takes a prompt's image keys for other keys and redoes construction's reuse (a hybrid's "
        "split_tokens are lost and the reuse it computed itself is counted as cached)",
    ),
    # -- the differential test's kind of bug (issue 52): namespace, batch row, digest coverage, budget order, sizing
    Mutation(
        "recurrent-split-prefill-without-namespace",
        "hf/runner.py",
        "    with PagedPrefixCache(store, namespace=namespace) as cache:\n        rows = cache.forward.rows",
        "    with PagedPrefixCache(store) as cache:\n        rows = cache.forward.rows",
        (
            "tests/test_differential.py::test_a_private_prefix_of_a_hybrid_is_never_reused_outside_its_namespace",
            # one row of LFM2 takes its snapshots inside generate's forward: this test runs the runner's too
            "tests/test_recurrent.py::test_a_private_namespaces_split_prefill_stays_private",
        ),
        "the prefill that splits a recurrent model's prompt at its snapshot points publishes in the shared namespace",
    ),
    Mutation(
        "recurrent-end-snapshots-of-row-0",
        "hf/resume.py",
        "states.take(held.states, b, end)",
        "states.take(held.states, 0, end)",
        ("tests/test_differential.py::test_each_row_of_a_batch_resumes_from_its_own_state",),
        "the end-of-call snapshots of a batch take row 0's state for every row: row 1's next turn is off stock",
    ),
    # -- images of issue 52: every byte, every side tensor and every encoding keyword keys an image
    Mutation(
        "images-digest-first-4kib",
        "base/images.py",
        'h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")',
        'h.update(t.view(torch.uint8).numpy().tobytes()[:4096] if t.numel() else b"")',
        (
            "tests/test_images.py::test_images_one_value_apart_never_share",
            "tests/test_differential.py::test_an_image_that_differs_past_its_first_4_kib_is_another_image",
        ),
        "two images that differ past their first 4 KiB of pixel data (a third colour channel) share K/V",
    ),
    Mutation(
        "images-sizes-not-keyed",
        "hf/vision.py",
        '{"pixel_values": _real_patches(pixels[i]), "image_sizes": inputs["image_sizes"][i]}',
        '{"pixel_values": _real_patches(pixels[i])}',
        ("tests/test_image_processors.py::test_image_sizes_key_the_image",),
        "LLaVA-NeXT's patches under other image_sizes (another grid, the same placeholder count) share K/V",
    ),
    Mutation(
        "images-token-types-not-keyed",
        "hf/vision.py",
        "digests = [images.digest({**one, **extra, **encoding}) for one, extra in zip(per, types)]",
        "digests = [images.digest({**one, **encoding}) for one, extra in zip(per, types)]",
        ("tests/test_images.py::test_token_types_key_the_image",),
        "a prompt with and without token_type_ids (Gemma 3) or mm_token_type_ids (Qwen2-VL) shares an image's K/V",
    ),
    Mutation(
        "images-encoding-keywords-not-keyed",
        "hf/vision.py",
        "digests = [images.digest({**one, **extra, **encoding}) for one, extra in zip(per, types)]",
        "digests = [images.digest({**one, **extra}) for one, extra in zip(per, types)]",
        ("tests/test_images.py::test_a_keyword_that_changes_the_encoding_is_keyed",),
        "an image encoded at another vision_feature_layer reuses the K/V of the default layer's",
    ),
    Mutation(
        "images-call-inputs-unchecked",
        "hf/vision.py",
        "other = sorted(name for name in IMAGE_INPUTS if not _same(inputs.get(name), self.given[name]))",
        "other: list[str] = []",
        ("tests/test_image_processors.py::test_image_sizes_key_the_image",),
        "generate given other image_sizes than the cache was built with runs on the cache's keys",
    ),
    Mutation(
        "images-unknown-layout-read-as-rows",
        "hf/vision.py",
        "layout = LAYOUTS.get(str(family))",
        'layout = LAYOUTS.get(str(family), "rows")',
        ("tests/test_image_processors.py::test_a_layout_prefixkv_does_not_know_is_refused_by_name",),
        "a family whose layout prefixkv does not know is read as one image per row of pixel_values",
    ),
    Mutation(
        "recurrent-pool-sized-from-all-of-max-memory",
        "store/prefix_store.py",
        "kv_memory = max_memory if max_memory is None or spare is None else parse_bytes(max_memory) - spare",
        "kv_memory = max_memory",
        ("tests/test_differential.py::test_a_hybrids_blocks_and_snapshots_stay_within_max_memory",),
        "a recurrent model's K/V pool takes the whole of max_memory, the snapshots' quarter on top",
    ),
    # -- issue 52's defects: padded rows in float32, clear(), the census's time limit, the estimate
    Mutation(
        "padded-check-takes-rounding-for-columns",
        "hf/shapes.py",
        "bound = max(tolerance, _ROUNDING_FACTOR * _rounding(model, name, ids[:, 1:], text))",
        "bound = tolerance",
        ("tests/test_never_wrong.py::test_float32_rounding_is_not_a_padded_row_counting_positions_in_columns",),
        "float32 rounding of a model with large logits is taken for positions counted in columns: no padded reuse",
    ),
    Mutation(
        "padded-check-bound-too-loose",
        "hf/shapes.py",
        "_ROUNDING_FACTOR = 64",
        "_ROUNDING_FACTOR = 10**6",
        ("tests/test_never_wrong.py::test_float32_padded_check_still_refuses_a_model_that_counts_pads",),
        "a bound of a million times the model's rounding lets TrOCR's padded rows reuse K/V at other positions",
    ),
    Mutation(
        "clear-keeps-the-grown-pool",
        "kv/room.py",
        "size = max(h.first_capacity, held + 1)",
        "size = alloc.capacity",
        ("tests/test_namespaces.py::test_clear_brings_the_books_back_to_a_fresh_stores",),
        "clear() keeps the pool and the allocator's books at the size a namespace per request grew them to",
    ),
    Mutation(
        "clear-keeps-stale-free-list-entries",
        "kv/allocator.py",
        "self._free = [b for b in range(1, new_capacity) if self._refcount[b] == 0]",
        "self._free = [b for b in self._free if b < new_capacity]",
        ("tests/test_namespaces.py::test_clear_brings_the_books_back_to_a_fresh_stores",),
        "clear() keeps the free list's stale entries (ids taken out of order, freed twice): the books grow per request",
    ),
    Mutation(
        "census-slow-family-is-a-crash",
        "tools/census.py",
        'result = FamilyResult(model_type, "slow",',
        'result = FamilyResult(model_type, "crash",',
        ("tests/test_census.py::test_a_family_past_its_time_limit_is_slow_not_a_defect",),
        "a family past its time limit on a busy machine is a crash: the census test fails on the machine's load",
    ),
    Mutation(
        "estimate-v-at-k-head-size",
        "base/memory.py",
        'value = int(_read(text, "v_head_dim") or dim)',
        "value = dim",
        (
            "tests/test_differential.py::test_the_estimate_sizes_v_at_its_own_head_size",
            "tests/test_memory.py::test_the_estimate_is_what_the_pool_of_a_mixed_shape_model_holds",
        ),
        "kv_bytes_per_token sizes V at K's head size: MiMo-V2-Flash's estimate 85% too high",
    ),
    Mutation(
        "estimate-without-mimo-sliding-heads",
        "base/memory.py",
        'sliding = _SLIDING_HEADS.get(getattr(text, "model_type", ""), 1)',
        "sliding = 1",
        ("tests/test_memory.py::test_the_estimate_is_what_the_pool_of_a_mixed_shape_model_holds",),
        "kv_bytes_per_token counts MiMo-V2-Flash's sliding layers at the config's KV heads, half what they keep",
    ),
    Mutation(
        "model-errors-any-error-is-the-models",
        "base/family.py",
        'if below is None or not refuses_float64(e) or _dtype(model) != "float64":',
        "if below is None:",
        ("tests/test_first_hour.py::test_an_error_of_prefixkvs_own_code_is_not_called_the_models",),
        "any error raised in the model's code under a prefixkv forward is called a dtype refusal stock raises too",
    ),
    Mutation(
        "model-errors-without-the-models-frames",
        "base/family.py",
        "if frames.tb_frame.f_code.co_filename in model_files:",
        "if frames is not None:",
        ("tests/test_first_hour.py::test_an_error_of_prefixkvs_own_code_is_not_called_the_models",),
        "an error raised under prefixkv's frames but outside the model's code is called the model's",
    ),
    # -- issue 54: a pool CUDA graphs can hold, and a decode step's write without the lock
    Mutation(
        "pool-not-static-addresses",
        "kv/pool.py",
        "    torch._dynamo.mark_static_address(t, guard=False)\n",
        "",
        ("tests/test_compiled.py::test_the_pool_keeps_its_storage_under_compiled_steps",),
        "the pool's tensors are not marked static addresses: CUDA graphs copy them in, or skip the step",
    ),
    Mutation(
        "unlocked-write-trusts-a-growth",
        "kv/pool.py",
        "        return not self.growing and self.moves == moves\n",
        "        return True\n",
        ("tests/test_compiled.py::test_an_eager_write_that_a_growth_overtook_is_written_again[int8-auto]",),
        "an 8-bit pool's decode step write that a growth in another thread overtook is lost in the old tensors",
    ),
    # -- issue 53: a layer kind is one object, its per-token tensors named in the pool
    Mutation(
        "kind-spec-drops-named-tensors",
        "hf/kinds.py",
        "        return layer_spec(shape.key, shape.value, device, dtype, shape.extra)\n",
        "        return layer_spec(shape.key, shape.value, device, dtype)\n",
        ("tests/test_kinds.py::test_a_kind_registered_from_a_test_is_served_exactly",),
        "a kind's tensors besides K and V get no room in the pool: its layers' index keys have nowhere to go",
    ),
    Mutation(
        "files-and-tiers-carry-k-and-v-only",
        "kv/pool.py",
        "        for name, shape in tensors.items():\n            out.append(",
        "        for name, shape in list(tensors.items())[:2]:\n            out.append(",
        ("tests/test_kinds.py::test_a_kinds_named_tensor_is_saved_loaded_and_tiered",),
        "a file or a tier block keeps K and V alone: a kind's other tensors come back as zeros",
    ),
    # -- issue 53: saved files and the tiers carry recurrent-state snapshots
    Mutation(
        "state-file-snapshot-on-wrong-path",
        "hf/state_files.py",
        "out.append((list(leaves[i][: snapshot.position]), snapshot))",
        "out.append((list(leaves[-1][: snapshot.position]), snapshot))",
        ("tests/test_hybrid_files.py::test_save_load_merge_and_convert_carry_the_snapshots[lfm2]",),
        "a loaded snapshot is kept on another saved path than its own: a prompt resumes another prompt's state",
    ),
    Mutation(
        "state-snapshot-nan-unchecked",
        "hf/state_files.py",
        "        if not torch.isfinite(t).all():\n",
        "        if False:\n",
        ("tests/test_hybrid_files.py::test_a_disk_entry_with_a_bad_snapshot_is_dropped_and_recomputed",),
        "a tier entry's non-finite snapshot is restored: the next prompt through it resumes a NaN state",
    ),
    Mutation(
        "hybrid-invariant-call-publishes",
        "hf/rows.py",
        "        self.publishes = store.settings.chunk_size is None or chunks\n        if self.states:",
        "        self.publishes = True\n        if self.states:",
        ("tests/test_hybrid_modes.py::test_invariant_warm_is_bit_identical_to_cold_in_bfloat16[lfm2]",),
        "an invariant store's generate call on a hybrid publishes its end: a later call resumes off the chunk schedule",
    ),
    # -- issue 53: the families refused at the start of its round, served
    Mutation(
        "mamba-mixers-not-stepped",
        "hf/stepwise.py",
        "    if args or width < 2 or cache is None or not serves(cache):\n",
        "    if args or width < 2**31 or cache is None or not serves(cache):\n",
        ("tests/test_new_kinds.py::test_mamba_resumes_a_prefix_one_id_at_a_time",),
        "Mamba's mixers resume a prefix with a scan from a zero state: 1e-2 off (refused, or wrong if unchecked)",
    ),
    Mutation(
        "recurrent-gemma-states-not-taken-from-the-cache",
        "hf/stepwise.py",
        "    resumed = bool(layer.has_previous_state[0])\n",
        "    resumed = False\n",
        ("tests/test_new_kinds.py::test_recurrent_gemma_keeps_its_block_states_in_the_cache",),
        "RecurrentGemma's blocks start each forward from zeros, whatever state the row resumed",
    ),
    Mutation(
        "minimax-linear-cache-never-found",
        "hf/linear_cache.py",
        "        return layer.recurrent_states[0] if layer.is_recurrent_states_initialized[0] else None\n",
        "        return None\n",
        ("tests/test_new_kinds.py::test_minimax_keeps_its_running_product_as_a_recurrent_state",),
        "MiniMax's lightning layers never find their running product: every forward restarts it",
    ),
    Mutation(
        "sparse-attention-switched-to-prefixkv-attention",
        "attention/interface.py",
        '    if _INDEXED in (getattr(model.config.get_text_config(decoder=True), "layer_types", None) or ()):\n',
        "    if False:\n",
        ("tests/test_new_kinds.py::test_sparse_attention_keeps_its_indexer_keys",),
        "a DSA model switched to prefixkv attention gets the indexer's raw indices, which it ignores: dense attention",
    ),
    Mutation(
        "sparse-attention-indexer-keys-not-kept",
        "hf/kinds.py",
        '        return {} if keys is None or keys.numel() == 0 else {"index_k": (1, int(keys.shape[-1]))}\n',
        "        return {}\n",
        ("tests/test_new_kinds.py::test_sparse_attention_keeps_its_indexer_keys",),
        "the indexer's keys get no room in the pool: a DSA layer's update_indexer has nowhere to write",
    ),
    # -- issue 54, the decode corridor: the step's write into the plan's slot views
    Mutation(
        "corridor-write-keeps-stale-views",
        "hf/forward.py",
        "            plan.views, plan.moves = pool.kv_slots, pool.moves\n",
        "            plan.moves = pool.moves\n",
        ("tests/test_compiled.py::test_an_eager_write_that_a_growth_overtook_is_written_again",),
        "after another thread's growth the step's later layers write and read the old tensors the plan took",
    ),
    Mutation(
        "corridor-overtaken-write-not-redone",
        "hf/forward.py",
        "        landed = not pool.growing and pool.moves == plan.moves\n",
        "        landed = True\n",
        ("tests/test_compiled.py::test_an_eager_write_that_a_growth_overtook_is_written_again",),
        "a write that a growth's copy overtook is not written again: the grown pool lacks the step's column",
    ),
    # -- issue 56: snapshots taken inside one forward
    Mutation(
        "snapshots-inside-conv-one-token-late",
        "hf/states.py",
        "            for c in recorded.cuts\n",
        "            for c in [c + 1 for c in recorded.cuts]\n",
        ("tests/test_snapshots.py::test_where_the_prefix_parts",),
        "a conv state taken inside a forward holds the inputs up to one token past its position",
    ),
    Mutation(
        "snapshots-inside-kernel-final-state",
        "hf/states.py",
        "recorded.pending = states[:-1]",
        "recorded.pending = [state] * (len(states) - 1)",
        ("tests/test_snapshots.py::test_the_first_prompt_takes_its_grid_inside_one_forward",),
        "the gated delta rule's state at every position inside a forward is the forward's last",
    ),
    Mutation(
        "clear-keeps-the-leaving-snapshots",
        "hf/state_files.py",
        'go too. Mutates."""\n        self._leaving = None',
        'go too. Mutates."""\n        return',
        ("tests/test_hybrid_files.py::test_a_clear_leaves_no_snapshot_behind_in_a_store_with_a_tier",),
        "a store with a tier keeps the last evicted node's snapshots after clear()",
    ),
    # -- issue 56: the weights walked once per generate call, at its first step, for the forward that follows only
    Mutation(
        "step-space-kept-past-its-forward",
        "kv/key_space.py",
        "            return self._kept.pop()",
        "            return self._kept[0]",
        ("tests/test_edges.py::test_the_space_read_at_a_calls_first_step_serves_its_first_forward_only",),
        "a later call's forward takes the space read at the first call's first step: weights written in between "
        "are not seen, and K/V of the new weights are published under the old weights' key",
    ),
    Mutation(
        "step-space-from-construction",
        "hf/call.py",
        "            space=held.space_now.for_step(),\n",
        "            space=held.space,\n",
        ("tests/test_edges.py::test_a_weight_written_between_building_the_cache_and_generate_is_seen",),
        "the first step of a call takes the space its cache's construction read: a write through .data in between "
        "reuses the old weights' K/V",
    ),
    Mutation(
        "steady-step-reuses-a-copied-block",
        "attention/planner.py",
        "if t <= 0 or (t + 1) % bs == 0 or table[: len(held)] != held:",
        "if t <= 0 or (t + 1) % bs == 0:",
        ("tests/test_blocks_attention.py::test_a_steady_decode_step_reuses_the_last_plan_and_gets_the_fresh_one",),
        "a steady decode step reuses the last step's reads after a copy-on-write replaced a block they read",
    ),
    Mutation(
        "compile-verdict-kept-past-its-forward",
        "hf/forward.py",
        "self._takes = None  # a model compiled between forwards takes steps from its next one",
        "pass",
        ("tests/test_compiled.py::test_a_forward_compiled_between_two_forwards_of_a_cache_takes_steps_from_the_next",),
        "the once-a-forward compile verdict outlives the forward: a model compiled since keeps running eagerly",
    ),
    Mutation(
        "one-read-attention-unscaled",
        "attention/blocks.py",
        "scaled_dot_product_attention(packed, k, v, scale=scale)",
        "scaled_dot_product_attention(packed, k, v)",
        ("tests/test_blocks_attention.py::test_reading_the_blocks_is_sdpa_over_the_whole_rows",),
        "a decode step's one read of every row attends with the default scale, not the model's",
    ),
    Mutation(
        "flex-bucket-blind-to-grad-mode",
        "attention/flex_kernel.py",
        "lse, modes)",
        "lse)",
        ("tests/test_flex.py::test_a_graph_compiled_under_no_grad_does_not_use_up_the_limit_of_a_pass_with_grad",),
        "a pass with grad on a shape compiled under no_grad runs flex_attention eagerly past the recompile limit",
    ),
    Mutation(
        "flex-compiles-on-the-shared-frame",
        "attention/flex_kernel.py",
        "_compiled: Any = torch.compile(_flex_frame, dynamic=False)",
        "_compiled: Any = torch.compile(flex_attention, dynamic=False)",
        ("tests/test_flex.py::test_another_compile_of_flex_attention_past_its_limit_leaves_prefixkvs_compiled",),
        "prefixkv's FlexAttention runs eagerly once another compile of flex_attention passed the recompile limit",
    ),
]


def run_one(mutation: Mutation, python: str) -> tuple[str, float, str]:
    """``("caught" | "survived" | "not found", seconds, detail)`` for ``mutation``; the working tree is untouched."""
    source = (ROOT / "src" / "prefixkv" / mutation.file).read_text()
    count = source.count(mutation.old)
    if count != 1:
        return (
            "not found",
            0.0,
            f"src/prefixkv/{mutation.file}: the text occurs {count} times (needs exactly 1): {mutation.old!r}",
        )
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutation.name}-") as tmp:
        copy = Path(tmp) / "src"
        shutil.copytree(ROOT / "src", copy, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        (copy / "prefixkv" / mutation.file).write_text(source.replace(mutation.old, mutation.new))
        env = dict(os.environ, PYTHONPATH=str(copy), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
        check = subprocess.run(
            [python, "-c", "import prefixkv; print(prefixkv.__file__)"], env=env, capture_output=True, text=True
        )
        if not check.stdout.strip().startswith(str(copy)):
            return "not found", 0.0, f"the copy is not what imports: {check.stdout.strip() or check.stderr.strip()}"
        test = subprocess.run(
            [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutation.tests],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
    seconds = time.monotonic() - start
    lines = [line for line in test.stdout.splitlines() if line.strip()]
    detail = lines[-1] if lines else test.stderr.strip()[-300:]
    if test.returncode == 0:
        return "survived", seconds, detail
    if test.returncode in (1,):
        failed = next((line for line in lines if line.startswith("FAILED")), detail)
        return "caught", seconds, failed
    return "caught?", seconds, f"pytest exited {test.returncode} (not a test failure): {detail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutation (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs the tests")
    args = parser.parse_args()
    chosen = MUTATIONS
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in MUTATIONS})
        if unknown:
            parser.error(f"no mutation named {', '.join(unknown)}; --list shows them")
        chosen = [m for m in MUTATIONS if m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name}\n    src/prefixkv/{m.file}: {m.why}\n    tests: {' '.join(m.tests)}")
        return 0
    results: dict[str, int] = {}
    began = time.monotonic()
    for m in chosen:
        outcome, seconds, detail = run_one(m, args.python)
        results[outcome] = results.get(outcome, 0) + 1
        print(f"{outcome:>9}  {m.name}  ({seconds:.0f} s)\n           {detail}", flush=True)
    total = time.monotonic() - began
    summary = ", ".join(f"{n} {k}" for k, n in sorted(results.items()))
    print(f"\n{len(chosen)} mutations: {summary} in {total:.0f} s")
    return 0 if results.get("caught", 0) == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
