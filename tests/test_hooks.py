"""The hook registry (`lingbot_core.hooks`): one way to attach, list and remove behaviour on modules."""

from __future__ import annotations

import pytest
import torch

from lingbot_core import hooks


class Recorder(hooks.Hook):
    name = "test.recorder"

    def __init__(self, tag: str, events: list):
        super().__init__()
        self.tag, self.events = tag, events

    def pre_forward(self, module, *args, **kwargs):
        self.events.append(f"{self.tag}:pre")
        return args, kwargs

    def post_forward(self, module, output):
        self.events.append(f"{self.tag}:post")
        return output


def _net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def test_attach_list_detach_restores_the_module_exactly():
    net, events = _net(), []
    x = torch.randn(3, 4)
    expected = net(x)
    hooks.attach(net[0], Recorder("a", events))
    hooks.attach(net[0], Recorder("b", events), name="test.other")
    assert hooks.listing(net) == [("0", "test.recorder"), ("0", "test.other")]
    assert torch.equal(net(x), expected)
    assert events == ["b:pre", "a:pre", "a:post", "b:post"]  # the hook attached last runs outside
    assert hooks.find(net[0], "test.other").tag == "b" and hooks.find(net[2], "test.other") is None
    with pytest.raises(ValueError, match="already exists"):
        hooks.attach(net[0], Recorder("c", events))
    hooks.detach(net[0], "test.recorder")
    hooks.detach(net[0], "test.other")
    hooks.detach(net[0], "test.other")  # absent: a no-op
    assert hooks.listing(net) == []
    assert not {"_diffusers_hook", "forward"} & set(net[0].__dict__)  # nothing left behind


def test_strip_removes_ours_and_accelerates_and_inventory_counts_them():
    from accelerate import cpu_offload

    net, events = _net(), []
    x = torch.randn(3, 4)
    expected = net(x)
    cpu_offload(net, execution_device=torch.device("cpu"))
    hooks.attach(net[2], Recorder("a", events))
    counts = hooks.inventory(net)
    assert counts[hooks.ACCELERATE] > 0 and counts["test.recorder"] == 1 and counts["diffusers"] == 1
    assert {name for _p, name in hooks.listing(net)} == {hooks.ACCELERATE, "test.recorder"}
    assert [h for _sub, h in hooks.hooks_named(net, "test.recorder")] == [hooks.find(net[2], "test.recorder")]
    assert torch.equal(net(x), expected) and events == ["a:pre", "a:post"]
    hooks.strip(net)
    assert hooks.listing(net) == [] and all(v == 0 for v in hooks.inventory(net).values())
    for sub in net.modules():
        assert not {"_hf_hook", "_old_forward", "_diffusers_hook", "forward"} & set(sub.__dict__)


def test_named_registers_a_description_once():
    @hooks.named("test.described", "a hook for this test")
    class Described(hooks.Hook):
        pass

    assert Described.name == "test.described" and hooks.KNOWN["test.described"] == "a hook for this test"
    with pytest.raises(ValueError, match="registered already"):
        hooks.named("test.described", "something else")(type("Other", (hooks.Hook,), {}))
    del hooks.KNOWN["test.described"]


def test_onload_device_reads_every_kind_of_moving_hook():
    class Group:
        onload_device = "cpu"

    class GroupHook:
        group = Group()

    class Moving:
        execution_device = 0 if torch.cuda.is_available() else "cpu"

    assert hooks.onload_device(GroupHook()) == torch.device("cpu")
    assert hooks.onload_device(Moving()) is not None
    assert hooks.onload_device(Recorder("a", [])) is None


def _dit():
    from lingbot_core.models.transformer import LingBotVideoTransformer3DModel

    torch.manual_seed(0)
    return LingBotVideoTransformer3DModel(hidden_size=64, num_attention_heads=4, depth=2, intermediate_size=96,
                                          text_dim=32, freq_dim=32, axes_dims=(4, 6, 6), axes_lens=(64, 32, 32)).eval()


def test_compiled_regions_and_sequence_parallel_are_registry_hooks():
    from lingbot_core.distributed import ParallelLayout, disable_sequence_parallel, enable_sequence_parallel
    from lingbot_core.distributed.ulysses import ATTENTION_HOOK, DIT_HOOK
    from lingbot_core.models import compile as regional

    model = _dit()
    clean = {path: set(vars(m)) for path, m in model.named_modules()}
    try:
        assert regional.compile_blocks(model, backend="eager") == len(model.blocks)  # compiled at a first call only
        enable_sequence_parallel(model, ParallelLayout(ulysses=2))  # no process group is touched until a forward
        counts = hooks.inventory(model)
        assert counts[regional.COMPILED_REGION] == len(model.blocks) == counts[ATTENTION_HOOK]
        assert counts[DIT_HOOK] == 1
        named = {name for _path, name in hooks.listing(model)}
        assert named == {regional.COMPILED_REGION, DIT_HOOK, ATTENTION_HOOK} and named <= set(hooks.KNOWN)
        disable_sequence_parallel(model)  # its own hooks only
        assert {name for _path, name in hooks.listing(model)} == {regional.COMPILED_REGION}
        hooks.strip(model, keep=hooks.LASTING)  # what an offload mode's removal does: the regions stay
        assert regional.compiled_blocks(model) == len(model.blocks)
        hooks.strip(model)  # everything off
        assert hooks.listing(model) == [] and regional.compiled_blocks(model) == 0
        assert {path: set(vars(m)) for path, m in model.named_modules()} == clean  # a clean module again
    finally:
        regional._COMPILED.clear()


def test_compiled_regions_stay_through_offload_switches(fixtures_root):
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.models import compile as regional
    from lingbot_core.models.transformer import JointBlock
    from lingbot_core.placement.door import configure_offload, stage

    calls = [0]

    def counted(block, *args):  # stands in for the compiled computation (no compiler time)
        calls[0] += 1
        return JointBlock.compute(block, *args)

    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(1, 16, 3, 8, 8, generator=g), torch.tensor([500.0]), torch.randn(1, 7, 32, generator=g))
    folder = fixtures_root / "models" / "tiny-moe"
    regional._COMPILED.clear()
    regional._COMPILED[("inductor", True)] = counted
    try:
        with torch.no_grad():
            eager = PipelineHandle.open(folder, device="cpu").component("transformer")(*inputs).sample
            handle = PipelineHandle.open(folder, device="cpu", compile="blocks")
            for mode in ("sequential", "model", "none"):
                view = configure_offload(handle, mode)
                with stage(view, "transformer"):
                    dit = view.component("transformer")
                    before = calls[0]
                    assert torch.equal(dit(*inputs).sample, eager), mode
                    assert calls[0] - before == len(dit.blocks), mode  # every block through its region
                assert regional.compiled_blocks(dit) == len(dit.blocks), mode
    finally:
        regional._COMPILED.clear()
