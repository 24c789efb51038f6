"""Starting a process group on this machine only (tests, benches, a later ComfyUI worker pool).

The rendezvous is torch's TCP store on 127.0.0.1 and gloo is told to use the loopback interface,
so nothing listens on or talks to another address.
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

__all__ = ["free_loopback_port", "init_loopback_group"]


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_loopback_group(rank: int, world_size: int, port: int, backend: str = "gloo") -> None:
    """`init_process_group` with a rendezvous on 127.0.0.1:`port` (gloo pinned to the loopback device)."""
    if backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
