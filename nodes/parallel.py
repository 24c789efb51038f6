"""LingBot Parallel: one pipe on several devices, through persistent worker processes.

Type translation only; the workers, the process group and the calls are
`lingbot_core.worker_pool.pool`.
"""

from __future__ import annotations

from . import runtime
from .types import CATEGORY, Choice, Pipe
from .v3 import io

CFG_LABEL = "cfg branches (GPU groups)"
"""The label of the `cfg` widget (a CFG degree of 1 or 2, which a bare "cfg" makes read like a guidance scale)."""


class LingBotParallel(io.ComfyNode):
    """Starts (or reuses) worker processes for a pipe; Denoise and Refine on its output run on all of them."""

    @classmethod
    def define_schema(cls):
        from lingbot_core.distributed.layout import CFG_DEGREES  # the degrees the layout accepts

        return io.Schema(
            node_id="LingBotParallel",
            display_name="LingBot Parallel",
            category=CATEGORY,
            description="Runs Denoise on several devices: starts one worker process per extra device (each loads "
                        "its own copy of the DiT once and keeps it across prompts), joined with this process on "
                        "torch.distributed (NCCL on GPUs, gloo on CPU; the rendezvous listens on 127.0.0.1 only). "
                        "cfg branches 2 puts the prompt's and the negative's passes on two halves of the devices; ulysses shares "
                        "each DiT forward's sequence. The workers stop on LingBot Release, ComfyUI's Unload "
                        "models, and server exit. Connect its pipe to Denoise (T2V, T2I, TI2V), directly or through "
                        "LingBot Offload ('none' or 'auto'; other modes are refused on it) and LingBot LoRA (each "
                        "worker reads the same LoRA files). "
                        "Refine on it samples on the workers too (the MoE's refiner).",
            inputs=[
                Pipe.Input("pipe", tooltip="From LingBot Loader (offload none): its checkpoint is what the workers load"),
                io.String.Input("devices", default="cuda:0, cuda:1",
                                tooltip="One device per process, this one first (the pipe's device), e.g. "
                                        "'cuda:0, cuda:1, cuda:2, cuda:3', or GPU indices '0,1'; 'cpu, cpu' to try "
                                        "it without GPUs"),
                # the widget keeps its name `cfg` (saved workflows); its label says what it is
                Choice("cfg", options=[str(d) for d in CFG_DEGREES], default="1", display_name=CFG_LABEL,
                       tooltip="CFG branches across GPUs, not the guidance scale (that is Denoise's cfg). 1: every "
                               "device group computes both the prompt's and the negative's DiT passes. 2: the "
                               "prompt's pass on one half of the devices, the negative's on the other (about 2x "
                               "when Denoise's cfg > 1); needs an even device count"),
                io.Int.Input("ulysses", default=0, min=0, max=64,
                             tooltip="Devices sharing one DiT pass (sequence parallel); must divide the DiT's 16 "
                                     "attention heads. 0: the device count / cfg"),
                # last, and optional: a workflow saved before it keeps its values on their widgets
                Choice("fsdp", options=["off", "on"], default="off", optional=True,
                       tooltip="on: shard each DiT block's weights over the devices (FSDP2), so each holds about 1/N "
                               "of them (the MoE on several smaller GPUs); a block's weights are gathered just "
                               "before it runs. Needs plain bf16 DiT weights (not fp8/GGUF). This process then "
                               "loads its own copy of the DiT for the workers' group: the pipe without LingBot "
                               "Parallel keeps its whole one"),
            ],
            outputs=[Pipe.Output(display_name="pipe", tooltip="The pipe, running Denoise and Refine on the workers too")],
        )

    @classmethod
    def execute(cls, pipe, devices, cfg="1", ulysses=0, fsdp="off"):
        from lingbot_core.worker_pool.pool import pool_for, tag
        from lingbot_core.worker_pool.spec import PoolSpec

        if fsdp not in ("off", "on"):
            raise ValueError(f"fsdp must be 'off' or 'on', got {fsdp!r}")
        spec = PoolSpec.make(pipe, devices, int(cfg), int(ulysses), fsdp=fsdp == "on")  # checked before any process starts
        pool = pool_for(spec)
        pool.start()  # now, so a bad device shows here; a no-op while the same spec's workers run
        runtime.track_pool(pool)
        return io.NodeOutput(tag(pipe, pool))
