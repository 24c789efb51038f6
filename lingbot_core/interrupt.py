"""Cancellation points (and progress ticks) inside model work.

A node graph must be cancellable mid-stage: a denoise step, a text-encoder forward or a VAE decode
can each take many seconds. Callers install a checker (a function that raises to cancel) with
`interrupt_checker(fn)`; every stage then calls it on entry and before each transformer block,
encoder layer and VAE block, through `lingbot.interrupt` hooks (`lingbot_core.hooks`) that live only for
the stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from . import hooks
from .components import DITS

Checker = Callable[[], None]
_CHECKER: ContextVar[Checker | None] = ContextVar("lingbot_interrupt_checker", default=None)
Ticker = Callable[[], None]
_TICKER: ContextVar[Ticker | None] = ContextVar("lingbot_work_ticker", default=None)
_IN_CHECK: ContextVar[bool] = ContextVar("lingbot_in_interrupt_check", default=False)
BUILD_CHECK_EVERY = 0.25
"""Seconds between two cancellation points inside a skeleton build (`interruptible_build`)."""


@contextmanager
def work_ticker(tick: Ticker | None) -> Iterator[None]:
    """Call `tick()` at every cancellation point (each transformer block, encoder layer and VAE
    block that runs): progress for stages that have no steps (text encode, decode)."""
    token = _TICKER.set(tick)
    try:
        yield
    finally:
        _TICKER.reset(token)


@contextmanager
def interrupt_checker(check: Checker | None) -> Iterator[None]:
    token = _CHECKER.set(check)
    try:
        yield
    finally:
        _CHECKER.reset(token)


def check_interrupt() -> None:
    check = _CHECKER.get()
    if check is not None:
        check()


@contextmanager
def interruptible_build() -> Iterator[list[BaseException]]:
    """Cancellation points while a model's skeleton is built (`from_config` on meta, before any weight is
    read): the checker runs when a parameter is registered and `BUILD_CHECK_EVERY` seconds have passed
    since the build began or the last check (a build registers thousands per second), so a big
    skeleton stops within a second of a cancel and a small one never calls the checker. Yields a list that holds the cancel's exception when
    one was raised, so a caller that wraps the library's own build errors can let a cancel through."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    raised: list[BaseException] = []
    check = _CHECKER.get()
    last = [time.monotonic()]

    def hook(module: torch.nn.Module, name: str, param: object) -> None:
        # this build's thread and checker only, and never from inside a check (a checker that itself
        # loads a component would build a skeleton, and check again, without end)
        if check is None or _CHECKER.get() is not check or _IN_CHECK.get():
            return
        now = time.monotonic()
        if now - last[0] < BUILD_CHECK_EVERY:  # a small model builds in milliseconds and is never asked
            return
        last[0] = now
        token = _IN_CHECK.set(True)
        try:
            check()
        except BaseException as err:
            raised.append(err)
            raise
        finally:
            _IN_CHECK.reset(token)

    handle = register_module_parameter_registration_hook(hook) if check is not None else None
    try:
        yield raised
    finally:
        if handle is not None:
            handle.remove()


def _work_units(name: str, module: torch.nn.Module) -> list[torch.nn.Module]:
    if name in DITS:
        return list(getattr(module, "blocks", []))
    if name == "text_encoder":
        inner = getattr(module, "model", None)
        units = list(getattr(getattr(inner, "language_model", None), "layers", []))
        return units + list(getattr(getattr(inner, "visual", None), "blocks", []))
    if name == "light_vae":  # its first layer runs once per chunk of latent frames
        entry = getattr(module, "entry", None)
        return [entry] if isinstance(entry, torch.nn.Module) else []
    if name == "vae":
        units = []
        for part in ("encoder", "decoder"):
            sub = getattr(module, part, None)
            for blocks in ("down_blocks", "up_blocks"):
                units += list(getattr(sub, blocks, []))
            if getattr(sub, "mid_block", None) is not None:
                units.append(sub.mid_block)
        return units
    return []


@hooks.named("lingbot.interrupt", "a cancellation (and progress) point before a block, encoder layer or VAE "
             "block, for one stage")
class Checkpoint(hooks.Hook):
    def __init__(self, check: Checker | None, tick: Ticker | None = None):
        super().__init__()
        self.check, self.tick = check, tick

    def pre_forward(self, module, *args, **kwargs):
        if self.check is not None:
            self.check()
        if self.tick is not None:
            self.tick()
        return args, kwargs


@contextmanager
def checkpoints(components: dict[str, object]) -> Iterator[None]:
    """Install cancellation points on the components' blocks for the duration of a stage."""
    check, tick = _CHECKER.get(), _TICKER.get()
    if check is None and tick is None:
        yield
        return
    if check is not None:
        check()
    units = [unit for name, module in components.items() if isinstance(module, torch.nn.Module)
             for unit in _work_units(name, module) if hooks.find(unit, Checkpoint.name) is None]
    try:
        for unit in units:
            hooks.attach(unit, Checkpoint(check, tick))
        yield
    finally:
        for unit in units:
            hooks.detach(unit, Checkpoint.name)


def decode_units(handle: object, latent_frames: int) -> int:
    """Cancellation points one untiled VAE decode passes: the Wan decoder runs once per latent frame,
    its mid block and each up block once per run (tiling multiplies this by the tiles)."""
    config = handle.vae_config()  # type: ignore[attr-defined]
    up_blocks = len(config.get("dim_mult", (1, 2, 4, 4)) if hasattr(config, "get") else (1, 2, 4, 4))
    return int(latent_frames) * (1 + up_blocks)


def text_units(handle: object, forwards: int, image: bool) -> int:
    """Cancellation points a text encode passes: each forward runs every language layer (and, with an
    image, every vision block). Read from the loaded encoder, else its config, else Qwen3-VL-4B's."""
    import json

    shared = handle.shared
    module = shared.loaded.get("text_encoder")
    if isinstance(module, torch.nn.Module):
        inner = getattr(module, "model", None)
        layers = len(getattr(getattr(inner, "language_model", None), "layers", []))
        vision = len(getattr(getattr(inner, "visual", None), "blocks", []))
    else:
        layers, vision = 36, 24
        folder = shared.folder
        try:
            config = json.loads((folder / "text_encoder" / "config.json").read_text()) if folder else {}
            layers = int(config.get("text_config", {}).get("num_hidden_layers", layers))
            vision = int(config.get("vision_config", {}).get("depth", vision))
        except (OSError, ValueError, TypeError, AttributeError):
            pass
    return int(forwards) * (layers + (vision if image else 0))
