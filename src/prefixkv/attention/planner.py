"""The ``"blocks"`` backend's read planner: where every row's held K/V sit in the pool, as few reads
(:class:`Read`) as possible, from the rows' block tables (:func:`plan_reads`;
docs/how-it-works.md, "Attention reads the blocks"). What it keeps between forwards (runs of consecutive blocks, the
index tensors of the last folded read) checks itself against the tables it was built from."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class Read(NamedTuple):
    """Columns of the pool that the queries of ``rows`` (batch indices) attend, ``length`` tokens per row:

    - one row, or several with ``row_stride`` (a strided view: row ``j`` reads the ``length`` slots from
      ``first_slot + j * row_stride``): a view of the pool, the first token at mask column ``columns[j]``;
    - several rows without ``row_stride``: the same K/V for all of them (shared blocks, read once with every
      row's queries), the slots from ``first_slot``, or ``slots`` (1-D) at mask columns ``columns[j] + offsets``;
    - ``slots`` 2-D ``[rows, length]``: a gather, row ``j``'s K/V at ``slots[j]`` and mask columns
      ``offsets[j]``, padded where ``valid`` is False.
    """

    rows: tuple[int, ...]
    columns: tuple[int, ...]
    length: int
    first_slot: int | None = None
    row_stride: int | None = None
    slots: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    valid: torch.Tensor | None = None


# runs shorter than this many blocks are gathered (one copy per row) rather than read as views (one call each)
_MIN_RUN = 8
# ... except for a row read alone, up to this many short runs (more: one gather rather than a call each)
_LONE_ROW_VIEWS = 2
# rows that hold at most this many tokens in all besides shared blocks are one gather, not several parts: copying
# them costs less than a second kernel call and the merge of two parts (docs/benchmarks.md, "Decode host overhead")
_FOLD_TOKENS = 1024


RunsMemo = dict[int, tuple[list[int], list[list[int]]]]


def table_runs(table: list[int], memo: RunsMemo | None) -> list[list[int]]:
    """``[first, end)`` block indices of the runs of consecutive block ids in ``table``. With ``memo`` (kept by the
    caller between forwards), the runs of a table seen before are reused up to its last block as long as the table
    still starts with the blocks they were walked over (a copy of them is kept: a table cut, or one whose blocks the
    trie replaced, is walked again from where it differs), so a decode step walks O(1) blocks. Mutates ``memo``."""
    entry = None if memo is None else memo.get(id(table))
    runs: list[list[int]] = []
    walked = 0
    if entry is not None:
        seen, old = entry
        keep = max(0, min(len(seen), len(table)) - 1)  # the last block seen may since be a copy (copy-on-write)
        if table[:keep] != seen[:keep]:
            keep = next(b for b in range(keep) if table[b] != seen[b])
        for first, end in old:
            if first >= keep:
                break
            runs.append([first, min(end, keep)])
        walked = keep
    for b in range(walked, len(table)):
        if runs and runs[-1][1] == b and table[b] == table[b - 1] + 1:
            runs[-1][1] = b + 1
        else:
            runs.append([b, b + 1])
    if memo is not None:
        memo[id(table)] = (list(table), runs)
    return runs


def _runs(
    table: list[int], begin: int, stop: int, block_size: int, memo: RunsMemo | None
) -> list[tuple[int, int, int]]:
    """Tokens ``[begin, stop)`` of ``table`` (``begin`` a multiple of ``block_size``) as runs of consecutive block
    ids: ``(first token, end token, first slot)``. Mutates ``memo`` only (:func:`table_runs`)."""
    out = []
    b, last = begin // block_size, -(-stop // block_size)
    for first, end in table_runs(table, memo):
        lo, hi = max(first, b), min(end, last)
        if lo < hi:
            out.append((lo * block_size, min(hi * block_size, stop), table[lo] * block_size))
    return out


def _gather_read(rows: list[int], pieces: list[list[tuple[int, int, int]]], pads: list[int]) -> Read:
    """One read of the scattered pieces ``(first token, end token, first slot)`` of several rows, padded to the
    longest row's count (``valid`` marks the real ones). The index tensors are made from plain ints, three tensors
    in all (a decode step rebuilds them: tensor set-ups per piece cost more than the attention of small rows)."""
    counts = [sum(hi - lo for lo, hi, _ in row) for row in pieces]
    width = max(counts)
    slots: list[int] = []
    columns: list[int] = []
    for row, row_pieces, n in zip(rows, pieces, counts):
        for lo, hi, slot in row_pieces:
            slots.extend(range(slot, slot + hi - lo))
            columns.extend(range(pads[row] + lo, pads[row] + hi))
        slots.extend([0] * (width - n))
        columns.extend([0] * (width - n))
    shape = (len(rows), width)
    valid = torch.arange(width) < torch.tensor(counts)[:, None]
    return Read(
        tuple(rows),
        (0,) * len(rows),
        width,
        slots=torch.tensor(slots, dtype=torch.long).view(shape),
        offsets=torch.tensor(columns, dtype=torch.long).view(shape),
        valid=valid,
    )


# the index tensors of the last folded read, by its rows, pads, first tokens and the blocks it covers; a decode step
# whose rows have not entered a new block since takes slices of them
FoldMemo = dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]]


def _fold_read(
    rows: list[int],
    pads: list[int],
    tables: list[list[int]],
    first: list[int],
    spans: list[int],
    block_size: int,
    memo: FoldMemo | None,
) -> Read:
    """One gather of tokens ``[first[i], spans[i])`` of each of ``rows`` (``first`` a multiple of ``block_size``),
    padded to the longest (``valid`` marks the real ones; padding reads slot 0, the null block, at column 0). Its
    index tensors cover the rows' whole blocks and come from the block ids in a few tensor operations; with ``memo``
    (kept by the caller between forwards) a forward whose rows fill the same blocks slices those of the last one.
    Mutates ``memo`` only."""
    bs = block_size
    counts = [spans[i] - first[i] for i in rows]
    width = max(counts)
    n = -(-width // bs)
    ids = [tables[i][first[i] // bs : first[i] // bs + n] for i in rows]
    key = (n, tuple(rows), tuple(pads[i] + first[i] for i in rows), tuple(tuple(t) for t in ids))
    built = None if memo is None else memo.get(key)
    if built is None:
        blocks = torch.tensor([t + [0] * (n - len(t)) for t in ids], dtype=torch.long)  # [rows, n]
        whole = torch.arange(n * bs)
        built = (
            (blocks[:, :, None] * bs + torch.arange(bs)).view(len(rows), n * bs),
            torch.tensor(key[2])[:, None] + whole,
        )
        if memo is not None:
            memo.clear()  # one entry: the next forward's rows
            memo[key] = built
    slots, columns = built[0][:, :width], built[1][:, :width]
    if min(counts) == width:
        valid = torch.ones(slots.shape, dtype=torch.bool)
    else:
        valid = torch.arange(width) < torch.tensor(counts)[:, None]
        slots, columns = slots.masked_fill(~valid, 0), columns.masked_fill(~valid, 0)
    return Read(tuple(rows), (0,) * len(rows), width, slots=slots.contiguous(), offsets=columns, valid=valid)


def _shared_reads(
    pads: list[int], tables: list[list[int]], spans: list[int], block_size: int, memo: RunsMemo | None
) -> tuple[list[Read], list[int]]:
    """The reads of leading blocks that several rows hold (cascade: read once for all of them), and per row the
    tokens they cover."""
    bs = block_size
    first = [0] * len(pads)
    reads: list[Read] = []
    by_block: dict[int, list[int]] = {}
    for i, table in enumerate(tables):
        if spans[i] >= bs and table:
            by_block.setdefault(table[0], []).append(i)
    for members in by_block.values():
        if len(members) < 2:
            continue
        shared = [tables[i] for i in members]
        blocks = 0
        for column in zip(*shared):
            if any(b != column[0] for b in column):
                break
            blocks += 1
        tokens = min(blocks, *(spans[i] // bs for i in members)) * bs  # whole blocks: the rest starts aligned
        if not tokens:
            continue
        for lo, hi, slot in _runs(shared[0], 0, tokens, bs, memo):
            reads.append(Read(tuple(members), tuple(pads[i] + lo for i in members), hi - lo, slot))
        for i in members:
            first[i] = tokens
    return reads, first


class Folded(NamedTuple):
    """A decode step's plan that ended in one folded read (:func:`plan_reads`), what the next step reuses of it
    (:func:`steady_reads`): the step's column ``start``, the rows' ``pads``, the blocks each row's tokens lay in
    (copies), the shared reads, the folded rows, where each row's folded tokens begin and how many were folded."""

    start: int
    pads: list[int]
    blocks: list[list[int]]
    shared: list[Read]
    rows: list[int]
    first: list[int]
    tokens: int


# the last decode step's :class:`Folded` plan, under the key ``None``: one entry, the next step's
StepMemo = dict[None, Folded]


def steady_reads(
    memo: StepMemo, pads: list[int], tables: list[list[int]], start: int, block_size: int, fold_tokens: int
) -> tuple[list[Read], Folded] | None:
    """The reads of a steady decode step, the one after the step ``memo`` holds: the same rows and pads, each row one
    token longer (its new token does not fill a block: the shared blocks stay those of the last step), the tables of
    the blocks they held unchanged, still few enough tokens to fold. Such a step reads the same shared blocks and one
    folded read one column wider, as :func:`plan_reads` plans it from scratch, so only the fold is made again (from
    the tables, through its memo's index tensors); ``None`` for any other step. Does not mutate."""
    last = memo.get(None)
    # every row folded: a row that shared blocks held all of would join the fold as it enters a block of its own
    if last is None or start != last.start + 1 or pads != last.pads or len(last.rows) != len(pads):
        return None
    bs = block_size
    for pad, table, held in zip(pads, tables, last.blocks):
        t = start - pad  # the new token's index in its row
        # a token that fills its block may make it a shared block's last (rows of one fork); one that enters a
        # new block only adds to the fold, which is made again from the tables
        if t <= 0 or (t + 1) % bs == 0 or table[: len(held)] != held:
            return None
    tokens = last.tokens + len(last.rows)
    if tokens > fold_tokens:
        return None
    return last.shared, last._replace(start=start, tokens=tokens)


def lone_fold(pads: list[int], tables: list[list[int]], start: int, q: int, block_size: int) -> bool:
    """Whether :func:`plan_reads` reads this forward in one gather of a lone row: a decode step (``q`` 1) of one row
    whose at most :data:`_FOLD_TOKENS` tokens lie in more than one run of blocks (a cached prefix, then blocks of its
    own elsewhere in the pool). Does not mutate."""
    if q != 1 or len(tables) != 1:
        return False
    held = start + 1 - pads[0]
    if held <= 0 or held > _FOLD_TOKENS:
        return False
    table = tables[0][: -(-held // block_size)]
    return bool(table) and not one_run(table)


def one_run(blocks: list[int]) -> bool:
    """Whether ``blocks`` (not empty) are consecutive block ids, one run of the pool. Does not mutate."""
    return blocks == list(range(blocks[0], blocks[0] + len(blocks)))


def plan_reads(
    pads: list[int],
    tables: list[list[int]],
    start: int,
    q: int,
    block_size: int,
    memo: RunsMemo | None = None,
    *,
    fold_tokens: int | None = None,
    fold_memo: FoldMemo | None = None,
    step_memo: StepMemo | None = None,
) -> tuple[list[Read], int | None]:
    """Where each row's held K/V sit, for a forward feeding ``q`` columns after ``start``, as few reads as
    possible. Leading blocks that several rows hold are read once for all of them (cascade). Each row's first run
    of consecutive blocks is a view of the pool, and when those runs start at evenly spaced slots (the rows of a
    batch prefilled together) one strided view serves every row; other runs of at least ``_MIN_RUN`` blocks are
    views too; what is left of every row (the blocks decode steps add one at a time, interleaved between rows) is
    one gather for the whole batch. Rows that hold at most ``fold_tokens`` (:data:`_FOLD_TOKENS`) tokens in all,
    besides shared blocks, are one gather whenever they would be more than one read. A one-token forward reads its
    own new column from the pool too; a longer one attends its new K/V from the arguments, from column ``start``
    (the second value). With ``step_memo``, a decode step that ends in one folded read is kept, and the steady step
    after it reuses it (:func:`steady_reads`). Mutates ``memo``, ``fold_memo`` and ``step_memo`` only."""
    bs = block_size
    end = start + q if q == 1 else start
    spans = [max(0, end - pad) for pad in pads]
    fold = _FOLD_TOKENS if fold_tokens is None else fold_tokens
    steady = None if step_memo is None or q != 1 else steady_reads(step_memo, pads, tables, start, bs, fold)
    if step_memo is not None and steady is not None:
        shared, folded = steady
        step_memo[None] = folded
        return [*shared, _fold_read(folded.rows, pads, tables, folded.first, spans, bs, fold_memo)], None
    if step_memo is not None:
        step_memo.clear()
    reads, first = _shared_reads(pads, tables, spans, bs, memo)
    rows = [i for i in range(len(pads)) if spans[i] > first[i]]
    runs_of = {i: _runs(tables[i], first[i], spans[i], bs, memo) for i in rows}
    tokens = sum(spans[i] - first[i] for i in rows)
    if sum(len(runs_of[i]) for i in rows) > 1 and tokens <= fold:
        if step_memo is not None and q == 1:
            blocks = [table[: -(-span // bs)] for table, span in zip(tables, spans)]
            step_memo[None] = Folded(start, list(pads), blocks, list(reads), rows, first, tokens)
        reads.append(_fold_read(rows, pads, tables, first, spans, bs, fold_memo))
        return reads, None if q == 1 else start
    # every row's first run: one strided view when they start at evenly spaced slots
    heads = [runs_of[i][0] for i in rows]
    common = min((hi - lo for lo, hi, _ in heads), default=0)
    steps = {heads[j + 1][2] - heads[j][2] for j in range(len(heads) - 1)}
    if len(rows) > 1 and len(steps) == 1 and min(steps) >= 0 and common >= bs:
        (step,) = steps
        columns = tuple(pads[i] + runs_of[i][0][0] for i in rows)
        reads.append(Read(tuple(rows), columns, common, heads[0][2], row_stride=step))
        for i in rows:
            lo, hi, slot = runs_of[i][0]
            runs_of[i][0] = (lo + common, hi, slot + common)
    scattered: dict[int, list[tuple[int, int, int]]] = {}
    for i in rows:
        pieces = [(lo, hi, slot) for lo, hi, slot in runs_of[i] if hi > lo]
        short = sum(1 for lo, hi, _ in pieces if hi - lo < _MIN_RUN * bs)
        for lo, hi, slot in pieces:
            # in a batch, only long runs are worth a call of their own; a lone row's few short runs (a cached
            # prefix, then its own blocks elsewhere in the pool) are views too: no index tensors, no padding mask
            if hi - lo >= _MIN_RUN * bs or (len(rows) == 1 and short <= _LONE_ROW_VIEWS):
                reads.append(Read((i,), (pads[i] + lo,), hi - lo, slot))
            else:
                scattered.setdefault(i, []).append((lo, hi, slot))
    if scattered:
        reads.append(_gather_read(list(scattered), list(scattered.values()), pads))
    return reads, None if q == 1 else start
