"""Cache signatures in ComfyUI's manner, and the store that outlives one run.

A node's signature is a digest of its class type, its ``IS_CHANGED`` value, its sorted constant
inputs, and for every link the signature of the linked source plus the socket (a Merkle digest,
so each node is digested once). Two runs (or two nodes) with
equal signatures compute the same thing, so the second is served from the store and not run.
The node id joins the signature only for ``NOT_IDEMPOTENT`` classes and classes that take the
hidden ``UNIQUE_ID``. Anything that cannot be compared (NaN from ``IS_CHANGED``, objects that are
not plain data) becomes a fresh token, which never matches again: "always changed".
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from .nodeinfo import NodeClassInfo, is_link


class _Never:
    """A value equal only to itself: makes a signature that no later run can match."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<always changed>"


def fresh_token() -> Hashable:
    return _Never()


def to_hashable(obj: Any) -> Hashable:
    """Turn plain data into a hashable, comparable form; anything else into a fresh token."""
    if isinstance(obj, float) and math.isnan(obj):
        return fresh_token()
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if isinstance(obj, Mapping):
        return ("__map__", frozenset((to_hashable(k), to_hashable(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return ("__seq__", tuple(to_hashable(v) for v in obj))
    return fresh_token()


@dataclass
class CacheEntry:
    outputs: tuple[Any, ...]
    ui: Any = None


class SignatureBuilder:
    """Computes signatures for one prompt; ``is_changed`` holds each node's IS_CHANGED value.

    A node's signature is a digest over its own part (class type, IS_CHANGED, node id where it
    matters, sorted constants) and, per link, the input name, the *signature* of the source and
    the socket. Each node is digested once, so a prompt costs time linear in its size (a chain of
    2,000 nodes took 39 s with per-node ancestry walks). Two nodes with equal signatures compute
    the same thing from the same inputs, which is all the cache relies on.
    """

    def __init__(self, prompt: Mapping[str, Mapping[str, Any]], infos: Mapping[str, NodeClassInfo],
                 is_changed: Mapping[str, Any]) -> None:
        self.prompt = prompt
        self.infos = infos
        self.is_changed = is_changed
        self._memo: dict[str, Hashable] = {}

    def signature(self, node_id: str) -> Hashable:
        if node_id in self._memo:
            return self._memo[node_id]
        # Iterative post-order walk over the sources, so that long chains need no deep recursion.
        on_path: set[str] = set()
        stack: list[tuple[str, bool]] = [(node_id, False)]
        while stack:
            current, expanded = stack.pop()
            if current in self._memo:
                continue
            if expanded:
                on_path.discard(current)
                self._memo[current] = self._digest(current)
                continue
            if current in on_path:  # a cycle (only among nodes that will not run): never cached
                self._memo[current] = fresh_token()
                continue
            on_path.add(current)
            stack.append((current, True))
            for src in self._linked_sources(current):
                if src not in self._memo:
                    if src in on_path:
                        self._memo[src] = fresh_token()
                    else:
                        stack.append((src, False))
        return self._memo[node_id]

    def _digest(self, node_id: str) -> Hashable:
        node = self.prompt[node_id]
        class_type = node["class_type"]
        info = self.infos[class_type]
        parts: list[Any] = [class_type, self.is_changed.get(node_id, False)]
        if info.not_idempotent or info.wants_unique_id:
            parts.append(("__node_id__", node_id))
        inputs = node.get("inputs", {})
        for key in sorted(inputs):
            value = inputs[key]
            if is_link(value):
                source = self._memo.get(str(value[0]))
                if not isinstance(source, tuple):
                    return fresh_token()  # an "always changed" ancestor makes this one always changed too
                parts.append((key, ("__link__", source[1], value[1])))
            else:
                parts.append((key, value))
        chunks: list[bytes] = []
        try:
            _encode(parts, chunks)
        except (_Uncomparable, RecursionError):
            return fresh_token()
        return ("sig", hashlib.blake2b(b"".join(chunks), digest_size=20).hexdigest())

    def _linked_sources(self, node_id: str) -> list[str]:
        inputs = self.prompt[node_id].get("inputs", {})
        return [str(inputs[k][0]) for k in sorted(inputs) if is_link(inputs[k])]


class _Uncomparable(Exception):
    """Internal: a value that cannot take part in a signature (NaN, an arbitrary object)."""


def _encode(obj: Any, out: list[bytes]) -> None:
    """A canonical, type-tagged byte encoding of plain data (mapping keys and sets sorted)."""
    if obj is None:
        out.append(b"N")
    elif isinstance(obj, bool):
        out.append(b"T" if obj else b"F")
    elif isinstance(obj, int):
        out.append(b"i%x;" % obj)
    elif isinstance(obj, float):
        if math.isnan(obj):
            raise _Uncomparable
        out.append(b"f" + obj.hex().encode() + b";")
    elif isinstance(obj, str):
        data = obj.encode("utf-8", "surrogatepass")
        out.append(b"s%d:" % len(data) + data)
    elif isinstance(obj, bytes):
        out.append(b"b%d:" % len(obj) + obj)
    elif isinstance(obj, (list, tuple)):
        out.append(b"[")
        for item in obj:
            _encode(item, out)
        out.append(b"]")
    elif isinstance(obj, Mapping):
        items = []
        for key, value in obj.items():
            k: list[bytes] = []
            v: list[bytes] = []
            _encode(key, k)
            _encode(value, v)
            items.append(b"".join(k) + b"=" + b"".join(v))
        out.append(b"{" + b",".join(sorted(items)) + b"}")
    elif isinstance(obj, (set, frozenset)):
        members = []
        for item in obj:
            m: list[bytes] = []
            _encode(item, m)
            members.append(b"".join(m))
        out.append(b"<" + b",".join(sorted(members)) + b">")
    else:
        raise _Uncomparable  # includes fresh tokens: "always changed"
