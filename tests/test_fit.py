"""The fit check: what a run needs against faked free VRAM and host RAM, in one line with what to
change; `auto` never picks a mode whose host RAM does not fit; a missing refiner/ is refused first."""

from __future__ import annotations

import logging
import os

import pytest

from lingbot_core.handle import PipelineHandle
from lingbot_core.placement import door, fit, plan
from lingbot_core.placement.door import check_handle, configure_offload
from lingbot_core.placement.estimate import Geometry, GiB, ModelSizes, estimate_peak, host_bytes
from lingbot_core.placement.fit import DoesNotFit, choose_mode

# The published MoE 30B-A3B in bf16 (two 60 GB DiTs of 48 blocks) and the dense 1.3B.
MOE = ModelSizes(text_encoder=int(8.9e9), transformer=int(60.2e9), vae=int(0.51e9), refiner=int(60.2e9), hidden=2048,
                 depth=48, intermediate=768 * 8, experts_per_token=8, largest_block=int(60.2e9 / 48),
                 text_largest_layer=int(8.9e9 / 40))
DENSE = ModelSizes(text_encoder=int(8.9e9), transformer=int(2.71e9), vae=int(0.51e9), hidden=2048, depth=24,
                   intermediate=6144, largest_block=int(2.71e9 / 24), text_largest_layer=int(8.9e9 / 40))
REFINED = Geometry(480, 832, 121, refine=(1088, 1920), vae_tiling=True, release_base=True)


def test_the_readme_moe_run_on_24_gb_and_64_gb_says_what_to_change():
    """The issue's case: base 832x480x121 refined at 1920x1088 on a 24 GB card and 64 GB of RAM."""
    choice = choose_mode(MOE, REFINED, 24 * GiB, host_budget=64 * GiB)
    assert not choice.fits and choice.offload_to == "disk"  # never a mode whose host RAM does not fit
    assert choice.host[choice.mode] <= 64 * GiB
    assert "needs ~" in choice.reason and "VRAM for 832x480x121 refined at 1920x1088" in choice.reason
    assert "you have 24.0 free" in choice.reason and "refine at 1280x736" in choice.reason
    # the advice is true: refining at 1280x736 fits that card under the mode it names
    smaller = Geometry(480, 832, 121, refine=(736, 1280), vae_tiling=True, release_base=True)
    assert any(estimate_peak(m, MOE, smaller) + fit.RESERVE_BYTES <= 24 * GiB for m in ("group", "sequential"))


def test_auto_refuses_when_no_mode_fits_the_host():
    with pytest.raises(DoesNotFit, match="host RAM") as err:
        choose_mode(MOE, REFINED, 24 * GiB, host_budget=4 * GiB)
    assert "\n" not in str(err.value)
    assert isinstance(err.value, ValueError)  # bad input: exit code 2, before anything loads


def test_an_explicit_mode_that_cannot_fit_names_what_fits():
    verdict = fit.check(MOE, Geometry(480, 832, 121), "model", "ram", vram_free=24 * GiB, host_free=64 * GiB)
    assert not verdict.ok and not verdict.vram_ok and not verdict.host_ok
    line = verdict.line()
    assert "VRAM" in line and "host RAM under 'model' with offload_to 'ram'" in line
    assert "offload_to 'disk'" in line  # the change that fits, computed
    ok = fit.check(DENSE, Geometry(480, 832, 121), "model", "ram", vram_free=24 * GiB, host_free=64 * GiB)
    assert ok.ok and ok.line().startswith("fits:") and not ok.advice


def test_every_advice_fits_when_applied():
    """Each suggestion is computed: re-checking the suggested mode at the suggested change fits."""
    for vram, host in ((8, 32), (12, 64), (16, 32), (24, 64), (48, 128)):
        verdict = fit.check(MOE, REFINED, "none", "ram", vram_free=vram * GiB, host_free=host * GiB)
        assert verdict.advice, (vram, host)
        if vram == 8:  # the estimate fits nothing of the MoE in 8 GB: it says so, and what it tried
            assert verdict.advice[0].startswith("nothing at the sizes tried fits this GPU"), verdict.advice
            continue
        for text in verdict.advice:
            assert "~" in text and "GiB" in text, text
            need = float(text.rsplit("(~", 1)[1].split(" GiB")[0])
            assert need <= vram, (vram, host, text)


