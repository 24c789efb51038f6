"""Starting a process group on this machine only (tests, benches, a later ComfyUI worker pool).

The rendezvous is torch's TCP store on 127.0.0.1 (`loopback_store`: its server is handed a socket
bound to 127.0.0.1, since the server torch makes by itself listens on every address) and gloo is told
to use the loopback interface, so nothing listens on or talks to another address.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import RefusedInput
from .layout import ParallelLayout, parse_degrees

__all__ = ["free_loopback_port", "init_from_env", "init_loopback_group", "join_world", "local_gpu", "loopback_store",
           "reserve_loopback_port"]


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reserve_loopback_port(port: int = 0) -> socket.socket:
    """A socket bound to 127.0.0.1:`port` (0: a free one), not listening yet: the port is this process's
    until `loopback_store` listens on it (or the socket is closed)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return sock


def loopback_store(port: int, world_size: int, *, server: bool, timeout: timedelta = timedelta(minutes=30),
                   reserved: socket.socket | None = None) -> dist.TCPStore:
    """The rendezvous store on 127.0.0.1:`port`: the server (rank 0) listens on the loopback address only,
    the clients connect to it (and wait for it up to `timeout`). torch's TCPStore server binds every
    address when it makes its socket itself, so it is given one bound here (`master_listen_fd`):
    `reserved` (from `reserve_loopback_port`), else one bound now."""
    if not server:
        return dist.TCPStore("127.0.0.1", port, world_size, False, timeout)
    sock = reserved if reserved is not None else reserve_loopback_port(port)
    try:
        sock.listen(socket.SOMAXCONN)
        args = ("127.0.0.1", sock.getsockname()[1], world_size, True, timeout)
        try:
            store = dist.TCPStore(*args, wait_for_workers=False, master_listen_fd=sock.fileno())
        except NotImplementedError:
            # torch 2.7's libuv server (its default) cannot take a listening socket; its older server can
            # (the socket is left open by the refusal)
            store = dist.TCPStore(*args, wait_for_workers=False, master_listen_fd=sock.fileno(), use_libuv=False)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns (and closes) the socket now
    return store


def init_loopback_group(rank: int, world_size: int, port: int, backend: str = "gloo",
                        timeout: timedelta = timedelta(minutes=30), reserved: socket.socket | None = None) -> None:
    """`init_process_group` with a rendezvous on 127.0.0.1:`port` (`loopback_store`; rank 0 holds it, on
    `reserved` when given) and gloo pinned to the loopback device. `timeout`: the collectives' (and the
    rendezvous')."""
    if backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = loopback_store(port, world_size, server=rank == 0, timeout=timeout, reserved=reserved)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def local_gpu(default_local_world: int = 1) -> int | None:
    """The GPU of this torchrun process (its LOCAL_RANK), or None when there is no GPU (the CPU). More
    processes on this node (LOCAL_WORLD_SIZE, else `default_local_world`) than GPUs is refused: each
    process needs one of its own."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    try:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(default_local_world)))
    except ValueError:
        raise RefusedInput("LOCAL_RANK and LOCAL_WORLD_SIZE must be whole numbers (as torchrun sets them)") from None
    count = torch.cuda.device_count()
    if max(local_world, local + 1) > count:
        raise RefusedInput(f"{max(local_world, local + 1)} processes on this node but {count} GPU"
                           f"{'s' if count != 1 else ''} visible: each process needs a GPU of its own; start "
                           f"torchrun with --nproc-per-node {count}, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to "
                           "run every process on the CPU")
    return local


def require_nccl(what: str) -> None:
    """Processes on GPUs talk over NCCL, which torch's builds for Windows and macOS lack: refused in one
    line before any group starts (torch's own error would come later, from inside every process)."""
    if not dist.is_nccl_available():
        raise RefusedInput(f"{what} on GPUs talks over NCCL, which this torch build lacks (torch for Windows and "
                           "macOS has none): run it on Linux or in WSL 2, or on the CPU to try it out")


def join_world() -> bool:
    """In a torchrun world of several processes (WORLD_SIZE > 1) with no process group yet: start one on
    gloo from torchrun's variables (env://), for what the processes say to each other outside any
    model (the jobs' end: `lingbot_nodes.jobs.finish_together`). True when it started one (the caller ends it)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return False
    dist.init_process_group("gloo")
    return True


def init_from_env(degrees: str = "", *, fsdp: bool = False, split: bool = False) -> ParallelLayout:
    """This rank's layout in a world started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
    MASTER_PORT in the environment: the operator's rendezvous, not an input of the workflow).

    `degrees` as `parse_degrees` takes them ("cfg=2,ulysses=4"; missing ones follow from the world).
    One GPU per local rank (NCCL); no GPU: the CPU (gloo); fewer GPUs than local ranks: refused
    (`local_gpu`). A world of one gives the
    one-process layout and starts nothing. `fsdp`: the layout shards the DiTs' blocks (distributed/fsdp.py).
    `split`: the degrees' product may divide the world, which then runs one video per group
    (`ParallelLayout.create`); a product of one gives the one-process layout too.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg, ulysses = parse_degrees(degrees, world, split=split)
    if world == 1 or cfg * ulysses == 1:
        return ParallelLayout.single()
    gpu = local_gpu(world)
    cuda = gpu is not None
    if cuda:
        require_nccl("a parallel run (--parallel)")
        torch.cuda.set_device(gpu)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")  # env:// from torchrun's variables
    return ParallelLayout.create(cfg, ulysses, device_type="cuda" if cuda else "cpu", fsdp=fsdp, split=split)
