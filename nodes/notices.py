"""Text a node shows on itself in the editor (through `web/lingbot_text.js`) and headless runs print."""

from __future__ import annotations

from typing import Any

from .v3 import ui


def on_node(*texts: str | None) -> Any:
    """The node's `ui` text for these lines (None when there is nothing to show)."""
    lines = [t for t in texts if t]
    return ui.PreviewText("\n".join(lines)) if lines else None
