"""LoRA views on one handle: applied when a stage enters, exact in any order and under every offload mode."""

from __future__ import annotations

import random

import pytest
import torch

from lingbot_core import lora as lora_ops
from lingbot_core import stages
from lingbot_core.handle import PipelineHandle
from lingbot_core.placement.door import configure_offload, release
from lingbot_core.placement.modes import MODE_ORDER

MODES = list(MODE_ORDER)  # every registered offload mode
OPTS = {"group": {"use_stream": False}}
RUN = dict(height=32, width=32, num_frames=5, steps=2, guidance_scale=1.0, seed=5)


@pytest.fixture
def moe(fixtures_root):
    return PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu")


@pytest.fixture(scope="module")
def loras(fixtures_root):
    """The LightX2V-style fixture LoRA, and a second one on other modules (the refiner too)."""
    first = lora_ops.load_lora_file(fixtures_root.parent / "lingbot-lora" / "cases" / "lora-lightx2v-mixed-moe"
                                    / "lora.safetensors")
    g = torch.Generator().manual_seed(1)
    second = lora_ops.LoraFile.from_state_dict({
        "diffusion_model.blocks.1.attn.to_v.lora_down.weight": torch.randn(2, 32, generator=g) * 0.3,
        "diffusion_model.blocks.1.attn.to_v.lora_up.weight": torch.randn(32, 2, generator=g) * 0.3,
        "lora_unet.blocks.0.ffn.experts.w2.lora_down.weight": torch.randn(4, 2, 16, generator=g) * 0.3,
        "lora_unet.blocks.0.ffn.experts.w2.lora_up.weight": torch.randn(4, 32, 2, generator=g) * 0.3,
    }, name="second")
    return first, second


def _views(handle, loras):
    first, second = loras
    return {
        "plain": handle,
        "first": lora_ops.with_lora(handle, first, 1.0),
        "first-half": lora_ops.with_lora(handle, first, 0.5),
        "both": lora_ops.with_lora(lora_ops.with_lora(handle, first, 1.0), second, -0.7),
    }


def _denoise(view, cond):
    return stages.denoise(view, cond, **RUN)


def _reference(fixtures_root, loras):
    """Each view's result, each on its own fresh handle (no other view ever touched it)."""
    out = {}
    for name in ("plain", "first", "first-half", "both"):
        handle = PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu")
        cond = stages.encode_prompt(handle, "a red boat", None)
        out[name] = _denoise(_views(handle, loras)[name], cond)
    return out


@pytest.fixture(scope="module")
def reference(fixtures_root, loras):
    return _reference(fixtures_root, loras)


def test_loras_change_the_output(reference):
    assert not torch.equal(reference["plain"], reference["first"])
    assert not torch.equal(reference["first"], reference["first-half"])
    assert not torch.equal(reference["first"], reference["both"])


def test_views_on_one_handle_in_shuffled_orders_are_exact(moe, loras, reference):
    views = _views(moe, loras)
    cond = stages.encode_prompt(moe, "a red boat", None)
    plain_weights = {n: p.detach().clone() for n, p in moe.component("transformer").named_parameters()}
    rng = random.Random(3)
    order = [name for name in views for _ in range(2)]
    for _ in range(2):
        rng.shuffle(order)
        for name in order:
            assert torch.equal(_denoise(views[name], cond), reference[name]), (name, order)
    _denoise(views["plain"], cond)  # a plain stage takes every LoRA off: the weights are the originals
    for n, p in moe.component("transformer").named_parameters():
        assert torch.equal(p, plain_weights[n]), n


@pytest.mark.parametrize("mode", MODES)
def test_every_offload_mode_equals_none_with_a_lora(moe, loras, reference, mode):
    views = _views(moe, loras)
    cond = stages.encode_prompt(moe, "a red boat", None)
    for name in ("both", "plain", "first", "first-half", "both"):
        # The LoRA on an offload view, and offload on a LoRA view: the same thing.
        view = configure_offload(views[name], mode, **OPTS.get(mode, {}))
        assert torch.equal(_denoise(view, cond), reference[name]), (mode, name)
        other = lora_ops.with_lora(configure_offload(moe, mode, **OPTS.get(mode, {})), loras[0], 0.5)
        assert torch.equal(_denoise(other, cond), reference["first-half"]), mode


def test_a_released_dit_gets_its_lora_again_after_reloading(moe, loras, reference):
    views = _views(moe, loras)
    cond = stages.encode_prompt(moe, "a red boat", None)
    assert torch.equal(_denoise(views["first"], cond), reference["first"])
    release(moe, ["transformer"])
    assert torch.equal(_denoise(views["first"], cond), reference["first"])
    assert torch.equal(_denoise(views["plain"], cond), reference["plain"])


