"""Cache-aware routing over engine replicas: send a request to the replica that already
holds the longest prefix of it, as SGLang's cache-aware router does.

The router keeps one radix tree per replica over the *routing text* of the requests it
sent there (for a chat: the model and the rendered messages, character by character,
with each media part as its digest; see ``api.serve_ray.routing_text``). A replica's
tree approximates what its prefix cache holds. For a new request:

1. every candidate replica's tree gives the length of the longest prefix of the text it
   holds; the best one wins if it covers at least ``threshold`` of the text and at least
   ``min_match`` characters (about a KV page: a shorter shared start, such as the model
   name and a role tag, saves nothing) (ties: fewer requests in flight, then the name);
2. otherwise, or when the winner has more than ``imbalance`` requests in flight above the
   least loaded candidate, the least loaded one wins (ties: the smaller tree, so new
   prefixes spread over idle replicas; then the name);
3. the text is recorded in the winner's tree.

Each tree is bounded: past ``max_chars`` characters its least recently used leaves are
cut until it is back under 90% of the budget. Pure Python, no Ray: the Ray Serve request
router in ``api.serve_ray`` holds one :class:`PrefixRouter` and feeds it the replicas'
in-flight counts.
"""

from __future__ import annotations

import heapq
import itertools
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal


class _Node:
    __slots__ = ("children", "edge", "last_used", "parent")

    def __init__(self, edge: str, parent: _Node | None, last_used: int) -> None:
        self.edge = edge
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.last_used = last_used


class RadixTree:
    """The strings sent to one replica, as a character radix tree with LRU eviction of
    leaves past ``max_chars`` characters (edge characters, counted once per node)."""

    def __init__(self, max_chars: int) -> None:
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.max_chars = max_chars
        self.chars = 0
        self._clock = itertools.count(1)
        self._root = _Node("", None, 0)

    def match(self, text: str) -> int:
        """How many leading characters of ``text`` the tree holds."""
        node, i = self._root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                return i
            common = len(os.path.commonprefix((child.edge, text[i : i + len(child.edge)])))
            i += common
            if common < len(child.edge):
                return i
            node = child
        return i

    def insert(self, text: str) -> None:
        """Record ``text`` (its path becomes the most recently used), then evict if over."""
        now = next(self._clock)
        node, i = self._root, 0
        node.last_used = now
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node, now)
                node.children[text[i]] = leaf
                self.chars += len(leaf.edge)
                break
            common = len(os.path.commonprefix((child.edge, text[i : i + len(child.edge)])))
            if common < len(child.edge):  # split the edge: node -> middle -> child
                middle = _Node(child.edge[:common], node, now)
                node.children[text[i]] = middle
                child.edge = child.edge[common:]
                child.parent = middle
                middle.children[child.edge[0]] = child
                child = middle
            child.last_used = now
            node, i = child, i + common
        if self.chars > self.max_chars:
            self._evict(self.max_chars * 9 // 10)

    def _evict(self, target: int) -> None:
        """Cut least recently used leaves until at most ``target`` characters remain. A
        parent is never less recent than its children (an insert touches its whole path),
        so a parent left without children joins the candidates in its turn."""
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children and n is not self._root]
        heapq.heapify(leaves)
        while self.chars > target and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.edge[0]]
            self.chars -= len(leaf.edge)
            leaf.parent = None
            if not parent.children and parent is not self._root:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))

    def _nodes(self) -> Iterable[_Node]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


@dataclass(frozen=True)
class Choice:
    """Where a request goes and why (``matched``: characters of its text the replica held)."""

    replica: str
    reason: Literal["prefix", "least_loaded", "imbalance"]
    matched: int


class PrefixRouter:
    """Longest-prefix routing bounded by load, one :class:`RadixTree` per replica name."""

    def __init__(
        self, *, threshold: float = 0.5, min_match: int = 64, imbalance: int = 4, max_chars: int = 1 << 20
    ) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if imbalance < 0:
            raise ValueError(f"imbalance must be >= 0, got {imbalance}")
        self.threshold = threshold
        self.min_match = min_match
        self.imbalance = imbalance
        self.max_chars = max_chars
        self.trees: dict[str, RadixTree] = {}

    def choose(self, text: str, loads: Mapping[str, int]) -> Choice:
        """The replica for ``text`` among ``loads`` (replica name -> requests in flight)."""
        if not loads:
            raise ValueError("no replicas to choose from")
        names = sorted(loads)
        least = min(loads.values())
        matched = {n: self.trees[n].match(text) if n in self.trees else 0 for n in names}
        best = min(names, key=lambda n: (-matched[n], loads[n], n))
        if matched[best] >= max(1, self.min_match, self.threshold * len(text)):
            if loads[best] <= least + self.imbalance:
                return Choice(best, "prefix", matched[best])
            reason: Literal["least_loaded", "imbalance"] = "imbalance"
        else:
            reason = "least_loaded"
        idle = min(names, key=lambda n: (loads[n], self.size(n), n))
        return Choice(idle, reason, matched[idle])

    def record(self, text: str, replica: str) -> None:
        """Note that ``replica`` was sent ``text`` (its prefix cache will hold it)."""
        tree = self.trees.get(replica)
        if tree is None:
            tree = self.trees[replica] = RadixTree(self.max_chars)
        tree.insert(text)

    def route(self, text: str, loads: Mapping[str, int]) -> Choice:
        """:meth:`choose`, then :meth:`record` the text on the chosen replica."""
        choice = self.choose(text, loads)
        self.record(text, choice.replica)
        return choice

    def size(self, replica: str) -> int:
        """Characters in ``replica``'s tree."""
        tree = self.trees.get(replica)
        return tree.chars if tree is not None else 0

    def retain(self, replicas: Iterable[str]) -> None:
        """Drop the trees of replicas not in ``replicas`` (they died or were scaled away:
        a replacement starts with an empty cache)."""
        keep = set(replicas)
        for name in [n for n in self.trees if n not in keep]:
            del self.trees[name]