@pytest.fixture
def tiny_moe(fixtures_root):
    return PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu")


def test_handle_check_warns_with_faked_free_memory(tiny_moe, caplog):
    sizes = plan.model_sizes(tiny_moe.shared)
    geometry = Geometry(32, 32, 5)
    view = configure_offload(tiny_moe, "model")
    need = estimate_peak("model", sizes, geometry) + fit.RESERVE_BYTES
    with caplog.at_level(logging.INFO, logger="lingbot_core.offload"):
        verdict = check_handle(view, geometry, vram_free=need - 1, host_free=host_bytes("model", sizes) + 1)
    assert not verdict.ok and "not expected to fit" in caplog.text
    assert not tiny_moe.shared.loaded  # nothing was loaded to decide
    assert check_handle(view, geometry, vram_free=need, host_free=host_bytes("model", sizes)).ok
    assert check_handle(view, geometry) is None  # CPU execution device: nothing to fit
    assert check_handle(configure_offload(tiny_moe, "auto"), geometry, vram_free=1) is None  # auto decides itself


def _moe_without_refiner(fixtures_root, tmp_path):
    source = fixtures_root / "models" / "tiny-moe"
    folder = tmp_path / "moe-no-refiner"
    folder.mkdir()
    for entry in source.iterdir():
        if entry.name != "refiner":
            os.symlink(entry, folder / entry.name)
    return folder


def test_a_missing_refiner_is_refused_before_the_base_pass(fixtures_root, tmp_path):
    from lingbot_nodes.loader import LingBotOffload

    handle = PipelineHandle.open(_moe_without_refiner(fixtures_root, tmp_path), device="cpu")
    with pytest.raises(ValueError, match=r"no refiner/ folder, and this run refines"):
        LingBotOffload.execute(handle, "model", plan_refine=True)
    assert not handle.shared.loaded
    LingBotOffload.execute(handle, "model", plan_refine=False)  # a base-only run is fine
    with pytest.raises(ValueError, match="no refiner/ folder"):
        check_handle(handle, Geometry(32, 32, 5, refine=(64, 64)))


def test_fall_back_keeps_the_chosen_disk_home(tiny_moe):
    sizes = plan.model_sizes(tiny_moe.shared)
    geometry = dict(height=32, width=32, num_frames=5, refine=None)
    budget = estimate_peak("model", sizes, Geometry(32, 32, 5)) + fit.RESERVE_BYTES
    view = configure_offload(tiny_moe, "auto", budget_bytes=budget, host_budget_bytes=host_bytes("model", sizes, "disk"),
                             **geometry)
    assert door.effective_mode(view) == "model"
    assert door.fall_back(view)
    placement = tiny_moe.shared.placement
    assert placement.mode.name == "group" and placement.mode.settings.offload_to == "disk"


def test_a_parallel_view_does_not_fall_back_alone_after_running_out_of_memory(tiny_moe):
    """On several processes `auto` is `none`; a rank that ran out of memory (rank 0 also holds the text encoder
    and the VAE) fell back to `model` by itself and retried the stage alone, while the others waited in their
    collectives: seen on 2 gloo ranks, both stuck until the collectives' timeout (30 minutes by default). The
    error is raised instead (a parallel run stops every rank on it)."""
    from lingbot_core.distributed.layout import ParallelLayout

    view = tiny_moe.with_offload("auto").with_parallel(ParallelLayout(cfg=1, ulysses=2, mesh=object()))
    assert door.effective_mode(view) == "none"
    assert not door.fall_back(view)
    assert door.installed_mode(view) == "none" and not door.has_fallen_back(view)
