"""Memory counted as the GPU and the host count it (issue 30, item 3), on a CPU through a fake CUDA
device (`fake_accelerator.FakeCuda`: torch.cuda's counters and `mem_get_info` as the test sets them):
free VRAM with torch's reserved-but-unused bytes, pinned host RAM with its power-of-two rounding,
a LoRA change under `none` without a host round trip, and the measured peak next to the estimate."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fake_accelerator import FakeCuda

from lingbot_core.handle import PipelineHandle
from lingbot_core.placement import calibration, door, estimate, plan
from lingbot_core.placement.door import memory_report
from lingbot_core.placement.estimate import Geometry, GiB, ModelSizes, host_bytes
from lingbot_core.placement.modes.group import pin_in_place, unpin_in_place

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
    need = estimate.estimate_peak("none", plan.model_sizes(handle.shared),
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
    planned = plan.model_sizes(handle.shared)  # nothing loaded: from the safetensors headers
    for name in ("transformer", "text_encoder"):
        handle.component(name)
    loaded = plan.model_sizes(handle.shared)
    assert planned.pinned_transformer == loaded.pinned_transformer == estimate.module_pinned_bytes(
        handle.shared.loaded["transformer"])
    # the encoder's file and its module differ a little (a tied head, computed buffers), as its bytes do
    assert abs(planned.pinned_text_encoder - loaded.pinned_text_encoder) <= 0.05 * loaded.pinned_text_encoder
    assert loaded.pinned_transformer > loaded.transformer


def test_the_sizes_every_decision_reads_follow_what_is_loaded(fixtures_root):
    """`plan.model_sizes` is the one reading of the sizes (auto, the fit checks, a stage's estimate, the sampling
    figures): a component that loads counts its own tensors from then on, not the estimate read before it."""
    handle = _open(fixtures_root)
    before = plan.model_sizes(handle.shared)
    assert plan.model_sizes(handle.shared) is before  # read once while nothing changes
    smaller = torch.nn.Linear(4, 4)
    handle.shared.loaded["text_encoder"] = smaller
    after = plan.model_sizes(handle.shared)
    assert after.text_encoder == estimate.stored_bytes(smaller, include_meta=True) != before.text_encoder


def test_a_decision_that_needs_the_sizes_says_why_they_are_unknown(fixtures_root, monkeypatch):
    handle = _open(fixtures_root)

    def unreadable(*args, **kwargs):
        raise OSError("the transformer's header could not be read")

    monkeypatch.setattr(ModelSizes, "from_checkpoint", unreadable)
    assert plan.model_sizes(handle.shared) is None  # the estimates go on without sizes
    with pytest.raises(OSError, match="header could not be read"):
        plan.model_sizes(handle.shared, strict=True)
    with pytest.raises(OSError, match="header could not be read"):  # the fit check needs them
        door.check_handle(handle, Geometry(32, 32, 5), mode="model", vram_free=GiB, host_free=GiB)


def test_in_memory_components_without_a_dit_have_no_sizes_and_say_so():
    with pytest.raises(ValueError, match="size estimates need the DiT"):
        ModelSizes.from_modules({"vae": torch.nn.Linear(2, 2)})


def test_auto_does_not_pick_group_when_its_pinned_copies_do_not_fit_the_host():
    from lingbot_core.placement.fit import choose_mode

    sizes = _sizes(pinned_transformer=4 * GiB, pinned_text_encoder=11 * GiB, pinned_refiner=0)
    geometry = Geometry(192, 320, 49)
    vram = estimate.estimate_peak("group", sizes, geometry) + estimate.RESERVE_BYTES  # group fits, model does not
    travelling = host_bytes("group", sizes, pinned=None)  # pageable copies, the groups in flight pinned
    assert host_bytes("group", sizes, pinned=False) < travelling < host_bytes("group", sizes)
    choice = choose_mode(sizes, geometry, vram, host_budget=travelling + GiB)
    assert choice.host[choice.mode] <= travelling + GiB
    assert choice.mode == "sequential" and choice.offload_to == "ram"  # not group: its pinned copies do not fit
    roomy = choose_mode(sizes, geometry, vram, host_budget=host_bytes("group", sizes))
    assert (roomy.mode, roomy.offload_to) == ("group", "ram")


def test_the_fit_check_counts_group_as_its_options_pin(fixtures_root):
    handle = _open(fixtures_root).with_device("cuda")  # a label: nothing moves in a check
    sizes, geometry = plan.model_sizes(handle.shared), Geometry(32, 32, 5, ffn_chunk=None)
    for options, pinned in (({}, True), ({"use_stream": False}, False), ({"low_cpu_mem_usage": True}, None)):
        verdict = door.check_handle(handle.with_offload("group", **options), geometry, vram_free=64 * GiB,
                                    host_free=64 * GiB)
        assert verdict.host_needed == host_bytes("group", sizes, pinned=pinned), options


def _fake_pinning(monkeypatch) -> list:
    pinned: set[int] = set()
    calls, held = [], []  # held: the "pinned" copies stay alive, so no later tensor reuses their address

    def fake_pin(self, *args):
        if self.untyped_storage().data_ptr() in pinned:
            return self
        calls.append(self.shape)
        copy = self.clone()
        held.append(copy)
        pinned.add(copy.untyped_storage().data_ptr())
        return copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: self.untyped_storage().data_ptr() in pinned)
    return calls


def test_group_gives_its_pinned_copies_back_when_another_mode_takes_over(fixtures_root, monkeypatch):
    """Pinned memory is rounded up: once `group` lets go (a switch, auto's fallback to `sequential`), the
    weights go back to pageable copies, so the next mode holds what its host estimate counts."""
    from lingbot_core.placement.door import configure_offload

    _fake_pinning(monkeypatch)
    handle = _open(fixtures_root)
    handle.component("transformer")
    view = configure_offload(handle, "group", use_stream=False)
    dit = handle.shared.loaded["transformer"]
    pin_in_place(dit)  # what the install does with a stream (a CPU has none)
    assert all(p.is_pinned() for p in dit.parameters())
    with handle.shared.lock:  # a suspension (a LoRA change) reinstalls group: the pinned copies stay
        with handle.shared.placement.suspended(handle.shared.loaded, ["transformer"]):
            pass
    assert all(p.is_pinned() for p in dit.parameters())
    configure_offload(view, "model")
    assert not any(p.is_pinned() for p in dit.parameters())


def test_pin_in_place_pins_each_tensor_once_so_diffusers_copies_nothing(monkeypatch):
    """Pinned one tensor at a time before diffusers builds its groups: its `pin_memory()` then returns
    the tensor itself, so the pageable and the pinned copy of a whole module never live side by side."""
    calls = _fake_pinning(monkeypatch)
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    block[1].weight = block[0].weight  # tied: pinned once
    pin_in_place(block)
    assert len(calls) == 3 and all(p.is_pinned() for p in block.parameters())
    from diffusers.hooks.group_offloading import ModuleGroup

    for p in block.parameters():
        assert ModuleGroup._to_cpu(p, False).data_ptr() == p.data_ptr()  # no second copy
    values = [p.detach().clone() for p in block.parameters()]
    unpin_in_place(block)  # when group lets the module go: pageable again, the same values, still tied
    assert not any(p.is_pinned() for p in block.parameters()) and block[1].weight is block[0].weight
    assert all(torch.equal(p, v) for p, v in zip(block.parameters(), values))


# -- measured peaks and the calibration file ------------------------------------------------------------

@pytest.fixture
def calibration_file(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "calibration.json"
    monkeypatch.setenv(calibration.ENV, str(path))
    calibration.clear_measured()
    return path


def test_every_stage_on_cuda_records_its_peak_next_to_the_estimate(fixtures_root, monkeypatch, calibration_file,
                                                                   caplog):
    """The device is a label (the stage runs on the CPU) and torch.cuda's counters are the fake's."""
    fake = FakeCuda().install(monkeypatch)  # nothing allocated when the stage starts
    monkeypatch.setattr(calibration, "device_name", lambda device: fake.name)
    handle = _open(fixtures_root)
    geometry = Geometry(32, 32, 5)
    with caplog.at_level(logging.INFO, logger="lingbot_core.offload"):
        with door.stage(handle, "vae", phase="decode", geometry=geometry):
            fake.peak_allocated, fake.peak_reserved = 256 << 20, 384 << 20  # what the stage's work reached
    assert fake.resets == 1
    expected = estimate.estimate_peak("none", plan.model_sizes(handle.shared), geometry, ("decode",))
    peak = calibration.measured_peaks()[-1]
    assert (peak.stage, peak.device, peak.mode) == ("vae", fake.name, "none")
    assert (peak.estimate_bytes, peak.allocated_bytes, peak.reserved_bytes) == (expected, 256 << 20, 384 << 20)
    assert peak.ratio == (256 << 20) / expected > 1
    report = str(memory_report(handle))
    assert f"measured {peak.line()}" in report and f"estimate {expected / GiB:.2f} GiB" in peak.line()
    assert f"measured {peak.line()}" in caplog.text
    # filed: later estimates on this device and mode are never below the measurement
    assert calibration.load()[fake.name]["none"] == peak.ratio


def test_what_others_held_at_the_start_is_not_the_stages_peak(fixtures_root, monkeypatch, calibration_file):
    """In ComfyUI the process's peak includes the host's own models: only the stage's part is set against
    its estimate and filed (else one run next to a resident SDXL would inflate every later estimate)."""
    fake = FakeCuda(allocated=5 * GiB, reserved=6 * GiB).install(monkeypatch)  # the host's models
    monkeypatch.setattr(calibration, "device_name", lambda device: fake.name)
    handle = _open(fixtures_root)
    with door.stage(handle, "vae", phase="decode", geometry=Geometry(32, 32, 5)):
        fake.peak_allocated = 5 * GiB + (256 << 20)
    peak = calibration.measured_peaks()[-1]
    assert (peak.allocated_bytes, peak.foreign_bytes, peak.own_bytes) == (5 * GiB + (256 << 20), 5 * GiB, 256 << 20)
    assert calibration.load()[fake.name]["none"] == peak.ratio == (256 << 20) / peak.estimate_bytes
    assert "5.00 GiB of it held by others" in peak.line()


def test_a_refiner_stage_is_set_against_the_refine_phase(fixtures_root, monkeypatch, calibration_file):
    """Denoise enters the door with its request and no refine size: the refiner's stage is estimated at its own
    size (it raised, an empty phase list, before), and an unknown phase gives no estimate."""
    fake = FakeCuda().install(monkeypatch)
    monkeypatch.setattr(calibration, "device_name", lambda device: fake.name)
    handle = _open(fixtures_root)
    geometry = Geometry(32, 32, 5)
    with door.stage(handle, "transformer", phase="refine", label="refine", geometry=geometry):
        pass
    expected = estimate.estimate_peak("none", plan.model_sizes(handle.shared), replace(geometry, refine=(32, 32)),
                                      ("refine",))
    with door.stage(handle, "vae", phase="no such phase", label="odd"):
        pass
    by_stage = {p.stage: p for p in calibration.measured_peaks()}
    assert by_stage["refine"].estimate_bytes == expected
    assert by_stage["odd"].estimate_bytes is None and "no estimate" in by_stage["odd"].line()


def test_a_sampling_stage_is_set_against_the_request_as_it_ran(fixtures_root, monkeypatch, calibration_file):
    """What the door decides inside a sampling stage (CFG as one batch-2 forward, the FFN/MoE chunk) is what its
    peak is set against, and the memory report shows the chunk."""
    fake = FakeCuda().install(monkeypatch)
    monkeypatch.setattr(calibration, "device_name", lambda device: fake.name)
    handle = _open(fixtures_root)
    geometry = Geometry(32, 32, 5, cfg=True)
    with door.stage(handle, "transformer", phase="denoise", label="denoise", geometry=geometry):
        figures = door.sampling_figures(handle, "transformer", packed=False, cfg_batch="on", splits_cfg=False,
                                        set_on_model=8)
    assert figures.cfg_batch
    ran = replace(geometry, cfg_batch=True, ffn_chunk=figures.ffn_chunk)
    sizes = plan.model_sizes(handle.shared)
    expected = estimate.estimate_peak("none", sizes, ran, ("denoise",))
    assert expected != estimate.estimate_peak("none", sizes, replace(ran, cfg_batch=False), ("denoise",))
    assert calibration.measured_peaks()[-1].estimate_bytes == expected
    assert handle.shared.placement.ffn_chunks["transformer"] == (figures.ffn_chunk, figures.ffn_chunk_why)


def test_a_stage_on_the_cpu_measures_nothing(fixtures_root, calibration_file):
    handle = _open(fixtures_root)
    with door.stage(handle, "vae", phase="decode", geometry=Geometry(32, 32, 5)):
        pass
    assert calibration.measured_peaks() == [] and not calibration_file.exists()
    assert "measured" not in str(memory_report(handle))


def test_calibration_keeps_the_largest_ratio_per_device_and_mode(calibration_file):
    assert calibration.factor("GPU A", "none") == 1.0  # no file yet
    calibration.record("GPU A", "none", 100, 120)
    calibration.record("GPU A", "none", 100, 110)  # smaller: kept as it was
    calibration.record("GPU A", "model", 100, 80)  # below the estimate: filed, but the factor stays 1
    assert calibration.factor("GPU A", "none") == pytest.approx(1.2)
    assert calibration.factor("GPU A", "model") == 1.0 and calibration.factor("GPU B", "none") == 1.0
    assert calibration.factor(None, "none") == 1.0
    assert json.loads(calibration_file.read_text())["devices"]["GPU A"]["none"] == pytest.approx(1.2)


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[1, 2]", b'{"format": 99, "devices": {}}',
                                     b'{"format": 1, "devices": {"GPU A": {"none": 1e999, "model": "x"}}}',
                                     b" " * (calibration.MAX_FILE_BYTES + 1)])
def test_a_corrupt_calibration_file_counts_as_empty_and_is_rewritten(calibration_file, content, caplog):
    calibration_file.parent.mkdir(parents=True)
    calibration_file.write_bytes(content)
    assert calibration.factor("GPU A", "none") == 1.0
    calibration.record("GPU A", "none", 100, 150)
    assert calibration.factor("GPU A", "none") == pytest.approx(1.5)


def test_calibration_can_be_turned_off(monkeypatch, tmp_path):
    monkeypatch.setenv(calibration.ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert calibration.calibration_path() is None
    calibration.record("GPU A", "none", 100, 150)
    assert calibration.factor("GPU A", "none") == 1.0 and not any(tmp_path.iterdir())
    monkeypatch.delenv(calibration.ENV)
    assert calibration.calibration_path() == tmp_path / "lingbot" / "calibration.json"


def test_auto_and_the_fit_check_plan_with_the_device_calibration(fixtures_root, monkeypatch, calibration_file):
    fake = FakeCuda(free=64 * GiB).install(monkeypatch)
    handle = _open(fixtures_root)
    settings = handle.with_offload("auto", height=32, width=32, num_frames=5).offload
    _concrete, plain = door.resolve(handle.shared, settings, CUDA)
    calibration.record(fake.name, "none", 100, 150)
    calibration.record("another GPU", "model", 100, 300)
    _concrete, calibrated = door.resolve(handle.shared, settings, CUDA)
    assert calibrated.estimates["none"] == math.ceil(plain.estimates["none"] * 1.5)
    assert calibrated.estimates["model"] == plain.estimates["model"]  # another device's ratio does not apply
    # outside the door's planning (no device) the estimate is the plain arithmetic
    sizes, geometry = plan.model_sizes(handle.shared), Geometry(32, 32, 5)
    raw = estimate.estimate_peak("none", sizes, geometry)
    with calibration.on_device(fake.name):
        assert estimate.estimate_peak("none", sizes, geometry) == math.ceil(raw * 1.5)
    view = handle.with_device("cuda").with_offload("none")  # a label: nothing moves in a check
    verdict = door.check_handle(view, replace(geometry, ffn_chunk=None), vram_free=64 * GiB, host_free=None)
    assert verdict.vram_needed == math.ceil(raw * 1.5)


# -- a LoRA change under `none` ----------------------------------------------------------------------------

RUN = dict(height=32, width=32, num_frames=5, steps=2, guidance_scale=1.0, seed=5)


def test_a_lora_change_under_none_merges_where_the_weights_are(fixtures_root, monkeypatch):
    """Under `none` a LoRA change used to suspend the mode: every tensor of the DiT to host RAM and back
    (~60 GB each way for the MoE), and the slots given back the parameter objects captured at install,
    which, after FSDP swapped them for its shards, rebound the unsharded originals. Now nothing is
    suspended: the parameters stay the objects (and on the device) they are, and the result is the same."""
    from lingbot_core import lora as lora_ops
    from lingbot_core import stages
    from lingbot_core.placement.door import configure_offload
    from lingbot_core.placement.modes.none import NoneMode
    from lingbot_core.placement.tensors import Homes

    lora = lora_ops.load_lora_file(fixtures_root.parent / "lingbot-lora" / "cases" / "lora-lightx2v-mixed-moe"
                                   / "lora.safetensors")
    handle = _open(fixtures_root, "tiny-moe")
    view = configure_offload(handle, "none")
    cond = stages.encode_prompt(view, "a red boat", None)
    stages.denoise(view, cond, **RUN)  # the DiT is resident now
    attn = handle.shared.loaded["transformer"].blocks[0].attn
    attn.to_q.weight = torch.nn.Parameter(attn.to_q.weight.detach().clone())  # what FSDP's fully_shard does
    swapped = attn.to_q.weight
    trips = []
    for cls, method in ((NoneMode, "uninstall"), (NoneMode, "install"), (Homes, "restore")):
        real = getattr(cls, method)
        monkeypatch.setattr(cls, method, lambda self, *a, _real=real, _m=method: (trips.append(_m), _real(self, *a))[1])
    merged = stages.denoise(lora_ops.with_lora(view, lora, 0.8), cond, **RUN)
    back = stages.denoise(view, cond, **RUN)  # and off again
    assert trips == []  # nothing suspended: no tensor went home and back
    assert attn.to_q.weight is swapped  # the parameter FSDP would have put there, merged in place
    monkeypatch.undo()
    fresh = configure_offload(_open(fixtures_root, "tiny-moe"), "none")
    assert torch.equal(merged, stages.denoise(lora_ops.with_lora(fresh, lora, 0.8), cond, **RUN))
    assert torch.equal(back, stages.denoise(fresh, cond, **RUN))


# -- available host RAM -------------------------------------------------------------------------------------

def _host_files(tmp_path, monkeypatch, *, meminfo="MemAvailable:   67108864 kB\n", v2=None, v1=None):
    import tempfile

    tmp_path = Path(tempfile.mkdtemp(dir=tmp_path))  # a machine has one cgroup version: fresh files each time
    (tmp_path / "meminfo").write_text(meminfo)
    monkeypatch.setattr(estimate, "MEMINFO", str(tmp_path / "meminfo"))
    files = []
    for version, given in (("v2", v2), ("v1", v1)):
        names = [str(tmp_path / f"{version}-{part}") for part in ("limit", "usage", "stat")]
        if given is not None:
            for name, text in zip(names, given):
                Path(name).write_text(text)
        files.append((*names, "inactive_file" if version == "v2" else "total_inactive_file"))
    monkeypatch.setattr(estimate, "CGROUP_LIMITS", tuple(files))


def test_available_host_ram_is_capped_by_the_containers_memory_limit(tmp_path, monkeypatch):
    _host_files(tmp_path, monkeypatch)
    assert estimate.available_host_bytes() == 64 * GiB  # no cgroup files: MemAvailable
    _host_files(tmp_path, monkeypatch, v2=(f"{8 * GiB}\n", f"{6 * GiB}\n", f"anon 1\ninactive_file {GiB}\n"))
    assert estimate.available_host_bytes() == 3 * GiB  # limit - usage + reclaimable cache
    _host_files(tmp_path, monkeypatch, v2=("max\n", f"{6 * GiB}\n", ""))
    assert estimate.available_host_bytes() == 64 * GiB  # no limit
    _host_files(tmp_path, monkeypatch, v1=("9223372036854771712\n", "5\n", ""))
    assert estimate.available_host_bytes() == 64 * GiB  # v1 "unlimited"
    _host_files(tmp_path, monkeypatch, v1=(f"{4 * GiB}\n", f"{GiB}\n", f"total_inactive_file {GiB}\n"))
    assert estimate.available_host_bytes() == 4 * GiB


def test_available_host_ram_without_proc_meminfo_asks_psutil(tmp_path, monkeypatch):
    import sys
    import types

    _host_files(tmp_path, monkeypatch, meminfo="")
    fake = types.SimpleNamespace(virtual_memory=lambda: types.SimpleNamespace(available=5 * GiB))
    monkeypatch.setitem(sys.modules, "psutil", fake)
    assert estimate.available_host_bytes() == 5 * GiB


def test_auto_reads_the_host_ram_even_with_a_vram_budget_given(fixtures_root, monkeypatch):
    """With `budget_bytes` set, `auto` used to skip the host check: a mode whose weights do not fit the host
    RAM could be picked, and the kernel's OOM killer ends such a run without an error."""
    from lingbot_core.placement.fit import DoesNotFit

    handle = _open(fixtures_root)
    settings = handle.with_offload("auto", budget_bytes=1, height=32, width=32, num_frames=5).offload
    monkeypatch.setattr(estimate, "available_host_bytes", lambda: 1)
    with pytest.raises(DoesNotFit, match="host RAM"):
        door.resolve(handle.shared, settings, CUDA)
    monkeypatch.setattr(estimate, "available_host_bytes", lambda: 64 * GiB)
    _concrete, choice = door.resolve(handle.shared, settings, CUDA)
    assert choice.host_budget == 64 * GiB


def test_a_whole_run_on_a_measured_device_measures_every_stage(fixtures_root, monkeypatch, calibration_file):
    """Encode, denoise, decode and a refine through the stage door on a fake CUDA device (its counters and
    name; the tensors stay on the CPU): every stage measures, each with an estimate, and the run's output is
    the unmeasured run's."""
    from lingbot_core import stages

    handle = _open(fixtures_root, "tiny-moe")
    plain_cond = stages.encode_prompt(handle, "a red boat", None)
    plain = stages.decode(handle, stages.denoise(handle, plain_cond, **RUN))
    fake = FakeCuda().install(monkeypatch)
    monkeypatch.setattr(calibration, "device_name", lambda device: fake.name)
    cond = stages.encode_prompt(handle, "a red boat", None)
    frames = stages.decode(handle, stages.denoise(handle, cond, **RUN))
    assert torch.equal(frames, plain)
    stages.refine(handle, frames, cond, height=32, width=32, steps=2, seed=1, decode_output=False)
    peaks = calibration.measured_peaks()
    assert {p.stage for p in peaks} >= {"text_encoder+processor", "transformer+scheduler", "vae", "refiner+scheduler"}
    estimated = [p.stage for p in peaks if p.estimate_bytes]
    # the decode has its phase; the refiner's VAE encode and the sigma stage have none to be set against
    assert estimated == ["text_encoder+processor", "transformer+scheduler", "vae", "refiner+scheduler"], \
        [p.line() for p in peaks]
