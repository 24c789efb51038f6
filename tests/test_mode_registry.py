"""The offload-mode registry: a mode registered once shows up in every list derived from it."""

from __future__ import annotations

import pytest
import torch

from lingbot_core.placement import modes
from lingbot_core.placement.estimate import Geometry, ModelSizes, estimate_peak, host_bytes
from lingbot_core.placement.fit import choose_mode
from lingbot_core.placement.modes.disk import streams_from_disk, unit_bytes
from lingbot_core.placement.modes.model import ModelMode
from lingbot_core.placement.settings import OffloadSettings

SIZES = ModelSizes(text_encoder=8 << 30, transformer=3 << 30, vae=1 << 29, hidden=1536, depth=30,
                   intermediate=8960, largest_block=1 << 26, text_largest_layer=1 << 26)
GEOMETRY = Geometry(480, 832, 121)


class DummyMode(ModelMode):
    """`model` under another name, slower than every real mode and with one option of its own."""

    name = "dummy"
    speed = 99
    options = frozenset({"dummy_knob"})
    disk_unit = "block"
    summary = "a mode made by a test"

    @staticmethod
    def estimate(sizes, geometry, activations):
        return 1  # fits anything: the slowest mode `auto` falls back to


@pytest.fixture
def dummy():
    modes.register(DummyMode)
    yield DummyMode
    modes.unregister(DummyMode.name)


def test_a_registered_mode_is_in_every_derived_list(dummy):
    assert "dummy" in modes.MODES and modes.MODE_ORDER[-1] == "dummy" and modes.MODES[-1] == "auto"
    assert modes.OPTIONS["dummy"] == {"dummy_knob"} and modes.disk_unit("dummy") == "block"
    # the node's choices and tooltip
    from lingbot_nodes.loader import LingBotOffload

    (combo,) = [i for i in LingBotOffload.define_schema().inputs if i.id == "mode"]
    assert list(combo.options) == ["auto", *modes.MODE_ORDER] and "a mode made by a test" in combo.tooltip
    # the guards: its own option accepted, others refused
    modes.check_guards(OffloadSettings.make("dummy", dummy_knob=1), torch.device("cpu"), {})
    with pytest.raises(ValueError, match="does not take use_stream"):
        modes.check_guards(OffloadSettings.make("dummy", use_stream=False), torch.device("cpu"), {})
    # auto: estimated, and picked when nothing faster fits
    assert estimate_peak("dummy", SIZES, GEOMETRY) == 1
    choice = choose_mode(SIZES, GEOMETRY, budget_bytes=1 << 20)
    assert choice.mode == "dummy" and "dummy" in choice.estimates
    # disk offload streams under it, one block at a time
    assert streams_from_disk(OffloadSettings.make("dummy", offload_to="disk"), "transformer")
    assert unit_bytes("dummy", SIZES) == SIZES.largest_block
    assert host_bytes("dummy", SIZES, "disk") == SIZES.text_encoder + SIZES.vae + SIZES.largest_block


def test_unregistered_it_is_gone_everywhere(dummy):
    modes.unregister("dummy")
    assert "dummy" not in modes.MODES and "dummy" not in modes.OPTIONS
    with pytest.raises(ValueError, match="unknown offload mode 'dummy'"):
        modes.check_guards(OffloadSettings.make("dummy"), torch.device("cpu"), {})
    modes.register(DummyMode)  # the fixture takes it out again


def test_every_mode_in_the_folder_is_registered_once():
    import pkgutil

    found = {info.name for info in pkgutil.iter_modules(modes.__path__)} - {"base", "disk"}
    assert found == set(modes.MODE_CLASSES)  # one file per mode, named after it
    with pytest.raises(ValueError, match="registered already"):
        modes.register(type("Impostor", (ModelMode,), {"name": "model"}))
    with pytest.raises(ValueError, match="name other than"):
        modes.register(type("Auto", (ModelMode,), {"name": "auto"}))
