"""`configure_offload`, as the Python example in docs/headless.md imports it; it lives in `placement/door.py`
with the rest of placement (`lingbot_core.placement`)."""

from .placement.door import configure_offload

__all__ = ["configure_offload"]
