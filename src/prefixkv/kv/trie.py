"""A token-granular radix trie from token prefixes to the blocks that hold their KV. No torch.

Edges are runs of token ids; a node splits wherever two sequences part, at any token. Each node also
keeps, for every chunk of ``block_size`` positions its edge touches, the id of a block whose slots hold
the KV of that chunk *along this node's path* (valid at least up to the end of the edge). A chunk cut by
a split is touched by both halves, so its block occurs twice; the trie reports every occurrence it adds
or drops so that the owner of the refcounts (the store) keeps them true.

Namespaces keep apart K/V that the same tokens get under different model states (an active adapter: docs/correctness.md,
"Adapters and changed weights"): each key space has its own root, and every query or insert names its
key space (``None`` by default). Eviction is one segmented LRU over all of them (docs/generate.md, "Many
prompts at once").

Locks count per path: locking a node locks every ancestor too, so a locked node is never a leaf candidate and
nor is any node above it. Which unlocked leaf goes first is the trie's eviction policy's to say
(:mod:`prefixkv.kv.eviction`: the segmented LRU with retention priorities, by default), which the trie tells of
every event the order depends on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

from .eviction import DEFAULT_PRIORITY, PROTECT_AFTER, PROTECTED_SHARE, EvictionPolicy, SegmentedLRU
from .nodes import Node, NodeView, Roots, node_views, path_tokens

__all__ = ["ALL_SPACES", "DEFAULT_PRIORITY", "PROTECTED_SHARE", "PROTECT_AFTER", "Insert", "Match", "Node"]
__all__ += ["NodeView", "RadixTrie", "Roots", "path_tokens"]

ALL_SPACES: Hashable = object()  # for :meth:`RadixTrie.nodes`: every key space


class Match(NamedTuple):
    """Result of :meth:`RadixTrie.match`: ``length`` tokens matched; ``blocks[c]`` holds chunk ``c``
    (the last one possibly only partly matched); ``node`` is the node holding the last matched token."""

    length: int
    blocks: list[int]
    node: Node


class Insert(NamedTuple):
    """Result of :meth:`RadixTrie.insert`: the node holding the last inserted token, and the block
    occurrences the trie added (the caller increments their refcounts)."""

    node: Node
    added: list[int]


def _common_prefix(edge: list[int], seq: list[int], pos: int, end: int | None = None) -> int:
    """Length of the common prefix of ``edge`` and ``seq[pos:end]``, by bisection over slice compares."""
    hi = min(len(edge), (len(seq) if end is None else end) - pos)
    if edge[:hi] == seq[pos : pos + hi]:
        return hi
    lo = 0  # edge[:lo] matches, edge[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if edge[lo:mid] == seq[pos + lo : pos + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixTrie:
    """Token-granular radix trie over block ids.

    >>> t = RadixTrie(block_size=2)
    >>> t.insert([1, 2, 3, 4], [10, 11]).added
    [10, 11]
    >>> m = t.match([1, 2, 3, 9])
    >>> m.length, m.blocks
    (3, [10, 11])
    """

    def __init__(
        self,
        block_size: int,
        *,
        protect_after: int = PROTECT_AFTER,
        protected_share: float = PROTECTED_SHARE,
        policy: EvictionPolicy | None = None,
    ) -> None:
        """``policy`` orders eviction (:mod:`prefixkv.kv.eviction`); by default a :class:`SegmentedLRU` with
        ``protect_after`` and ``protected_share``."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.policy: EvictionPolicy = policy or SegmentedLRU(
            block_size, protect_after=protect_after, protected_share=protected_share
        )
        self._roots = Roots()
        self.root = self.root_of(None)
        self.watchers: list[Callable[[Hashable, Node], None]] = []
        """Told of every node evicted, with its key space (a store's recurrent-state snapshots, which go with their
        path: :meth:`prefixkv.hf.states.Snapshots.evicted`); they must not call the trie."""

    def root_of(self, space: Hashable) -> Node:
        """The root of key space ``space``, made (locked forever: a root is never evicted) on first use. Mutates then;
        a key space that loses its last node loses its root too (:class:`~prefixkv.kv.nodes.Roots`)."""
        return self._roots.get(space)

    def spaces(self) -> list[Hashable]:
        """The key spaces that have a root: the default one (``None``), those that hold nodes, and at most one
        emptied by the latest eviction. Does not mutate."""
        return list(self._roots)

    def space_of(self, node: Node) -> Hashable:
        """The key space ``node`` is in (also for a node just evicted). Does not mutate."""
        return self._roots.space_of(node)

    # -- queries ---------------------------------------------------------------------------------

    def match(self, seq: Sequence[int], space: Hashable = None) -> Match:
        """Longest cached prefix of ``seq`` in key space ``space``. Does not mutate (see :meth:`touch`)."""
        seq = seq if isinstance(seq, list) else list(seq)
        bs = self.block_size
        root = self._roots.find(space)
        if root is None:  # a key space that holds nothing: a lookup makes no root for it
            return Match(0, [], self.root)
        node, pos, last = root, 0, root
        blocks: list[int] = []
        while pos < len(seq):
            child = node.children.get(seq[pos])
            if child is None:
                break
            k = _common_prefix(child.tokens, seq, pos)
            first = child.start // bs
            c0, c1 = pos // bs, (pos + k - 1) // bs
            del blocks[c0:]
            blocks.extend(child.blocks[c0 - first : c1 - first + 1])
            pos += k
            last = child
            if k < len(child.tokens):
                break
            node = child
        return Match(pos, blocks, last)

    def nodes(self, space: Hashable = ALL_SPACES) -> list[Node]:
        """Every node but the roots (of key space ``space``; all key spaces by default), parents before
        children. Does not mutate."""
        out: list[Node] = []
        roots = self._roots.values() if space is ALL_SPACES else [self._roots[space]] if space in self._roots else []
        stack = [child for root in roots for child in root.children.values()]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def view(self, pinned: Sequence[Node] = ()) -> list[NodeView]:
        """A copy of every node in :meth:`nodes` order (parents before children), marking those on the path of
        a node in ``pinned`` (:func:`~prefixkv.kv.nodes.node_views`). Does not mutate."""
        return node_views(self.nodes(), self.space_of, pinned)

    # -- mutations -------------------------------------------------------------------------------

    def insert(
        self,
        seq: Sequence[int],
        table: Sequence[int],
        space: Hashable = None,
        *,
        after: Node | None = None,
        known: int = 0,
        end: int | None = None,
    ) -> Insert:
        """Add ``seq[:end]`` (all of ``seq`` by default) whose chunk ``c`` is held by ``table[c]`` to key space
        ``space``. Mutates.

        Parts of ``seq`` already in the trie keep their blocks; only new positions take blocks from
        ``table``, and where an edge is split inside a block, the upper half takes ``table``'s block of that
        chunk. Returns the node holding the last token and the block occurrences added.

        ``after`` continues from a node whose path spells (at least) ``seq[:known]``, such as the node a
        sequence published last: the walk starts at the deepest of ``after`` and its ancestors that ends within
        those tokens instead of at the root, so a growing sequence pays for its new tokens, not for all of them.
        The result is the same as without it.

        >>> t = RadixTrie(block_size=2)
        >>> first = t.insert([1, 2, 3, 4], [10, 11])
        >>> t.insert([1, 2, 3, 4, 5, 6], [10, 11, 12], after=first.node, known=4).added
        [12]
        """
        seq = seq if isinstance(seq, list) else list(seq)
        end = len(seq) if end is None else end
        bs = self.block_size
        if len(table) * bs < end:
            raise ValueError(f"{end} tokens need {-(-end // bs)} blocks, got {len(table)}")
        added: list[int] = []
        node = self.root_of(space) if after is None else after
        while node.end > min(known, end):
            assert node.parent is not None, "a root ends at position 0"
            node = node.parent
        pos = node.end
        if pos >= end:
            if node.parent is not None:
                self.policy.stamp(node)
            return Insert(node, added)
        while True:
            child = node.children.get(seq[pos])
            if child is None:
                leaf = Node(seq[pos:end], pos, list(table[pos // bs : (end - 1) // bs + 1]), node)
                node.children[seq[pos]] = leaf
                self.policy.inserted(leaf)
                added.extend(leaf.blocks)
                self.policy.stamp(leaf)
                return Insert(leaf, added)
            k = _common_prefix(child.tokens, seq, pos, end)
            if pos + k == end:
                self.policy.stamp(child)
                return Insert(child, added)
            if k < len(child.tokens):
                child, straddle = self._split(child, k)
                if straddle is not None:
                    # the upper half takes the inserted sequence's block of the cut chunk (both hold its K/V up
                    # to the cut): the path of what is inserted holds its own blocks only, so a request that
                    # holds it locks no block it does not read (docs/memory.md)
                    child.blocks[-1] = table[(pos + k) // bs]
                    added.append(child.blocks[-1])
            node, pos = child, pos + k

    def _split(self, node: Node, k: int) -> tuple[Node, int | None]:
        """Cut ``node``'s edge after ``k`` tokens; return the new upper node and the block of a chunk
        now touched by both halves (one more occurrence), if any. Mutates."""
        bs = self.block_size
        parent = node.parent
        assert parent is not None
        cut = node.start + k
        upper_chunks = (cut - 1) // bs - node.start // bs + 1
        upper = Node(node.tokens[:k], node.start, node.blocks[:upper_chunks], parent)
        upper.lock = node.lock
        lower_first = cut // bs - node.start // bs
        straddle = node.blocks[lower_first] if cut % bs else None
        node.tokens = node.tokens[k:]
        node.blocks = node.blocks[lower_first:]
        node.start = cut
        node.parent = upper
        upper.children[node.tokens[0]] = node
        parent.children[upper.tokens[0]] = upper
        self.policy.split(upper, node, lower_first)
        return upper, straddle

    def end_node(self, seq: Sequence[int], space: Hashable = None) -> Insert | None:
        """The node whose edge ends exactly after ``seq``, splitting an edge there if needed, or ``None``
        if ``seq`` is empty or not wholly in the trie. Mutates (the split); ``added`` is the block
        occurrence a split adds (the caller increments it)."""
        m = self.match(seq, space)
        if m.length == 0 or m.length < len(seq):
            return None
        if m.node.end == m.length:
            return Insert(m.node, [])
        upper, straddle = self._split(m.node, m.length - m.node.start)
        return Insert(upper, [] if straddle is None else [straddle])

    def touch(self, node: Node, matched: int | None = None) -> None:
        """Count a reuse of ``node`` (a lookup matched into it, ``matched`` tokens long if known) and mark it as used
        now (LRU), for the eviction policy (:meth:`prefixkv.kv.eviction.SegmentedLRU.touch`: a lookup that ends
        inside the edge counts for the parent; O(1), not the depth of the path). Mutates."""
        self.policy.touch(node, matched)

    def retain(self, node: Node, priority: int) -> None:
        """Give ``node``'s path the retention ``priority`` (0-100) until :meth:`release`: its leaves are evicted
        after every unlocked leaf of lower priority, before those of higher priority. Unlike :meth:`lock` it
        keeps nothing from eviction when nothing else is left. Mutates.

        >>> t = RadixTrie(block_size=1)
        >>> kept = t.insert([1, 2], [1, 2]).node
        >>> _ = t.insert([3], [3])
        >>> t.retain(kept, 80)
        >>> t.evict_one(), t.evict_one()
        ([3], [1, 2])
        """
        self.policy.retain(node, priority)

    def release(self, node: Node, priority: int) -> None:
        """Undo one :meth:`retain` of ``node`` with ``priority`` (also once ``node`` was evicted). Mutates."""
        self.policy.release(node, priority)

    def lock(self, node: Node) -> None:
        """Protect ``node`` and its ancestors from eviction (a live cache reads them, or a pin). Mutates."""
        n: Node | None = node
        while n is not None:
            n.lock += 1
            n = n.parent

    def move_lock(self, old: Node | None, new: Node) -> None:
        """:meth:`lock` ``new`` and :meth:`unlock` ``old`` (``None``: nothing to unlock). When ``new`` lies below
        ``old`` (a sequence that grew), only the nodes between them change, so a long chain costs its new
        part, not its depth. Mutates."""
        if old is None:
            self.lock(new)
            return
        between: list[Node] = []
        n: Node | None = new
        while n is not None and n is not old and n.end > old.end:
            between.append(n)
            n = n.parent
        if n is not old:
            self.lock(new)
            self.unlock(old)
            return
        for m in between:  # the lock of `old` and above stays: it now counts the lock of `new`
            m.lock += 1

    def unlock(self, node: Node) -> None:
        """Undo one :meth:`lock`. Mutates."""
        n: Node | None = node
        while n is not None:
            if n.lock <= 0:
                raise ValueError(f"unlock of {n}, which is not locked")
            n.lock -= 1
            n = n.parent
        self.policy.offer(node)

    def evict_one(self) -> list[int] | None:
        """Drop the least recently used unlocked leaf; return its block occurrences (the caller
        decrements them), or ``None`` if no leaf can go. Mutates."""
        node = self.evict_lru()
        return None if node is None else node.blocks

    def evict_lru(self) -> Node | None:
        """Drop the unlocked leaf that goes first (the eviction policy's choice: by default the lowest priority;
        unprotected before protected unless protected nodes hold too much; least recently used) and return it (its
        ``blocks`` are the occurrences the caller decrements; its ``parent`` chain still spells its tokens), or
        ``None`` if no leaf can go. Mutates."""
        node = self.policy.pop()
        if node is None:
            return None
        assert isinstance(node, Node)
        parent = node.parent
        assert parent is not None
        del parent.children[node.tokens[0]]
        node.alive = False
        self.policy.evicted(node)
        if self.watchers:
            space = self.space_of(node)
            for watch in self.watchers:
                watch(space, node)
        if parent.parent is None and not parent.children:
            self._roots.emptied(parent)
        return node

    def clear(self) -> list[int]:
        """Drop every unlocked node (leaves first, repeatedly) and the root of every key space left empty; return their
        block occurrences. Mutates."""
        released: list[int] = []
        while (blocks := self.evict_one()) is not None:
            released.extend(blocks)
        self._roots.drop_empty(every=True)
        return released

    # -- checks ----------------------------------------------------------------------------------

    def check_invariants(self) -> Counter[int]:
        """Raise ``AssertionError`` on a malformed trie; return the block occurrences. Does not mutate."""
        bs = self.block_size
        occurrences: Counter[int] = Counter()
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            child_locks = 0
            for key, child in node.children.items():
                if not child.alive or child.parent is not node:
                    raise AssertionError(f"{child} is detached from its parent")
                if not child.tokens or child.tokens[0] != key:
                    raise AssertionError(f"{child} is filed under token {key}")
                if child.start != node.end:
                    raise AssertionError(f"{child} starts at {child.start}, parent ends at {node.end}")
                chunks = (child.end - 1) // bs - child.start // bs + 1
                if len(child.blocks) != chunks:
                    raise AssertionError(f"{child} touches {chunks} chunks but holds {len(child.blocks)} blocks")
                child_locks += child.lock
                occurrences.update(child.blocks)
                stack.append(child)
            if node.lock < child_locks:
                raise AssertionError(f"{node} has lock {node.lock} < its children's {child_locks}")
        self.policy.check(self.nodes())
        return occurrences
