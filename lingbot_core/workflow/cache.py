"""Cache signatures in ComfyUI's manner, and the store that outlives one run.

A node's signature is its class type, its ``IS_CHANGED`` value, its sorted constant inputs, and
for every link the position of the linked ancestor in a deterministic ancestry walk plus the
socket, followed by the immediate signatures of all those ancestors. Two runs (or two nodes) with
equal signatures compute the same thing, so the second is served from the store and not run.
The node id joins the signature only for ``NOT_IDEMPOTENT`` classes and classes that take the
hidden ``UNIQUE_ID``. Anything that cannot be compared (NaN from ``IS_CHANGED``, objects that are
not plain data) becomes a fresh token, which never matches again: "always changed".
"""

from __future__ import annotations

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
    """Computes signatures for one prompt; ``is_changed`` holds each node's IS_CHANGED value."""

    def __init__(self, prompt: Mapping[str, Mapping[str, Any]], infos: Mapping[str, NodeClassInfo],
                 is_changed: Mapping[str, Any]) -> None:
        self.prompt = prompt
        self.infos = infos
        self.is_changed = is_changed

    def signature(self, node_id: str) -> Hashable:
        ancestors, order = self._ordered_ancestry(node_id)
        parts = [self._immediate_signature(node_id, order)]
        parts += [self._immediate_signature(a, order) for a in ancestors]
        return to_hashable(parts)

    def _immediate_signature(self, node_id: str, order: Mapping[str, int]) -> list[Any]:
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
                parts.append((key, ("__ancestor__", order[str(value[0])], value[1])))
            else:
                parts.append((key, value))
        return parts

    def _ordered_ancestry(self, node_id: str) -> tuple[list[str], dict[str, int]]:
        """Ancestors in a depth-first pre-order walk over inputs sorted by name (deterministic)."""
        ancestors: list[str] = []
        order: dict[str, int] = {}
        stack = [iter(self._linked_sources(node_id))]
        while stack:
            src = next(stack[-1], None)
            if src is None:
                stack.pop()
                continue
            if src in order:
                continue
            order[src] = len(ancestors)
            ancestors.append(src)
            stack.append(iter(self._linked_sources(src)))
        return ancestors, order

    def _linked_sources(self, node_id: str) -> list[str]:
        inputs = self.prompt[node_id].get("inputs", {})
        return [str(inputs[k][0]) for k in sorted(inputs) if is_link(inputs[k])]
