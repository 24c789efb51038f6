"""The ComfyUI bridge (nodes/runtime.py) against ComfyUI's real `comfy.model_management`, not a stand-in:
its `free_memory` (which passes our entries the number of bytes still to free, or None under
--disable-smart-memory), its "Unload models" (`unload_all_models`), its interrupt flag and its device.

The module comes from a ComfyUI checkout named by LINGBOT_COMFYUI_DIR (or an importable `comfy`); no
package on the index ships it, so where neither is there these tests skip and say so. It runs as under
`--cpu` (no GPU here); ComfyUI's `comfy.utils` (progress bars) needs ComfyUI's own requirements, so a
small stand-in of it is used. tests/test_comfy_bridge.py covers the rest with stand-ins.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import pytest
import torch

COMFYUI_ENV = "LINGBOT_COMFYUI_DIR"
CPU = torch.device("cpu")


@pytest.fixture
def real_mm(monkeypatch):
    """ComfyUI's real model_management, imported as under `--cpu`; removed from sys.modules afterwards
    (outside these tests the pack must not see a ComfyUI)."""
    root = os.environ.get(COMFYUI_ENV)
    if root:
        if not (Path(root) / "comfy" / "model_management.py").is_file():
            pytest.fail(f"{COMFYUI_ENV}={root} holds no comfy/model_management.py")
        monkeypatch.syspath_prepend(root)
    before = set(sys.modules)
    try:
        found = importlib.util.find_spec("comfy.model_management")
    except ImportError:
        found = None
    if found is None:
        pytest.skip(f"the real comfy.model_management is not here: set {COMFYUI_ENV} to a ComfyUI checkout "
                    "(no package on the index ships it)")
    try:
        cli_args = importlib.import_module("comfy.cli_args")
        cli_args.args.cpu = True  # this machine has no GPU: ComfyUI's --cpu
        mm = importlib.import_module("comfy.model_management")
    except ImportError as exc:
        _forget(before)
        pytest.skip(f"ComfyUI's model_management needs a package missing here: {exc}")
    utils = types.ModuleType("comfy.utils")  # the real one needs ComfyUI's requirements (einops...)
    utils.ProgressBar = type("ProgressBar", (), {"__init__": lambda self, total: None,
                                                 "update_absolute": lambda self, value, total=None, preview=None: None})
    monkeypatch.setitem(sys.modules, "comfy.utils", utils)
    mm.current_loaded_models.clear()
    yield mm
    mm.current_loaded_models.clear()
    mm.interrupt_current_processing(False)
    _forget(before)


def _forget(before: set[str]) -> None:
    for name in set(sys.modules) - before:
        if name == "comfy" or name.startswith("comfy."):
            del sys.modules[name]


def _more_than_free(mm) -> float:
    """A request this machine cannot meet: ComfyUI then asks its entries for memory (smart memory)."""
    return 2.0 * mm.get_total_memory(CPU) + 1


def _resident_pipe():
    """A pipe from the Loader whose text encoder stays resident on its device after a stage."""
    from lingbot_core import stages
    from lingbot_core.offload import configure_offload
    from lingbot_core.placement import door
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    handle, = NODE_CLASS_MAPPINGS["LingBotLoader"].execute("tiny (built-in dense)", "auto", device="cpu").args
    view = configure_offload(handle, "none")
    stages.encode_prompt(view, "a red paper boat")
    assert door.resident_components(view)
    return view


def test_the_real_free_memory_asks_for_a_number_of_bytes_and_our_components_go(real_mm, monkeypatch):
    from lingbot_core.placement import door
    from lingbot_nodes import runtime

    assert runtime.in_comfy() and runtime.execution_device("auto") == real_mm.get_torch_device() == CPU
    asked = []
    unload = runtime.ResidentStandIn.model_unload
    monkeypatch.setattr(runtime.ResidentStandIn, "model_unload",
                        lambda self, memory_to_free=None, unpatch_weights=True:
                        asked.append(memory_to_free) or unload(self, memory_to_free, unpatch_weights))
    view = _resident_pipe()
    ours = [m for m in real_mm.current_loaded_models if isinstance(m, runtime.ResidentStandIn)]
    assert len(ours) == 1 and ours[0].real_model() is view.shared and ours[0].model_memory() > 0
    need = _more_than_free(real_mm)
    runtime._free_comfy_memory("transformer", None, CPU, need)  # our listener, before a component moves
    assert len(asked) == 1 and isinstance(asked[0], (int, float)) and 0 < asked[0] <= need + real_mm.minimum_inference_memory()
    assert not door.resident_components(view) and real_mm.current_loaded_models == []

    _resident_pipe()  # again, and ComfyUI's "Unload models"
    real_mm.unload_all_models()
    assert asked[-1] >= runtime.UNLOAD_ALL_BYTES and real_mm.current_loaded_models == []


class _Pool:
    def __init__(self):
        self.on_start, self.releases = [], 0

    def release(self):
        self.releases += 1


@pytest.mark.parametrize("smart", [True, False], ids=["smart-memory", "disable-smart-memory"])
def test_a_worker_pool_stops_only_on_unload_models(real_mm, monkeypatch, smart):
    """A request for some memory leaves LingBot Parallel's workers alone; "Unload models" stops them, also
    under --disable-smart-memory, where ComfyUI passes no amount (None) to every entry it asks."""
    from lingbot_nodes import runtime

    monkeypatch.setattr(real_mm, "DISABLE_SMART_MEMORY", not smart)
    pool = _Pool()
    runtime.track_pool(pool)
    asked = []
    unload = runtime.PoolStandIn.model_unload
    monkeypatch.setattr(runtime.PoolStandIn, "model_unload", lambda self, memory_to_free=None, unpatch_weights=True:
                        asked.append(memory_to_free) or unload(self, memory_to_free, unpatch_weights))
    real_mm.free_memory(_more_than_free(real_mm), CPU)
    assert pool.releases == 0 and len(real_mm.current_loaded_models) == 1
    assert (asked[0] is None) == (not smart)  # what the real ComfyUI passes in each case
    real_mm.unload_all_models()
    assert pool.releases == 1 and real_mm.current_loaded_models == []


def test_comfyuis_cancel_reaches_our_interrupt_check(real_mm):
    from lingbot_nodes import runtime

    check = runtime.interrupt_check()
    check()  # not cancelled: nothing happens
    real_mm.interrupt_current_processing(True)
    with pytest.raises(real_mm.InterruptProcessingException):
        check()
