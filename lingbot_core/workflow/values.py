"""Shape rules for values read from a workflow file: nesting depth, ids, and how a place in the JSON is named.

A leaf: both the UI converter (`convert`) and the graph reader (`graph`) use these, and neither
imports the other through here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import WorkflowError, clip

MAX_NESTING = 64  # containers inside containers; editor saves use under 10


def check_nesting(data: Any, origin: str = "<dict>", limit: int = MAX_NESTING) -> None:
    """Refuse values nested deeper than ``limit`` before anything recurses into them.

    Copying, hashing and printing a value recurse; a few thousand levels (easy to write in a
    file) would raise ``RecursionError`` deep inside. Walks iteratively and names the JSON path.
    """
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(data, 0, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, Mapping):
            children = value.items()
        elif isinstance(value, (list, tuple)):
            children = enumerate(value)
        else:
            continue
        if depth >= limit:
            raise WorkflowError(f"{clip(origin, 500)}: values nest more than {limit} levels deep "
                                f"at {json_path(path[:8])}...; a workflow never needs that")
        for key, child in children:
            if isinstance(child, (Mapping, list, tuple)):
                stack.append((child, depth + 1, path + (key,) if depth < 8 else path))


def json_path(path: tuple[Any, ...]) -> str:
    """``("nodes", 3, "inputs")`` -> ``nodes[3].inputs`` (keys shortened)."""
    out = "$"
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else f".{clip(str(key), 40)}"
    return out


MAX_ID_CHARS = 64


def id_text(raw: Any) -> str | None:
    """A node or link id as the string key we use, or None if it cannot be one.

    Strings and integers only (not bools), of bounded size: ``str()`` of a 5,000-digit integer
    raises, and an id is echoed in every message about its node.
    """
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return str(raw) if raw.bit_length() <= 64 else None
    if isinstance(raw, str) and 0 < len(raw) <= MAX_ID_CHARS:
        return raw
    return None
