"""Text a node shows on itself in the editor (through `web/lingbot_text.js`) and headless runs print."""

from __future__ import annotations

from typing import Any

from .v3 import ui


def on_node(*texts: str | None) -> Any:
    """The node's `ui` text for these lines. A node with nothing to say still sends its (empty) text, so
    the editor clears the notice an earlier run of that node left on it."""
    return ui.PreviewText("\n".join(t for t in texts if t))