def test_strength_zero_view_is_the_plain_model(moe, loras, reference):
    cond = stages.encode_prompt(moe, "a red boat", None)
    zero = lora_ops.with_lora(moe, loras[0], 0.0)
    assert torch.equal(_denoise(zero, cond), reference["plain"])
    assert lora_ops.lora_stack(_views(moe, loras)["both"].without_view_state("lora")) == lora_ops.LoraStack()


def test_the_lora_node_chains_on_a_workflow(fixtures_root, tmp_path, monkeypatch):
    from lingbot_core.workflow import Engine, apply_overrides, load_workflow
    from lingbot_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
    from lingbot_nodes.lora import lora_choices

    monkeypatch.setenv("LINGBOT_OUTPUT_DIR", str(tmp_path / "out"))
    folder = tmp_path / "loras"
    folder.mkdir()
    source = fixtures_root.parent / "lingbot-lora" / "cases" / "lora-lightx2v-mixed-moe" / "lora.safetensors"
    (folder / "light.safetensors").write_bytes(source.read_bytes())
    monkeypatch.setenv("LINGBOT_LORA_DIR", str(folder))
    assert "light.safetensors" in lora_choices()
    api = fixtures_root.parents[1].parent / "workflows" / "api" / "lingbot_t2v_moe_lightlingbot4.json"
    # The shipped workflow runs on the tiny MoE model, which has other weights than the fixture's;
    # point its Loader at the fixture's tiny-moe so the LoRA matches.
    base = ["1.path=" + '"' + str(fixtures_root / "models" / "tiny-moe") + '"']

    def frames(overrides):
        prompt = load_workflow(api, NODE_CLASS_MAPPINGS, display_names=NODE_DISPLAY_NAME_MAPPINGS)
        prompt = apply_overrides(prompt, base + overrides, NODE_CLASS_MAPPINGS)
        decode = next(n for n, v in prompt.nodes.items() if v["class_type"] == "LingBotDecode")
        return Engine(NODE_CLASS_MAPPINGS).run(prompt).output(decode)

    plain = frames([])
    light = frames(['3.lora_name="light.safetensors"'])
    zero = frames(['3.lora_name="light.safetensors"', "3.strength=0.0"])
    assert not torch.equal(plain, light) and torch.equal(plain, zero)
    with pytest.raises(Exception, match="not one of"):
        frames(['3.path=""', '3.lora_name="missing.safetensors"'])


@pytest.fixture(scope="module")
def gguf_moe(tmp_path_factory, fixtures_root):
    from lingbot_core.quantize import quantize_checkpoint

    return quantize_checkpoint(fixtures_root / "models" / "tiny-moe", tmp_path_factory.mktemp("views-gguf") / "moe",
                               "gguf-q8_0")


@pytest.mark.parametrize("weights", ["fp8", "gguf"])
def test_packed_runtime_deltas_are_identical_under_every_offload_mode(fixtures_root, gguf_moe, loras, weights):
    """fp8/GGUF layers and packed experts take the LoRAs at run time; the result must not depend on where
    the weights live. The second LoRA holds a 3-D expert LoRA (w2 of block 0)."""
    if weights == "fp8":
        handle = PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu", weights="fp8_e4m3")
    else:
        handle = PipelineHandle.open(gguf_moe, device="cpu")
    cond = stages.encode_prompt(handle, "a red boat", None)
    plain = _denoise(handle, cond)
    first = lora_ops.with_lora(handle, loras[0], 1.0)
    both = lora_ops.with_lora(first, loras[1], -0.7)
    results = {}
    for mode in MODES:
        results[mode] = _denoise(configure_offload(first, mode, **OPTS.get(mode, {})), cond)
        results[mode, "both"] = _denoise(configure_offload(both, mode, **OPTS.get(mode, {})), cond)
        experts = handle.shared.loaded["transformer"].blocks[0].ffn.experts
        assert [name for name, _ in experts.deltas] == ["w2"], mode  # the expert LoRA is a runtime delta
    assert not torch.equal(results["none"], plain) and not torch.equal(results["none", "both"], results["none"])
    for mode in MODES:
        assert torch.equal(results[mode], results["none"]), mode
        assert torch.equal(results[mode, "both"], results["none", "both"]), mode
    assert torch.equal(_denoise(handle, cond), plain)  # the plain view takes the deltas off again
