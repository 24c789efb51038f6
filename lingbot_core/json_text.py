"""Parse JSON read from a checkpoint (configs, safetensors headers): every failure is a CheckpointError.

A leaf: the folder checks and the safetensors header reader both use it.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import CheckpointError

MAX_JSON_NESTING = 64

def parse_json_text(text: str, where: str) -> Any:
    """``json.loads`` whose every failure (syntax, nesting, 5,000-digit numbers) is a CheckpointError."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise CheckpointError(f"{where} nests too deeply to be a config; re-download it.") from None
    except ValueError as err:  # JSONDecodeError, and integers past Python's digit limit
        raise CheckpointError(f"cannot parse {where} ({str(err)[:200]}). The file is corrupt; re-download it.") from None
    _check_nesting(data, where)
    return data


def _check_nesting(data: Any, where: str) -> None:
    stack = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = list(value.values())
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth >= MAX_JSON_NESTING:
            raise CheckpointError(f"{where} nests more than {MAX_JSON_NESTING} levels deep; not a config file.")
        stack += [(c, depth + 1) for c in children if isinstance(c, (dict, list))]
