"""Memory report, the peak estimate, the `auto` choice (every branch, on a simulated budget), the
out-of-memory fallback, and releasing the base DiT before refining."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from lingbot_core import stages
from lingbot_core.handle import PipelineHandle
from lingbot_core.placement import door, estimate, fit, plan
from lingbot_core.placement.door import configure_offload, memory_report
from lingbot_core.placement.estimate import Geometry, GiB, ModelSizes, estimate_peak
from lingbot_core.placement.fit import choose_mode
from lingbot_core.placement.modes import MODE_ORDER

# Dense 1.3B in bf16 with the Qwen3-VL-4B encoder (bf16) and the fp32 Wan VAE.
DENSE = ModelSizes(text_encoder=int(8.9e9), transformer=int(2.71e9), vae=int(0.51e9), hidden=2048, depth=24,
                   intermediate=6144, largest_block=int(2.71e9 / 24), text_largest_layer=int(8.9e9 / 40))
# MoE 30B-A3B: two 60 GB DiTs (base, refiner) of 48 blocks.
MOE = ModelSizes(text_encoder=int(8.9e9), transformer=int(60.2e9), vae=int(0.51e9), refiner=int(60.2e9), hidden=2048,
                 depth=48, intermediate=768 * 8, experts_per_token=8, largest_block=int(60.2e9 / 48),
                 text_largest_layer=int(8.9e9 / 40))
TI2V_SMALL = Geometry(height=192, width=320, num_frames=49)


@pytest.fixture
def moe(fixtures_root):
    return PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu")


def test_estimates_against_the_one_gpu_measurement():
    """The reference's peaks on an RTX PRO 4000 for TI2V 320x192x49 (MiB, as issue 30 quotes them);
    docs/benchmarks.md sets the estimate against them term by term. The estimate (of max_memory_allocated)
    is below them for none and model; with the fit check's reserve it plans at ~0.95-1.0 of them;
    sequential is above (our VAE moves whole, the reference streamed it per leaf)."""
    measured = {"none": 14330 * 2**20, "model": 9890 * 2**20, "sequential": 1780 * 2**20}
    ratio = {mode: estimate_peak(mode, DENSE, TI2V_SMALL) / peak for mode, peak in measured.items()}
    planned = {mode: (estimate_peak(mode, DENSE, TI2V_SMALL) + estimate.RESERVE_BYTES) / peak
               for mode, peak in measured.items()}
    assert 0.9 < ratio["none"] < 1 and 0.85 < ratio["model"] < 1, ratio
    assert 0.95 < planned["none"] < 1.05 and 0.9 < planned["model"] < 1.05, planned
    assert 1 < ratio["sequential"] < 1.4, ratio
    order = [estimate_peak(m, DENSE, TI2V_SMALL) for m in MODE_ORDER]  # fastest first: largest first
    assert order == sorted(order, reverse=True)


def test_estimate_grows_with_geometry_and_tiling_caps_decode():
    small = estimate_peak("sequential", DENSE, TI2V_SMALL)
    big = estimate_peak("sequential", DENSE, Geometry(480, 832, 121))
    tiled = estimate_peak("sequential", DENSE, Geometry(480, 832, 121, vae_tiling=True))
    assert small < tiled < big
    refine = estimate.activation_bytes(DENSE, Geometry(480, 832, 121, refine=(1088, 1920)))
    assert refine["refine"] > refine["denoise"] and "refine_decode" in refine


@pytest.mark.parametrize("budget_gib,expected", [(80, "none"), (60, "model"), (5.5, "group"), (3.5, "sequential"),
                                                 (0.5, "sequential")])
def test_choose_mode_every_branch(budget_gib, expected):
    geometry = Geometry(height=192, width=320, num_frames=49)
    choice = choose_mode(MOE, geometry, int(budget_gib * GiB))
    assert choice.mode == expected, (choice.reason, {m: b / GiB for m, b in choice.estimates.items()})
    if budget_gib == 0.5:
        assert "nothing is expected to fit" in choice.reason and not choice.fits
        assert "needs ~" in choice.reason and "you have 0.5 free" in choice.reason
    else:
        assert choice.estimates[expected] + estimate.RESERVE_BYTES <= budget_gib * GiB
        faster = MODE_ORDER[: MODE_ORDER.index(expected)]
        assert all(choice.estimates[m] + estimate.RESERVE_BYTES > budget_gib * GiB for m in faster)


def test_fallback_choice_skips_the_failed_mode():
    choice = choose_mode(DENSE, TI2V_SMALL, 40 * GiB, after="none")
    assert choice.mode == "model" and "after running out of memory under 'none'" in choice.reason
    assert choose_mode(DENSE, TI2V_SMALL, 40 * GiB, after="sequential").mode == "sequential"


def test_sizes_from_a_checkpoint_read_headers_only(moe):
    sizes = plan.model_sizes(moe.shared)
    assert not moe.shared.loaded
    # tensor bytes from the headers: the file size less its JSON header
    header = moe.info.component_bytes("transformer") - sizes.transformer
    assert sizes.refiner > 0 and 0 < header < 16 * 1024
    assert sizes.experts_per_token == 2 and sizes.hidden == 32


def test_auto_on_cpu_picks_none_and_says_why(moe, caplog):
    caplog.set_level("INFO", logger="lingbot_core.offload")
    view = configure_offload(moe, "auto")
    assert door.effective_mode(view) == "none"
    assert "offloading saves nothing" in caplog.text


@pytest.mark.parametrize("budget,expected", [(10**12, "none"), (1, "sequential")])
def test_auto_with_a_simulated_budget(moe, caplog, budget, expected):
    caplog.set_level("INFO", logger="lingbot_core.offload")
    view = configure_offload(moe, "auto", budget_bytes=budget, height=32, width=32, num_frames=5)
    assert door.effective_mode(view) == expected
    assert f"'{expected}'" in caplog.text and "estimates:" in caplog.text


def test_auto_falls_back_one_step_once_on_out_of_memory(moe, monkeypatch):
    reference = stages.generate(PipelineHandle.open(moe.folder, device="cpu"), "a boat", height=32, width=32,
                                num_frames=5, steps=2)
    view = configure_offload(moe, "auto", budget_bytes=10**12)
    assert door.effective_mode(view) == "none"
    dit = view.component("transformer")
    real = dit.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("simulated")
        return real(*args, **kwargs)

    monkeypatch.setattr(dit, "forward", flaky)
    result = stages.generate(view, "a boat", height=32, width=32, num_frames=5, steps=2)
    assert door.effective_mode(view) == "model" and door.has_fallen_back(view)
    assert torch.equal(result.frames, reference.frames)
    calls["n"] = 0
    # Once only: a second out-of-memory error propagates.
    monkeypatch.setattr(dit, "forward", lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("again")))
    with pytest.raises(torch.OutOfMemoryError):
        stages.generate(view, "a boat", height=32, width=32, num_frames=5, steps=2)


def test_memory_report_locations(moe):
    report = memory_report(moe)
    assert {c.name for c in report.components} >= {"transformer", "refiner", "vae", "text_encoder"}
    assert all(c.where == "not loaded" for c in report.components)
    view = configure_offload(moe, "sequential")
    stages.encode_prompt(view, "a boat", None)
    report = memory_report(view)
    encoder = next(c for c in report.components if c.name == "text_encoder")
    assert encoder.loaded and encoder.bytes_by_location.get("meta", 0) > 0  # weights live in the offload map
    assert "text_encoder" in str(report) and "sequential" in str(report)
    view = configure_offload(moe, "none")
    encoder = next(c for c in memory_report(view).components if c.name == "text_encoder")
    assert set(encoder.bytes_by_location) == {"CPU"}
    module = view.component("text_encoder")
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]}
    assert encoder.bytes_by_location["CPU"] == sum(unique.values())  # tied weights counted once


def test_pinned_memory_is_reported():
    if not torch.cuda.is_available():
        pytest.skip("pinning needs an accelerator runtime")
    from lingbot_core.placement.report import location

    assert location(torch.zeros(4).pin_memory()) == "pinned CPU"


@pytest.mark.parametrize("mode", [*MODE_ORDER[1:], "auto"])  # every mode that offloads
def test_refine_releases_the_base_first_and_matches_none(moe, fixtures_root, mode):
    frames = torch.rand(5, 32, 32, 3, generator=torch.Generator().manual_seed(0))
    plain = PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu")
    cond = stages.encode_prompt(plain, "a boat", None)
    expected = stages.refine(plain, frames, cond, height=48, width=48, steps=2, seed=1)

    options = {"group": {"use_stream": False}, "auto": {"budget_bytes": 1}}.get(mode, {})
    view = configure_offload(moe, mode, **options)
    stages.denoise(view, stages.encode_prompt(view, "a boat", None), height=32, width=32, num_frames=5, steps=1,
                   guidance_scale=1.0, seed=0)
    base = weakref.ref(view.shared.loaded["transformer"])
    params = [weakref.ref(p) for p in base().parameters()]
    out = stages.refine(view, frames, cond, height=48, width=48, steps=2, seed=1)
    gc.collect()
    assert base() is None and all(p() is None for p in params), "the base DiT survived release"
    assert torch.equal(out, expected)
    # A re-queued base run reloads it.
    stages.denoise(view, cond, height=32, width=32, num_frames=5, steps=1, guidance_scale=1.0, seed=0)
    assert view.shared.load_count["transformer"] == 2


def test_refine_keeps_the_base_under_none_unless_asked(moe):
    frames = torch.rand(5, 32, 32, 3)
    cond = stages.encode_prompt(moe, "a boat", None)
    moe.component("transformer")
    stages.refine(moe, frames, cond, height=32, width=32, steps=1, seed=1)
    assert "transformer" in moe.shared.loaded
    stages.refine(moe, frames, cond, height=32, width=32, steps=1, seed=1, release_base=True)
    assert "transformer" not in moe.shared.loaded


def test_moe_workflow_with_auto_and_release_matches_none(monkeypatch, tmp_path):
    from lingbot_core.workflow import Engine, apply_overrides, load_workflow
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    monkeypatch.setenv("LINGBOT_OUTPUT_DIR", str(tmp_path))
    path = "workflows/api/lingbot_t2v_moe_refine.json"
    from pathlib import Path

    prompt = load_workflow(Path(__file__).resolve().parents[1] / path, NODE_CLASS_MAPPINGS)
    assert prompt.nodes["2"]["inputs"]["mode"] == "auto" and prompt.nodes["5"]["inputs"]["release_base"] == "on"
    auto = Engine(NODE_CLASS_MAPPINGS).run(prompt)
    plain = Engine(NODE_CLASS_MAPPINGS).run(
        apply_overrides(prompt, ["Offload.mode=none", "Refine.release_base=off"], NODE_CLASS_MAPPINGS))
    assert torch.equal(auto.output("6"), plain.output("6"))
    assert "not loaded" in auto.output("7", 1) and "transformer" in auto.output("7", 1)
    assert auto.ui["7"]["text"][0] == auto.output("7", 1)


# -- disk-backed offload in the estimate and the report ---------------------------------------------------

def test_host_ram_under_disk_is_one_unit_not_the_model():
    others = MOE.text_encoder + MOE.vae
    for mode in ("model", "group", "sequential"):  # group without a stream: no pinned copies
        assert estimate.host_bytes(mode, MOE, "ram", pinned=False) == others + MOE.transformer + MOE.refiner
    assert estimate.host_bytes("group", MOE, "disk", pinned=False) == estimate.host_bytes("sequential", MOE, "disk") == \
        others + MOE.largest_block
    # with a stream (what `auto` installs on CUDA) group pins the text encoder (the DiT streams from its file):
    # these sizes give no tensor sizes, so it counts the bound, twice its bytes, plus one tensor in flight
    assert estimate.host_bytes("group", MOE, "disk") == \
        2 * MOE.text_encoder + MOE.vae + MOE.largest_block + max(MOE.largest_block, MOE.text_head)
    assert estimate.host_bytes("model", MOE, "disk") == others + MOE.transformer  # the whole DiT, read per forward
    assert estimate.host_bytes("none", MOE, "disk") == estimate.host_bytes("none", MOE, "ram") == 0


def test_choose_mode_respects_the_host_budget():
    # a 24 GB card on a 64 GB PC: the MoE fits the card under group, and the host only with disk offload
    # asked for `ram`, it does not pick a mode whose host RAM does not fit: the DiTs move to disk
    ram = choose_mode(MOE, TI2V_SMALL, 24 * GiB, host_budget=64 * GiB)
    assert (ram.mode, ram.offload_to, ram.fits) == ("group", "disk", True)
    assert "with offload_to 'disk'" in ram.reason and "host RAM" in ram.reason
    disk = choose_mode(MOE, TI2V_SMALL, 24 * GiB, host_budget=64 * GiB, offload_to="disk")
    assert disk.mode == "group" and "host RAM" in disk.reason
    assert disk.host["group"] < 24 * GiB < disk.host["model"]  # group's pinned text encoder counted at its bound
    # a bigger card: `model` fits it, and the host too once the DiTs stay in their files
    assert choose_mode(MOE, TI2V_SMALL, 60 * GiB, host_budget=100 * GiB, offload_to="disk").mode == "model"
    assert (choose_mode(MOE, TI2V_SMALL, 60 * GiB, host_budget=100 * GiB).offload_to == "disk")
    assert choose_mode(MOE, TI2V_SMALL, 60 * GiB).mode == "model"  # no host budget: the card alone decides
    assert "host RAM: none ~0.0 GiB" in fit.describe(disk)


def test_auto_plans_disk_offload_within_the_host_budget(moe, caplog):
    sizes = plan.model_sizes(moe.shared)
    geometry = Geometry(height=32, width=32, num_frames=5, refine=None)
    budget = estimate_peak("model", sizes, geometry) + estimate.RESERVE_BYTES  # the card fits `model`, not `none`
    assert estimate_peak("none", sizes, geometry) + estimate.RESERVE_BYTES > budget
    host = estimate.host_bytes("model", sizes, "disk") + 1  # and the host only the disk-backed `model`
    options = dict(budget_bytes=budget, host_budget_bytes=host, height=32, width=32, num_frames=5, refine=None)
    for asked in ("ram", "disk"):  # `ram` does not fit the host: auto moves the DiTs to their files
        view = configure_offload(moe, "auto", offload_to=asked, **options)
        assert door.effective_mode(view) == "model"
        assert moe.shared.placement.mode.settings.offload_to == "disk"


def test_memory_report_shows_disk_homed_weights(moe):
    view = configure_offload(moe, "group", offload_to="disk", use_stream=False)
    with door.stage(view, "transformer"):
        pass
    report = memory_report(view)
    dit = next(c for c in report.components if c.name == "transformer")
    assert set(dit.bytes_by_location) == {"disk"} and dit.bytes_by_location["disk"] > 0
    assert "disk" in str(report)
    configure_offload(moe, "group", use_stream=False)
    dit = next(c for c in memory_report(moe).components if c.name == "transformer")
    assert "disk" not in dit.bytes_by_location and dit.bytes_by_location.get("CPU", 0) > 0


def test_a_component_the_model_lacks_pins_nothing():
    # a root without refiner/ (the DMD student) keeps the base's pinned figure only if something copies
    # it along; group's host RAM must then count the transformer's pinned copy, not the refiner's too
    from dataclasses import replace

    with_refiner = replace(MOE, pinned_transformer=3 * GiB, pinned_refiner=3 * GiB)
    student = replace(with_refiner, refiner=0)
    assert student.pinned("refiner") == 0
    assert estimate.host_bytes("group", student, "ram") == \
        estimate.host_bytes("group", with_refiner, "ram") - 3 * GiB
