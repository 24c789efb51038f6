"""One owner for a model's mutable state (`weights.state.ModelState`): what the load found (disk homes,
exactness notes, format, reads) and what LoRA changed lives on the handle's states, never as attributes
bolted onto the modules. Each module of a loaded, offloaded, streamed or LoRA-merged DiT is compared with
the same module of a DiT freshly built from its config: the only extra keys allowed are the hook
registry's own marks (`hooks.MARKS`), and those go when the placement is taken off."""

from __future__ import annotations

import pytest
import torch

from lingbot_core import hooks
from lingbot_core import lora as lora_ops
from lingbot_core.handle import PipelineHandle
from lingbot_core.models.transformer import LingBotVideoTransformer3DModel
from lingbot_core.placement.door import configure_offload, stage
from lingbot_core.placement.modes import MODE_CLASSES, MODE_ORDER


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 16, 3, 8, 8, generator=g), torch.tensor([500.0]), torch.randn(1, 7, 32, generator=g)


def _added(model: torch.nn.Module, allowed: frozenset[str] = frozenset()) -> list[str]:
    """`path.key` of every instance attribute `model`'s modules carry that a fresh build lacks."""
    with torch.device("meta"):
        fresh = LingBotVideoTransformer3DModel.from_config(model.config)
    fresh_modules = dict(fresh.named_modules())
    out = []
    for path, module in model.named_modules():
        twin = fresh_modules.get(path)
        if twin is None or type(twin) is not type(module):
            continue  # the loader swapped the layer for a quantized one: compared by its own test
        out += [f"{path}.{key}" for key in set(vars(module)) - set(vars(twin)) - allowed]
    return sorted(out)


def _cases():
    for mode in MODE_ORDER:
        yield mode, "ram"
        if MODE_CLASSES[mode].disk_unit is not None:
            yield mode, "disk"


@pytest.mark.parametrize(("mode", "home"), list(_cases()))
def test_no_attribute_is_bolted_onto_a_placed_model(fixtures_root, mode, home):
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu")
    view = configure_offload(handle, mode, offload_to=home, **({"use_stream": False} if mode == "group" else {}))
    with stage(view, "transformer"):
        dit = view.component("transformer")
        with torch.no_grad():
            dit(*_inputs())
        assert _added(dit, hooks.MARKS) == [], (mode, home)
    assert _added(dit, hooks.MARKS) == [], (mode, home)
    state = handle.shared.states["transformer"]
    assert state.belongs_to(dit) and state.format  # what the load found is on the handle's state
    if home == "disk":
        assert state.spans and state.reads == 0
    configure_offload(handle, "none")
    assert _added(dit) == [], (mode, home)  # the placement off: not even a hook's mark is left


def test_a_merged_lora_leaves_its_copies_on_the_state_not_the_model(fixtures_root):
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu")
    g = torch.Generator().manual_seed(1)
    lora = lora_ops.LoraFile.from_state_dict({
        "diffusion_model.blocks.1.attn.to_v.lora_down.weight": torch.randn(2, 32, generator=g),
        "diffusion_model.blocks.1.attn.to_v.lora_up.weight": torch.randn(32, 2, generator=g)}, name="t")
    view = lora_ops.with_lora(handle, lora)
    with stage(view, "transformer"):
        dit = view.component("transformer")
        assert _added(dit, hooks.MARKS) == []
        assert handle.shared.states["transformer"].pristine  # the originals, kept by the state
    with stage(handle, "transformer"):  # the plain view takes the merge off again
        assert not handle.shared.states["transformer"].pristine
    assert _added(dit) == []
