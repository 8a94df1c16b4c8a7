"""The trie's nodes (:class:`Node`: an edge, its blocks, its lock count), the tokens of a node's path, the root of
each key space (:class:`Roots`), and copies of nodes for display (:class:`NodeView`, :func:`node_views`). No torch;
the tree itself is :class:`prefixkv.kv.trie.RadixTrie`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence, ValuesView
from typing import NamedTuple

__all__ = ["Node", "NodeView", "Roots", "node_views", "path_tokens"]


class Node:
    """One edge of the trie and the node below it. ``start`` is the position of ``tokens[0]``. ``last_access``,
    ``hits`` and ``retains`` are the eviction policy's (:mod:`prefixkv.kv.eviction`); the trie never reads them."""

    __slots__ = ("alive", "blocks", "children", "hits", "last_access", "lock", "parent", "retains", "start", "tokens")

    def __init__(self, tokens: list[int], start: int, blocks: list[int], parent: Node | None) -> None:
        self.tokens = tokens
        self.start = start
        self.blocks = blocks
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.lock = 0
        self.last_access = 0
        self.hits = 0  # lookups that matched into this node, and into its evicted children (see touch())
        self.retains: Counter[int] = Counter()  # priority -> retains on this node's path (at or below it)
        self.alive = True

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def __repr__(self) -> str:
        return f"Node(start={self.start}, len={len(self.tokens)}, blocks={self.blocks}, lock={self.lock})"


def path_tokens(node: Node) -> list[int]:
    """The tokens from position 0 to the end of ``node``'s edge (also for a node just evicted). Does not
    mutate."""
    parts: list[list[int]] = []
    n: Node | None = node
    while n is not None:
        parts.append(n.tokens)
        n = n.parent
    return [t for part in reversed(parts) for t in part]


class Roots:
    """The root of each key space of a trie. A root is made on first use by an insert (a lookup makes none); the root
    of a key space (but the default one) that lost its last node is dropped when the next one is emptied, at the next
    new root or at :meth:`drop_empty`, not at once, so that :meth:`space_of` still names a node just evicted: a
    key space per user or per request costs no memory once its prefixes are gone (the tables shrink too)."""

    def __init__(self) -> None:
        self._roots: dict[Hashable, Node] = {}
        self._spaces: dict[int, Hashable] = {}  # id of each root -> its key space
        self._emptied: set[Hashable] = set()
        self._high = 0  # the most roots since the tables were last rebuilt (a dict never shrinks as keys go)

    def get(self, space: Hashable) -> Node:
        """The root of ``space``, made (locked forever) if it has none. Mutates on first use."""
        root = self._roots.get(space)
        if root is None:
            self.drop_empty()
            root = self._roots[space] = Node([], 0, [], None)
            root.lock = 1
            self._spaces[id(root)] = space
            self._high = max(self._high, len(self._roots))
        return root

    def find(self, space: Hashable) -> Node | None:
        """The root of ``space``, or ``None`` if it has none. Does not mutate."""
        return self._roots.get(space)

    def space_of(self, node: Node) -> Hashable:
        """The key space ``node`` is in. Does not mutate."""
        while node.parent is not None:
            node = node.parent
        return self._spaces[id(node)]

    def emptied(self, root: Node) -> None:
        """Note that ``root`` lost its last node, dropping those emptied before it that are still empty. Mutates."""
        space = self._spaces[id(root)]
        self._emptied.discard(space)  # emptied before, filled again since: kept for now all the same
        self.drop_empty()
        self._emptied.add(space)

    def drop_empty(self, *, every: bool = False) -> None:
        """Drop the roots of key spaces (but the default one) that were emptied and hold no node and no lock (with
        ``every``, of all key spaces: ``clear()``). Mutates."""
        for space in list(self._roots) if every else self._emptied:
            root = self._roots.get(space)
            if root is not None and space is not None and not root.children and root.lock == 1:
                del self._roots[space]
                del self._spaces[id(root)]
        self._emptied.clear()
        if every or 4 * len(self._roots) < self._high:  # at a quarter of the most: O(1) amortised per root
            self._roots, self._spaces = dict(self._roots), dict(self._spaces)
            self._high = len(self._roots)

    def __contains__(self, space: Hashable) -> bool:
        return space in self._roots

    def __getitem__(self, space: Hashable) -> Node:
        return self._roots[space]

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._roots)

    def __len__(self) -> int:
        return len(self._roots)

    def values(self) -> ValuesView[Node]:
        return self._roots.values()


class NodeView(NamedTuple):
    """A copy of one node (:func:`node_views`): its edge, blocks and lock count, the index of its parent in the
    view (``-1`` under a root), its key space, and whether it lies on the path of a given node (a pin)."""

    tokens: tuple[int, ...]
    start: int
    blocks: tuple[int, ...]
    lock: int
    parent: int
    space: Hashable
    pinned: bool

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def node_views(
    nodes: Iterable[Node], space_of: Callable[[Node], Hashable], pinned: Sequence[Node] = ()
) -> list[NodeView]:
    """A copy of each of ``nodes``, which come parents before children and without the roots (as
    :meth:`prefixkv.kv.trie.RadixTrie.nodes` lists them); ``space_of`` names the key space of a node under a root,
    and those on the path of a node in ``pinned`` are marked. Does not mutate."""
    marked: set[int] = set()
    for end in pinned:
        n: Node | None = end
        while n is not None and id(n) not in marked:
            marked.add(id(n))
            n = n.parent
    out: list[NodeView] = []
    index: dict[int, int] = {}  # id of a node -> its place in ``out``
    for node in nodes:
        parent = node.parent
        assert parent is not None, "a root has no view"
        up = -1 if parent.parent is None else index[id(parent)]
        space = space_of(node) if up < 0 else out[up].space
        index[id(node)] = len(out)
        out.append(
            NodeView(tuple(node.tokens), node.start, tuple(node.blocks), node.lock, up, space, id(node) in marked)
        )
    return out
