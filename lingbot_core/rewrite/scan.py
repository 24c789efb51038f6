"""Find the first complete JSON object in text a model is still writing.

Generation stops as soon as the object closes (a model tends to add commentary after it), so the
scanner is fed one piece at a time and keeps its state between pieces. It counts braces outside
strings and knows string escapes; it does not check the JSON itself (``json.loads`` does that
afterwards). Written here because ``json.JSONDecoder.raw_decode`` needs the whole text and would
rescan it after every token.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["ObjectScanner", "extract_object"]


class ObjectScanner:
    """Incremental brace-balance scanner; ``feed`` returns True once the first object has closed."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.start: int | None = None  # offset of the first '{'
        self.end: int | None = None  # offset just past the matching '}'
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._offset = 0

    @property
    def closed(self) -> bool:
        return self.end is not None

    def feed(self, piece: str) -> bool:
        if self.end is not None:
            return True
        self.text.append(piece)
        for i, ch in enumerate(piece):
            at = self._offset + i
            if self.start is None:
                if ch == "{":
                    self.start, self._depth = at, 1
                continue
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch == '"':
                self._in_string = True
            elif ch == "{":
                self._depth += 1
            elif ch == "}":
                self._depth -= 1
                if self._depth == 0:
                    self.end = at + 1
                    break
        self._offset += len(piece)
        return self.end is not None

    def object_text(self) -> str | None:
        """The first complete object's text, or None while it is still open."""
        if self.end is None or self.start is None:
            return None
        return "".join(self.text)[self.start:self.end]


_FENCE = re.compile(r"```(?:json)?\s*", re.IGNORECASE)


def extract_object(text: str) -> tuple[Any | None, str | None]:
    """``(value, None)`` for the first JSON object in ``text`` (code fences and chatter around it are
    ignored), else ``(None, reason)``. Only ``json.loads`` ever reads it: the caption is data."""
    scanner = ObjectScanner()
    scanner.feed(_FENCE.sub("", text))
    body = scanner.object_text()
    if body is None:
        if scanner.start is None:
            return None, "the reply holds no JSON object (no '{')"
        return None, "the JSON object never closes (the reply was cut off or its braces do not balance)"
    try:
        return json.loads(body), None
    except RecursionError:
        return None, "the JSON nests too deeply"
    except ValueError as exc:
        return None, f"the JSON object does not parse: {exc}"
