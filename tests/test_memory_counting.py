"""Memory counted as the GPU and the host count it (issue 30, item 3), on a CPU through a fake CUDA
device (`fake_accelerator.FakeCuda`: torch.cuda's counters and `mem_get_info` as the test sets them):
free VRAM with torch's reserved-but-unused bytes, pinned host RAM with its power-of-two rounding,
a LoRA change under `none` without a host round trip, and the measured peak next to the estimate."""

from __future__ import annotations

import torch
from fake_accelerator import FakeCuda

from lingbot_core.handle import PipelineHandle
from lingbot_core.memory import Geometry, GiB, ModelSizes, host_bytes
from lingbot_core.placement import door, estimate
from lingbot_core.placement.modes.group import pin_in_place

CUDA = torch.device("cuda")


def _open(fixtures_root, name="tiny-dense"):
    return PipelineHandle.open(fixtures_root / "models" / name, device="cpu")


# -- free VRAM ------------------------------------------------------------------------------------------

def test_free_vram_counts_what_torch_holds_reserved_but_unused(monkeypatch):
    FakeCuda(free=2 * GiB, reserved=10 * GiB, allocated=3 * GiB).install(monkeypatch)
    assert door.free_accelerator_bytes(CUDA) == 2 * GiB + 7 * GiB


def test_auto_keeps_the_fast_mode_after_earlier_stages_left_blocks_cached(fixtures_root, monkeypatch):
    """The driver reports little free because torch's cache holds an earlier stage's blocks: `auto` counts
    them (it used to read `mem_get_info` alone and picked a slower mode, or none fitting)."""
    handle = _open(fixtures_root)
    settings = handle.with_offload("auto", height=32, width=32, num_frames=5).offload
    need = estimate.estimate_peak("none", estimate.ModelSizes.from_handle(handle),
                                  estimate.geometry_from(dict(settings.options), "dense", None))
    FakeCuda(free=need // 2, reserved=2 * need + estimate.RESERVE_BYTES, allocated=0).install(monkeypatch)
    concrete, choice = door.resolve(handle.shared, settings, CUDA)
    assert concrete.mode == "none" and choice.fits
    assert choice.budget == need // 2 + 2 * need + estimate.RESERVE_BYTES


# -- pinned host RAM ------------------------------------------------------------------------------------

def test_pinned_bytes_round_each_tensor_up_to_a_power_of_two():
    assert estimate.pinned_bytes([1, 2, 3, 4, 5, 1000, 1024, 1025, 0]) == 1 + 2 + 4 + 4 + 8 + 1024 + 1024 + 2048
    module = torch.nn.Linear(24, 10, bias=True)  # 240 + 10 float32 values: 960 and 40 bytes
    assert estimate.module_pinned_bytes(module) == 1024 + 64


def _sizes(**pinned):
    return ModelSizes(text_encoder=8 * GiB, transformer=3 * GiB, vae=GiB // 2, hidden=2048, depth=30,
                      intermediate=6144, largest_block=GiB // 10, text_largest_layer=GiB // 5, text_head=GiB // 4,
                      **pinned)


def test_group_counts_its_pinned_copies_at_their_rounded_size():
    exact = _sizes(pinned_transformer=4 * GiB, pinned_text_encoder=11 * GiB, pinned_refiner=0)
    in_flight = GiB // 4  # the largest tensor held twice while it is pinned: the text embedding here
    assert host_bytes("group", exact) == 4 * GiB + 11 * GiB + GiB // 2 + in_flight
    assert host_bytes("group", exact, pinned=False) == 8 * GiB + 3 * GiB + GiB // 2  # no stream: pageable
    assert host_bytes("model", exact) == host_bytes("group", exact, pinned=False)  # `model` pins nothing
    # offload_to disk: the DiT streams from its file; the text encoder is still grouped and pinned
    assert host_bytes("group", exact, "disk") == 11 * GiB + GiB // 2 + in_flight + exact.largest_block
    unknown = _sizes()  # no tensor sizes: the bound, twice the bytes
    assert host_bytes("group", unknown) == 2 * (8 + 3) * GiB + GiB // 2 + in_flight


def test_from_checkpoint_reads_the_pinned_sizes_from_the_headers(fixtures_root):
    handle = _open(fixtures_root)
    planned = ModelSizes.from_handle(handle)  # nothing loaded: from the safetensors headers
    for name in ("transformer", "text_encoder"):
        handle.component(name)
    loaded = ModelSizes.from_handle(handle)
    assert planned.pinned_transformer == loaded.pinned_transformer == estimate.module_pinned_bytes(
        handle.shared.loaded["transformer"])
    # the encoder's file and its module differ a little (a tied head, computed buffers), as its bytes do
    assert abs(planned.pinned_text_encoder - loaded.pinned_text_encoder) <= 0.05 * loaded.pinned_text_encoder
    assert loaded.pinned_transformer > loaded.transformer


def test_auto_does_not_pick_group_when_its_pinned_copies_do_not_fit_the_host():
    sizes = _sizes(pinned_transformer=4 * GiB, pinned_text_encoder=11 * GiB, pinned_refiner=0)
    geometry = Geometry(192, 320, 49)
    vram = estimate.estimate_peak("group", sizes, geometry) + estimate.RESERVE_BYTES  # group fits, model does not
    host = host_bytes("group", sizes, pinned=False) + GiB  # the pageable weights fit, the pinned copies do not
    from lingbot_core.placement.fit import choose_mode

    choice = choose_mode(sizes, geometry, vram, host_budget=host)
    assert choice.host[choice.mode] <= host
    assert (choice.mode, choice.offload_to) != ("group", "ram")


def test_pin_in_place_pins_each_tensor_once_so_diffusers_copies_nothing(monkeypatch):
    """Pinned one tensor at a time before diffusers builds its groups: its `pin_memory()` then returns
    the tensor itself, so the pageable and the pinned copy of a whole module never live side by side."""
    pinned: set[int] = set()
    calls = []

    def fake_pin(self, *args):
        if self.untyped_storage().data_ptr() in pinned:
            return self
        calls.append(self.shape)
        copy = self.clone()
        pinned.add(copy.untyped_storage().data_ptr())
        return copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: self.untyped_storage().data_ptr() in pinned)
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    block[1].weight = block[0].weight  # tied: pinned once
    pin_in_place(block)
    assert len(calls) == 3 and all(p.is_pinned() for p in block.parameters())
    from diffusers.hooks.group_offloading import ModuleGroup

    for p in block.parameters():
        assert ModuleGroup._to_cpu(p, False).data_ptr() == p.data_ptr()  # no second copy
