"""The offload modes, one file each; `MODE_CLASSES` maps a mode name to its class."""

from __future__ import annotations

from .base import Mode
from .group import GroupMode
from .model import ModelMode
from .none import NoneMode
from .sequential import SequentialMode

MODE_CLASSES: dict[str, type[Mode]] = {cls.name: cls for cls in (NoneMode, ModelMode, SequentialMode, GroupMode)}

__all__ = ["MODE_CLASSES", "Mode"]
