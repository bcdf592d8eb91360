"""A radix tree over token ids that holds the KV of prefixes the engine has already computed.

Why a radix tree rather than entries at tree-node boundaries: a request of a tree search extends
some earlier request's prefix *and* that request's generated action, and siblings share a prefix
that ends in the middle of what an earlier request fed through the model. Matching on token ids
finds the longest computed prefix in both cases without any hint from the caller.

Each radix node owns the KV of its edge's tokens only, so a shared prefix is stored once. Memory is
bounded in bytes; when an insertion goes over the budget, least-recently-used leaves are evicted
first (a node becomes evictable once its children are gone). The cache holds one policy version:
``reset(version)`` drops every entry, so no request of a new version is served KV computed under an
older one.

KV layout: one ``(key, value)`` pair per layer, each ``(kv_heads, tokens, head_dim)``.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch

from treegrpo_ray.engine import EngineCounters
from treegrpo_ray.tree import common_prefix_length

logger = logging.getLogger(__name__)

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Match:
    """The longest cached prefix of a lookup: ``length`` tokens whose KV is the concatenation of
    ``pieces`` along the token axis (one ``LayerKV`` of views per radix edge, in order)."""

    length: int = 0
    pieces: list[LayerKV] = field(default_factory=list)


@dataclass(eq=False)
class _Node:
    """An edge of the radix tree: ``tokens`` and their KV; children keyed by their first token."""

    tokens: tuple[int, ...]
    kv: LayerKV
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_used: int = 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv)

    def split(self, at: int) -> None:
        """Keep ``tokens[:at]`` here and move the rest (with its KV and children) into a child."""
        tail = _Node(
            self.tokens[at:],
            [(k[:, at:].clone(), v[:, at:].clone()) for k, v in self.kv],
            parent=self,
            children=self.children,
            last_used=self.last_used,
        )
        for child in tail.children.values():
            child.parent = tail
        self.tokens = self.tokens[:at]
        self.kv = [(k[:, :at].clone(), v[:, :at].clone()) for k, v in self.kv]
        self.children = {tail.tokens[0]: tail}


class PrefixCache:
    """Longest-prefix KV lookup over token ids with an LRU memory budget of ``max_bytes``.

    A budget too small to hold one inserted entry disables the cache (with a warning); lookups
    then miss and generation stays correct, just uncached.
    """

    def __init__(self, max_bytes: int, version: int = 0):
        self.max_bytes = max_bytes
        self.enabled = max_bytes > 0
        self.version = version
        self.stats = EngineCounters()  # the cache's share of its engine's counters
        self._root = _Node((), [], parent=None)
        self._clock = itertools.count(1)

    def reset(self, version: int) -> None:
        """Drop every entry; later lookups and inserts belong to policy ``version``."""
        self._root = _Node((), [], parent=None)
        self.stats.bytes = 0
        self.version = version

    def match(self, ids: tuple[int, ...]) -> Match:
        """Longest cached prefix of ``ids`` (counts the lookup)."""
        self.stats.lookups += 1
        node, found = self._root, Match()
        while self.enabled and found.length < len(ids):
            child = node.children.get(ids[found.length])
            if child is None:
                break
            common = common_prefix_length(child.tokens, ids[found.length :])
            child.last_used = next(self._clock)
            found.pieces.append([(k[:, :common], v[:, :common]) for k, v in child.kv])
            found.length += common
            if common < len(child.tokens):
                break
            node = child
        self.stats.hits += int(found.length > 0)
        return found

    def insert(self, ids: tuple[int, ...], kv: LayerKV, start: int = 0) -> None:
        """Remember the KV of ``ids[start:]`` (``(kv_heads, len(ids) - start, head_dim)`` per
        layer); ``ids[:start]`` must be cached already (else nothing is inserted: it was evicted)."""
        if not self.enabled:
            return
        node, at = self._root, 0
        while at < len(ids):
            child = node.children.get(ids[at])
            if child is None:
                if at >= start:
                    self._add_leaf(
                        node, ids[at:], [(k[:, at - start :], v[:, at - start :]) for k, v in kv]
                    )
                return
            common = common_prefix_length(child.tokens, ids[at:])
            if common < len(child.tokens):
                child.split(common)
            child.last_used = next(self._clock)
            node, at = child, at + common

    def _add_leaf(self, parent: _Node, tokens: tuple[int, ...], kv: LayerKV) -> None:
        leaf = _Node(
            tokens,
            [(k.clone(), v.clone()) for k, v in kv],
            parent=parent,
            last_used=next(self._clock),
        )
        if leaf.nbytes > self.max_bytes:
            logger.warning(
                "prefix cache budget of %d bytes is smaller than one entry (%d bytes): prefix "
                "caching is disabled; raise engine.cache_bytes to enable it",
                self.max_bytes,
                leaf.nbytes,
            )
            self.enabled = False
            self.reset(self.version)
            return
        parent.children[leaf.tokens[0]] = leaf
        self.stats.bytes += leaf.nbytes
        self._evict(keep=leaf)

    def _evict(self, keep: _Node) -> None:
        """Drop least-recently-used leaves until the budget holds (never ``keep`` or its path).

        Evicting a leaf may turn its parent into a leaf, hence the passes."""
        protected = set()
        node: _Node | None = keep
        while node is not None:
            protected.add(id(node))
            node = node.parent
        while self.stats.bytes > self.max_bytes:
            leaves = [n for n in self._nodes() if not n.children and id(n) not in protected]
            if not leaves:
                return
            for victim in sorted(leaves, key=lambda n: n.last_used):
                if self.stats.bytes <= self.max_bytes:
                    return
                assert victim.parent is not None
                del victim.parent.children[victim.tokens[0]]
                self.stats.bytes -= victim.nbytes
                self.stats.evictions += 1

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
