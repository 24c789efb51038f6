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
