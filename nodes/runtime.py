"""The one adapter between our nodes and their host: ComfyUI when it is there, our engine otherwise.

Progress, interruption, the output folder, model folders and memory cooperation all come through
here, so node classes stay thin and import neither ComfyUI nor the engine directly.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lingbot_core.interrupt import interrupt_checker, work_ticker


def in_comfy() -> bool:
    return "comfy.model_management" in sys.modules or "comfy" in sys.modules and "folder_paths" in sys.modules


def _comfy(module: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        return None


def interrupt_check() -> Callable[[], None]:
    """A function that raises when the user cancelled (ComfyUI's flag, or our engine's)."""
    mm = _comfy("comfy.model_management") if in_comfy() else None
    if mm is not None:
        return mm.throw_exception_if_processing_interrupted
    from lingbot_core.workflow import check_interrupt

    return check_interrupt


class Progress:
    """Per-step progress: ComfyUI's ProgressBar, our engine's reporter, or a terminal bar."""

    def __init__(self, total: int, label: str = "lingbot"):
        self.total = total
        self._bar = None
        self._tqdm = None
        utils = _comfy("comfy.utils") if in_comfy() else None
        if utils is not None:
            self._bar = utils.ProgressBar(total)
            return
        from lingbot_core.workflow import current_context

        self._engine = current_context()
        if self._engine is None or self._engine.progress is None:
            from tqdm.auto import tqdm

            self._tqdm = tqdm(total=total, desc=label, leave=False, disable=not sys.stderr.isatty())

    def update(self, value: int, total: int | None = None, preview: object = None) -> None:
        total = total or self.total
        if self._bar is not None:
            if preview is not None:
                self._bar.update_absolute(value, total, preview)
            else:
                self._bar.update_absolute(value, total)
        elif self._tqdm is not None:
            self._tqdm.total = total
            self._tqdm.n = value
            self._tqdm.refresh()
        else:
            from lingbot_core.workflow import report_progress

            report_progress(value, total)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()


# -- server paths in messages -----------------------------------------------------------------------------

def _named_folders() -> list[tuple[str, str]]:
    """(absolute folder, how a message names it), most specific first: ComfyUI's input/output/temp and
    models folders, then each model kind's folders outside them (extra_model_paths.yaml), by kind name."""
    folder_paths = _comfy("folder_paths") if in_comfy() else None
    if folder_paths is None:
        return []
    named: list[tuple[str, str]] = []
    for kind in ("input", "output", "temp"):
        try:
            named.append((str(getattr(folder_paths, f"get_{kind}_directory")()), kind))
        except (AttributeError, TypeError, OSError):
            continue
    models_dir = getattr(folder_paths, "models_dir", None)
    if models_dir:
        named.append((str(models_dir), "models"))
    for kind, (folders, _extensions) in sorted(getattr(folder_paths, "folder_names_and_paths", {}).items()):
        named += [(str(folder), kind) for folder in folders]
    base = getattr(folder_paths, "base_path", None)
    if base:
        named.append((str(base), "ComfyUI"))
    spelled: list[tuple[str, str]] = []
    for folder, label in named:
        for form in dict.fromkeys((os.path.normpath(folder), os.path.realpath(folder))):
            if len(form) > 1:
                spelled.append((form, label))
    return spelled


def shown_path(path: str | os.PathLike) -> str:
    """A server path as a message shows it to whoever queued the workflow: inside ComfyUI relative to the
    ComfyUI folder it lies in ('models/lingbot_video/x', 'input/cat.png'), else its last part only;
    headless (the user's own machine) as given."""
    text = os.fspath(path)
    named = _named_folders()
    if not named:
        return text
    for folder, label in named:
        if text == folder or text.startswith(folder + os.sep):
            rest = text[len(folder):].lstrip(os.sep)
            return Path(label, rest).as_posix() if rest else label
    return Path(text).name or text


def paths_shown_in(message: str) -> str:
    """`message` with each ComfyUI folder's absolute path replaced by its name (see `shown_path`)."""
    for folder, label in _named_folders():
        message = re.sub(re.escape(folder + os.sep), lambda _m, label=label: label + "/", message)
        message = re.sub(re.escape(folder) + r"(?![\w.-])", lambda _m, label=label: label, message)
    return message


@contextmanager
def server_paths_hidden() -> Iterator[None]:
    """Inside ComfyUI, an error raised in the block reads with ComfyUI's folders named, not spelled out
    (a shared server's layout is not the queuer's business; the server log keeps the traceback)."""
    try:
        yield
    except Exception as err:
        if in_comfy() and _comfy("folder_paths") is not None and err.args and isinstance(err.args[0], str):
            err.args = (paths_shown_in(err.args[0]), *err.args[1:])
        raise


@contextmanager
def node_work(total_steps: int = 0, label: str = "lingbot",
              previewer: Any = None, units: int = 0) -> Iterator[Callable[[int, int, object], None]]:
    """Run node work with cancellation points installed; yield a per-step callback for stages.
    `units` (work without steps: text encode, decode): the expected number of blocks/layers that run;
    the bar moves at each one (its total grows if the estimate was short). `previewer`: what turns a
    step's latents into a preview (`preview.previewer_for`), built by the node so this module, below the
    nodes, imports none of them."""
    check = interrupt_check()
    bar = Progress(total_steps or units, label) if total_steps or units else None
    done = [0]

    every = max(1, units // 50)  # at most ~50 updates: a headless log gets lines, not hundreds

    def tick() -> None:
        done[0] += 1
        if done[0] == 1 or done[0] % every == 0 or done[0] >= units:
            bar.update(done[0], max(units, done[0]))
    def on_step(step: int, total: int, latents: object) -> None:
        image = None
        if previewer is not None:
            image = previewer.comfy_preview(latents)
            previewer.write(step, latents, _node_id())
        if bar is not None:
            bar.update(step, total, image)
        check()

    check()
    try:  # a component loading here (lazily) names ComfyUI's folders in its errors, not the server's paths
        with interrupt_checker(check), work_ticker(tick if units and not total_steps else None), \
                server_paths_hidden():
            yield on_step
    finally:
        if bar is not None:
            bar.close()


# -- devices, dtypes and attention kernels ---------------------------------------------------------

#: a diffusers attention backend whose name holds one of these runs on CUDA only (flash, _flash_3,
#: flash_varlen, sage and its _sage_* kernels, xformers, PyTorch's flash/efficient/cuDNN SDPA kernels)
_CUDA_ONLY_WORDS = ("flash", "sage", "xformers", "_native_efficient", "cudnn", "aiter")
_ATTENTION_PACKAGES = {"flash": "flash_attn", "sage": "sageattention", "xformers": "xformers",
                       "_flash_3": "flash_attn_interface"}


def execution_device(choice: str = "auto"):
    """The torch device a new handle runs on: ComfyUI's own device for `auto` inside ComfyUI (it
    honours `--cpu`, `--cuda-device`, `--directml`...), else CUDA when available, else the CPU."""
    import torch

    if choice and choice != "auto":
        return torch.device(choice)
    mm = _comfy("comfy.model_management") if in_comfy() else None
    if mm is not None:
        return torch.device(mm.get_torch_device())
    from lingbot_core.handle import default_device

    return default_device()


def device_problem(choice: str) -> str | None:
    """Why the Loader's `device` cannot be used here, or None."""
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but no GPU is visible"
        return (f"device 'cuda' was chosen, but PyTorch {torch.__version__} ({build}) has no CUDA device; "
                "choose auto or cpu")
    return None


def is_diffusers_backend(name: str) -> bool:
    """Whether `name` is one of diffusers' attention backends (installed here or not)."""
    try:
        from diffusers.models import attention_dispatch

        attention_dispatch.AttentionBackendName(name)
    except (ImportError, ValueError):
        return False
    return True


def attention_problem(name: str, device: str = "auto") -> str | None:
    """Why the Loader's `attention` kernel cannot run, or None: the package it needs is missing
    (diffusers' own requirement check), or it needs a CUDA device the run will not have. The cheap
    check validation can make; whether the backend runs on the device is tried when the handle opens
    (`lingbot_core.kernels.probe`), and masked calls go to SDPA on backends that take no mask."""
    if name in ("default", None, "sparse"):  # sparse: ours, its eager path runs anywhere (kernels' trial)
        return None
    try:
        from diffusers.models import attention_dispatch

        backend = attention_dispatch.AttentionBackendName(name)
    except (ImportError, ValueError):
        return f"unknown attention backend {name!r}"
    check = getattr(attention_dispatch, "_check_attention_backend_requirements", None)
    if check is not None:
        try:
            check(backend)
        except (RuntimeError, ImportError) as exc:
            return f"attention '{name}' cannot be used here: {exc}"
    elif name in _ATTENTION_PACKAGES:
        import importlib.util

        if importlib.util.find_spec(_ATTENTION_PACKAGES[name]) is None:
            return f"attention '{name}' needs the `{_ATTENTION_PACKAGES[name]}` package, which is not installed"
    if any(word in name for word in _CUDA_ONLY_WORDS) and device_problem(device or "auto") is None:
        if execution_device(device).type != "cuda":
            return f"attention '{name}' runs on CUDA only, but the run uses {execution_device(device)}; choose default"
    return None


def comfy_dtypes() -> dict:
    """Inside ComfyUI: the component dtypes its command-line flags ask for (`--bf16-unet`,
    `--fp16-text-enc`, `--force-fp32`, ...); empty when none is given or outside ComfyUI."""
    import torch

    cli = _comfy("comfy.cli_args") if in_comfy() else None
    args = getattr(cli, "args", None)
    if args is None:
        return {}
    chosen: dict = {}
    if getattr(args, "force_fp32", False):
        return {"transformer": torch.float32, "refiner": torch.float32, "text_encoder": torch.float32}
    for flag, dtype in (("fp32_unet", torch.float32), ("bf16_unet", torch.bfloat16), ("fp16_unet", torch.float16)):
        if getattr(args, flag, False):
            chosen.update(transformer=dtype, refiner=dtype)
    for flag, dtype in (("fp32_text_enc", torch.float32), ("bf16_text_enc", torch.bfloat16),
                        ("fp16_text_enc", torch.float16)):
        if getattr(args, flag, False):
            chosen["text_encoder"] = dtype
    return chosen


def _node_id() -> str | None:
    """The id of the node our engine is running (None inside ComfyUI or outside a run)."""
    from lingbot_core.workflow.context import current_node_id

    return current_node_id()


def log_run_summary(pipe, frames) -> None:
    """One INFO line per run (after the decode that ends it): what came out and where the
    components are. The per-stage lines are DEBUG."""
    import logging

    logger = logging.getLogger("lingbot_nodes")
    if logger.isEnabledFor(logging.INFO):
        from lingbot_core.placement.door import memory_report

        shape = "x".join(str(int(n)) for n in tuple(frames.shape)[:3])
        logger.info("lingbot: decoded %s frames (T x H x W); %s", shape, memory_report(pipe).one_line())


def output_dir() -> Path:
    folder_paths = _comfy("folder_paths") if in_comfy() else None
    if folder_paths is not None:
        return Path(folder_paths.get_output_directory())
    return Path(os.environ.get("LINGBOT_OUTPUT_DIR", "output"))


def model_roots() -> list[Path]:
    """Folders whose sub-folders are offered as checkpoints: inside ComfyUI only its `lingbot_video`
    folders (models/lingbot_video/ and extra_model_paths.yaml's); headless $LINGBOT_MODELS_DIR and
    ./models/lingbot_video."""
    folder_paths = _comfy("folder_paths") if in_comfy() else None
    if folder_paths is not None:
        if "lingbot_video" not in folder_paths.folder_names_and_paths:
            folder_paths.add_model_folder_path("lingbot_video", os.path.join(folder_paths.models_dir, "lingbot_video"))
        # only ComfyUI's folders: a path relative to the server's working directory is no folder of its
        return [Path(p) for p in folder_paths.get_folder_paths("lingbot_video")]
    roots: list[Path] = []
    env = os.environ.get("LINGBOT_MODELS_DIR")
    if env:
        roots += [Path(p) for p in env.split(os.pathsep) if p]
    roots.append(Path("models") / "lingbot_video")
    return roots


def _device_index(device) -> int | None:
    if device.index is not None or device.type != "cuda":
        return device.index
    import torch

    return torch.cuda.current_device()


def comfy_device_spellings(mm, device) -> list:
    """`device` as ComfyUI's loaded models spell it. ComfyUI compares devices with `==`, and
    `cuda` != `cuda:0` in torch although both name the same GPU: a request for the one would free
    nothing loaded on the other. So: the indexed form ComfyUI itself uses, plus every other spelling
    of the same device found among its loaded models."""
    import torch

    device = torch.device(device)
    index = _device_index(device)
    spellings = [torch.device(device.type, index) if index is not None else device]
    for entry in list(getattr(mm, "current_loaded_models", [])):
        other = getattr(entry, "device", None)
        if isinstance(other, torch.device) and other.type == device.type and other not in spellings \
                and _device_index(other) == index:
            spellings.append(other)
    return spellings


def _free_comfy_memory(name, module, device, nbytes) -> None:
    mm = _comfy("comfy.model_management")
    if mm is None or not nbytes:
        return
    need = nbytes + mm.minimum_inference_memory()
    for spelling in comfy_device_spellings(mm, device):
        mm.free_memory(need, spelling)


class ResidentStandIn:
    """Our components that stay on the GPU between stages, as one entry of ComfyUI's
    `current_loaded_models`: its free-memory requests, the "Unload models" button and its
    out-of-memory handling then move ours off the GPU too (the next stage brings back what it needs).

    It speaks the part of ComfyUI's LoadedModel protocol that `free_memory`, `cleanup_models` and
    `unload_all_models` use. `currently_used` stays False so ComfyUI never tries to reload it.
    """

    def __init__(self, shared, device):
        import weakref

        self._shared = weakref.ref(shared)
        self.device = device
        self.currently_used = False
        self.model_finalizer = None

    @property
    def model(self):
        return self

    def real_model(self):
        return self._shared()  # None once the components are gone: ComfyUI then drops this entry

    def is_dead(self) -> bool:
        return False

    def _resident_bytes(self) -> int:
        from lingbot_core.placement.door import resident_bytes

        shared = self._shared()
        return 0 if shared is None else resident_bytes(shared)

    def model_memory(self) -> int:
        return self._resident_bytes()

    model_loaded_memory = model_memory
    model_size = model_memory
    loaded_size = model_memory

    def model_offloaded_memory(self) -> int:
        return 0

    def model_memory_required(self, device) -> int:
        return 0

    def model_use_more_vram(self, extra_memory, force_patch_weights=False) -> int:
        return 0

    # What ComfyUI's free_memory reads of every entry since its dynamic VRAM (comfy-aimdo, 2026): ours is
    # no dynamic model (it gives way to us in full), holds no ComfyUI-pinned RAM and no mmap'd weights.
    def is_dynamic(self) -> bool:
        return False

    def partially_unload_ram(self, ram_to_unload=None) -> int:
        return 0

    def model_mmap_residency(self, free=False) -> tuple[int, int]:
        return 0, 0

    def loaded_ram_size(self) -> int:
        return 0

    def model_unload(self, memory_to_free=None, unpatch_weights=True) -> bool:
        from lingbot_core.placement.door import evict

        shared = self._shared()
        if shared is not None:
            evict(shared)
        return True

    def is_clone(self, other) -> bool:
        return other is self

    def __eq__(self, other) -> bool:
        return getattr(other, "model", None) is self

    __hash__ = object.__hash__


def _track_resident(shared, device) -> None:
    """After a stage: make sure ComfyUI knows about what we keep on its device."""
    from lingbot_core.placement.door import resident_bytes

    mm = _comfy("comfy.model_management")
    if mm is None or not resident_bytes(shared):
        return
    device = comfy_device_spellings(mm, device)[0]  # ComfyUI compares devices with their index
    for entry in mm.current_loaded_models:
        if isinstance(entry, ResidentStandIn) and entry.real_model() is shared:
            return
    mm.current_loaded_models.append(ResidentStandIn(shared, device))


class PoolStandIn(ResidentStandIn):
    """A LingBot Parallel worker pool as an entry of `current_loaded_models`, so that ComfyUI's "Unload
    models" (an unload-everything request) stops its workers. A request for some memory on this device
    leaves it alone: the workers hold their memory on the other devices, so stopping them frees nothing
    here and would cost a reload of every worker's DiT."""

    def __init__(self, pool, device):
        import weakref

        self._pool = weakref.ref(pool)
        self.device = device
        self.currently_used = False
        self.model_finalizer = None

    def real_model(self):
        return self._pool()

    def _resident_bytes(self) -> int:
        return 0

    def model_unload(self, memory_to_free=None, unpatch_weights=True) -> bool:
        if not _unloads_everything(memory_to_free):
            return False
        pool = self._pool()
        if pool is not None:
            pool.release()
        return True


UNLOAD_ALL_BYTES = 1e20  # ComfyUI's unload_all_models asks for 1e30 bytes


def _unloads_everything(memory_to_free) -> bool:
    """Whether ComfyUI's request to free memory is "Unload models" (`unload_all_models`). With smart memory
    on, the amount says it. With `--disable-smart-memory`, ComfyUI asks every model for all its memory at
    every model load (None, or 1e32 in newer releases), so the amount says nothing: the request is an
    unload-all only when `unload_all_models` made it (looked up on the call stack, a few frames up)."""
    mm = _comfy("comfy.model_management")
    if mm is None or not getattr(mm, "DISABLE_SMART_MEMORY", False):
        return memory_to_free is None or memory_to_free >= UNLOAD_ALL_BYTES
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            break
        if frame.f_code.co_name == "unload_all_models" and frame.f_globals.get("__name__") == mm.__name__:
            return True
        frame = frame.f_back
    return False


def track_pool(pool) -> None:
    """Inside ComfyUI: list a started worker pool so "Unload models" stops it (once per pool), and list
    it again whenever its workers start anew: "Unload models" drops the entry, and a later prompt whose
    LingBot Parallel node ComfyUI serves from its cache restarts the same pool without running the node."""
    hooks = getattr(pool, "on_start", None)
    if hooks is not None and track_pool not in hooks:
        hooks.append(track_pool)
    mm = _comfy("comfy.model_management")
    if mm is None:
        return
    if any(isinstance(e, PoolStandIn) and e.real_model() is pool for e in mm.current_loaded_models):
        return
    device = comfy_device_spellings(mm, mm.get_torch_device())[0]
    mm.current_loaded_models.append(PoolStandIn(pool, device))


def install_memory_cooperation(handle: Any) -> Any:
    """Inside ComfyUI: free ComfyUI's models before this handle's components move onto the GPU, and let
    ComfyUI's memory requests free them. The listeners are the handle's own (`door.add_listeners`).
    Returns the handle."""
    from lingbot_core.placement import door

    if in_comfy():
        door.add_listeners(handle, memory=_free_comfy_memory, settle=_track_resident, free=comfy_free_bytes)
    return handle


GiB = 1024 ** 3


def dynamic_vram_headroom() -> int:
    """Bytes ComfyUI's dynamic VRAM (comfy-aimdo) keeps free when it is on (`--vram-headroom`, GB): our
    allocations taking them would only make it page ComfyUI's weights out again. 0 when it is off."""
    memory_management = _comfy("comfy.memory_management")
    if not getattr(memory_management, "aimdo_enabled", False):
        return 0
    cli = _comfy("comfy.cli_args")
    headroom = getattr(getattr(cli, "args", None), "vram_headroom", None)
    try:
        return max(int(float(headroom or 0) * GiB), 0)
    except (TypeError, ValueError):
        return 0


def comfy_free_bytes(device) -> int:
    """Free bytes on `device` as ComfyUI reads them (its `get_free_memory`: the driver's free bytes plus
    torch's idle cache, and whatever its allocator counts under dynamic VRAM), less dynamic VRAM's
    headroom. Falls back to the driver's figure when ComfyUI has no answer."""
    from lingbot_core.placement.door import free_accelerator_bytes

    mm = _comfy("comfy.model_management")
    reader = getattr(mm, "get_free_memory", None)
    free = None
    if reader is not None:
        try:
            free = int(reader(comfy_device_spellings(mm, device)[0]))
        except Exception:  # an older or patched ComfyUI: the driver's figure is still right
            free = None
    if free is None:
        free = free_accelerator_bytes(device)
    return max(free - dynamic_vram_headroom(), 0)
