"""The placement package: one CPU test per defect of the offload acceptance check (issue 10), the
per-view state extension point, and the import structure.

On CPU nothing moves, so "left on the device" is read from what the hooks do: under `sequential`
weights must be back on `meta` after a stage; under `group` every offload group must have been
offloaded again (a spy on diffusers' ModuleGroup); `model` and the VAE move by rebinding to their
homes, which the ledger and tensor identities show.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from lingbot_core import stages
from lingbot_core.handle import PipelineHandle
from lingbot_core.hooks import inventory as hook_inventory
from lingbot_core.interrupt import interrupt_checker
from lingbot_core.placement import door
from lingbot_core.placement.door import configure_offload
from lingbot_core.placement.estimate import Geometry, ModelSizes, estimate_peak
from lingbot_core.placement.modes import MODE_ORDER

OPTS = {"group": {"use_stream": False}}
MODES = list(MODE_ORDER)  # every registered offload mode
DN = dict(height=32, width=32, num_frames=5, steps=1, guidance_scale=1.0, seed=3)


def configure(handle, mode, **kw):
    return configure_offload(handle, mode, **{**OPTS.get(mode, {}), **kw})


def _open(fixtures_root, name="tiny-dense"):
    return PipelineHandle.open(fixtures_root / "models" / name, device="cpu")


def _load_all(handle):
    for name in ("text_encoder", "transformer", "vae"):
        handle.component(name)


def _inventory(handle):
    return {n: hook_inventory(m) for n, m in handle.shared.loaded.items() if isinstance(m, torch.nn.Module)}


def _metas(module):
    return [n for n, p in module.named_parameters() if p.device.type == "meta"]


def _fresh_inventory(fixtures_root, mode):
    handle = _open(fixtures_root)
    _load_all(handle)
    return _inventory(configure(handle, mode))


class Boom(Exception):
    pass


# -- defect 1: install rollback is per mode ---------------------------------------------------------

def _fail_on_call(monkeypatch, owner, attr, n, when=lambda *a, **k: True):
    real = getattr(owner, attr)
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        if when(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == n:
                raise Boom(f"{attr} failed on call {n}")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, attr, flaky)
    return calls


@pytest.mark.parametrize("previous", ["none", "sequential"])
def test_group_failing_on_the_text_encoders_second_target_restores_the_previous_mode(fixtures_root, monkeypatch,
                                                                                      previous):
    import diffusers.hooks

    handle = _open(fixtures_root)
    _load_all(handle)
    expected_inventory = _fresh_inventory(fixtures_root, previous)
    reference = stages.encode_prompt(_open(fixtures_root), "a boat", None).positive.embeds
    handle = configure(handle, previous)
    visual = handle.component("text_encoder").model.visual
    _fail_on_call(monkeypatch, diffusers.hooks, "apply_group_offloading", 1, when=lambda m, *a, **k: m is visual)
    with pytest.raises(Boom):
        configure(handle, "group")
    monkeypatch.undo()
    assert door.installed_mode(handle) == previous
    assert _inventory(handle) == expected_inventory
    if previous == "none":
        assert all(not _metas(m) for m in handle.shared.loaded.values() if isinstance(m, torch.nn.Module))
    assert torch.equal(stages.encode_prompt(handle, "a boat", None).positive.embeds, reference)
    handle = configure(handle, previous)  # configuring it again keeps it exact
    assert _inventory(handle) == expected_inventory


def test_sequential_failing_inside_the_text_encoders_cpu_offload_restores_model(fixtures_root, monkeypatch):
    import accelerate.hooks

    handle = configure(_open(fixtures_root), "model")
    _load_all(handle)
    handle = configure(handle, "model")
    reference = stages.encode_prompt(_open(fixtures_root), "a boat", None).positive.embeds
    encoder = handle.component("text_encoder")
    inside = {id(m) for m in encoder.modules()}
    # fail half way through hooking the encoder's leaves, after some weights went to meta
    _fail_on_call(monkeypatch, accelerate.hooks, "add_hook_to_module", 20, when=lambda m, *a, **k: id(m) in inside)
    with pytest.raises(Boom, match="call 20"):
        configure(handle, "sequential")
    monkeypatch.undo()
    assert door.installed_mode(handle) == "model"
    assert _inventory(handle) == _fresh_inventory(fixtures_root, "model")
    assert not _metas(encoder)
    assert torch.equal(stages.encode_prompt(handle, "a boat", None).positive.embeds, reference)


def test_a_failing_rollback_does_not_hide_the_original_error(fixtures_root, monkeypatch):
    from lingbot_core.placement.modes.model import ModelMode

    handle = configure(_open(fixtures_root), "model")
    _load_all(handle)

    def broken(self, name, module):
        raise RuntimeError("rollback broke")

    import diffusers.hooks

    _fail_on_call(monkeypatch, diffusers.hooks, "apply_group_offloading", 2)
    monkeypatch.setattr(ModelMode, "_install", broken)
    with pytest.raises(Boom) as info:
        configure(handle, "group")
    assert any("rollback broke" in note for note in getattr(info.value, "__notes__", []))


# -- defect 2: nothing stays on the device after an error or a cancel inside a hooked forward ------

def _raise_in(monkeypatch, module, exc):
    handle = module.register_forward_pre_hook(lambda _m, _a: (_ for _ in ()).throw(exc))
    return handle


def test_sequential_error_in_a_dit_block_puts_its_weights_back_on_meta(fixtures_root):
    handle = configure(_open(fixtures_root), "sequential")
    cond = stages.encode_prompt(handle, "a boat", None)
    dit = handle.component("transformer")
    hook = _raise_in(None, dit.blocks[0].ffn, Boom("in the FFN"))
    with pytest.raises(Boom):
        stages.denoise(handle, cond, **DN)
    hook.remove()
    assert [n for n, p in dit.named_parameters() if p.device.type != "meta"] == []


def test_sequential_error_in_a_moe_ffn_puts_router_and_experts_back(fixtures_root):
    from lingbot_core.models.moe import SparseMoE

    handle = configure(_open(fixtures_root, "tiny-moe"), "sequential")
    cond = stages.encode_prompt(handle, "a boat", None)
    dit = handle.component("transformer")
    sparse = next(m for m in dit.modules() if isinstance(m, SparseMoE))
    inner = next(iter(sparse.children()))
    hook = _raise_in(None, inner, Boom("in the router"))
    with pytest.raises(Boom):
        stages.denoise(handle, cond, **DN)
    hook.remove()
    assert [n for n, p in sparse.named_parameters() if p.device.type != "meta"] == []


def test_sequential_cancel_in_the_vision_tower_leaves_nothing_loaded(fixtures_root):
    handle = configure(_open(fixtures_root), "sequential")
    image = stages.encode_image(handle, torch.rand(1, 40, 36, 3, generator=torch.Generator().manual_seed(3)), 32, 32)
    encoder = handle.component("text_encoder")
    calls = {"n": 0}

    def check():
        calls["n"] += 1
        if calls["n"] == 2:  # the first vision block: the whole (preloaded) tower is materialised
            raise Boom("cancelled")

    with interrupt_checker(check), pytest.raises(Boom):
        stages.encode_prompt(handle, "a boat", None, image=image, mode="ti2v")
    assert [n for n, p in encoder.named_parameters() if p.device.type != "meta"] == []


def test_group_error_in_a_block_offloads_every_group(fixtures_root, monkeypatch):
    from diffusers.hooks.group_offloading import ModuleGroup

    from lingbot_core.placement.modes import group as group_mode

    state = {}
    real_on, real_off = ModuleGroup.onload_, ModuleGroup.offload_

    def onload(self):
        state[id(self)] = "on"
        return real_on(self)

    def offload_(self):
        state[id(self)] = "off"
        return real_off(self)

    monkeypatch.setattr(ModuleGroup, "onload_", onload)
    monkeypatch.setattr(ModuleGroup, "offload_", offload_)
    # on CPU onload and offload devices are the same: ask the spy which groups are on the device
    monkeypatch.setattr(group_mode, "group_is_onloaded", lambda g: state.get(id(g)) == "on")
    handle = configure(_open(fixtures_root), "group")
    cond = stages.encode_prompt(handle, "a boat", None)
    dit = handle.component("transformer")
    hook = _raise_in(None, dit.blocks[1].ffn, Boom("in block 1"))
    with pytest.raises(Boom):
        stages.denoise(handle, cond, **DN)
    hook.remove()
    assert state and all(v == "off" for v in state.values())


@pytest.mark.parametrize("mode", ["model", "none"])
def test_whole_components_go_home_after_an_error(fixtures_root, mode):
    handle = configure(_open(fixtures_root), mode)
    cond = stages.encode_prompt(handle, "a boat", None)
    dit = handle.component("transformer")
    hook = _raise_in(None, dit.blocks[0].ffn, Boom("in block 0"))
    with pytest.raises(Boom):
        stages.denoise(handle, cond, **DN)
    hook.remove()
    assert door.resident_components(handle) <= door.allowed_resident(handle)
    assert ("transformer" in door.resident_components(handle)) == (mode == "none")


# -- defect 3: ties survive every mode switch -------------------------------------------------------

def test_tied_embedding_survives_every_switch(fixtures_root):
    handle = _open(fixtures_root)
    encoder = handle.component("text_encoder")
    head, embed = encoder.lm_head, encoder.model.language_model.embed_tokens
    assert head.weight is embed.weight
    tied = head.weight
    reference = stages.encode_prompt(handle, "a boat", None).positive.embeds
    for first in MODES:
        for second in MODES:
            for mode in (first, second):
                view = configure(handle, mode)
                stages.encode_prompt(view, "a boat", None)
            view = configure(handle, "none")
            assert head.weight is embed.weight is tied, (first, second)
    assert torch.equal(stages.encode_prompt(view, "a boat", None).positive.embeds, reference)


# -- defect 4: the embedding pre-hook waits for the stream as diffusers does -------------------------

class FakeStream:
    def __init__(self, events):
        self.events = events

    def synchronize(self):
        self.events.append("sync")


def test_group_embedding_onload_waits_for_the_stream(fixtures_root, monkeypatch):
    from diffusers.hooks import HookRegistry

    handle = configure(_open(fixtures_root), "group")
    encoder = handle.component("text_encoder")
    stages.encode_prompt(handle, "a boat", None)  # the first pass traces the execution order
    language_model = encoder.model.language_model
    group = HookRegistry.check_if_exists_or_initialize(language_model).get_hook("group_offloading").group
    events = []
    monkeypatch.setattr(group, "stream", FakeStream(events))
    monkeypatch.setattr(group, "onload_", lambda: events.append("onload"))  # CPU: nothing to copy
    monkeypatch.setattr(group, "offload_", lambda: events.append("offload"))
    language_model.embed_tokens.register_forward_pre_hook(lambda _m, _a: events.append("embed"))
    stages.encode_prompt(handle, "a boat", None)
    first = events.index("embed")
    assert events[:first][:2] == ["onload", "sync"], events[:first + 1]


# -- defect 5: num_blocks_per_group with use_stream is refused --------------------------------------

def test_blocks_per_group_with_a_stream_is_refused(fixtures_root):
    handle = _open(fixtures_root)
    with pytest.raises(ValueError, match="num_blocks_per_group=2 cannot be combined with use_stream"):
        configure_offload(handle, "group", device="cuda", use_stream=True, num_blocks_per_group=2)
    assert door.installed_mode(handle) is None


# -- defect 6: the auto estimate follows what will happen, and reads the budget after the host freed

MOE = ModelSizes(text_encoder=int(8.9e9), transformer=int(60.2e9), vae=int(0.51e9), refiner=int(60.2e9), hidden=2048,
                 depth=48, intermediate=768 * 8, experts_per_token=8, largest_block=int(60.2e9 / 48),
                 text_largest_layer=int(8.9e9 / 40))


def test_none_with_refine_keeps_the_base_unless_it_is_released():
    kept = estimate_peak("none", MOE, Geometry(192, 320, 49, refine=(1088, 1920)))
    released = estimate_peak("none", MOE, Geometry(192, 320, 49, refine=(1088, 1920), release_base=True))
    both = MOE.text_encoder + MOE.vae + MOE.transformer + MOE.refiner
    assert kept > both and released < both and kept - released == MOE.refiner


def test_auto_reads_the_budget_after_the_host_freed_memory(fixtures_root, monkeypatch):
    freed = []
    monkeypatch.setattr(door, "free_accelerator_bytes", lambda device: 10**15 if freed else 1)
    handle = _open(fixtures_root)
    door.add_listeners(handle, memory=lambda name, module, device, nbytes: freed.append(nbytes))
    settings = handle.with_offload("auto", height=32, width=32, num_frames=5).offload
    concrete, choice = door.resolve(handle.shared, settings, torch.device("cuda"))
    assert freed and freed[0] >= choice.estimates["none"]
    assert concrete.mode == "none" and choice.budget == 10**15


def test_listeners_belong_to_their_handle(fixtures_root, monkeypatch):
    monkeypatch.setattr(door, "free_accelerator_bytes", lambda device: 10**15)
    mine, other = _open(fixtures_root), _open(fixtures_root)
    heard = []
    door.add_listeners(mine, memory=lambda name, module, device, nbytes: heard.append(("memory", name)),
                       settle=lambda shared, device: heard.append(("settle", shared)))
    auto = other.with_offload("auto", height=32, width=32, num_frames=5).offload
    door.resolve(other.shared, auto, torch.device("cuda"))
    with door.stage(other):
        pass
    assert heard == []  # the other handle's plan and stage never call this handle's listeners
    view = mine.with_offload("auto", height=32, width=32, num_frames=5)  # a view of it: the same listeners
    door.resolve(view.shared, view.offload, torch.device("cuda"))
    with door.stage(view):
        pass
    assert heard == [("memory", "auto plan"), ("settle", mine.shared)]


# -- defect 7: attribute access never loads --------------------------------------------------------

def test_attribute_access_does_not_load(fixtures_root):
    handle = _open(fixtures_root)
    assert not hasattr(handle, "vae") and not hasattr(handle, "refiner")
    assert not handle.shared.loaded


# -- defect 8: the ledger is bounded ----------------------------------------------------------------

def test_ledger_is_bounded(fixtures_root):
    from lingbot_core.placement.state import LEDGER_SIZE

    handle = _open(fixtures_root)
    handle.component("vae")
    for _ in range(LEDGER_SIZE):
        with door.stage(handle, "vae"):
            pass
    events = door.ledger(handle)
    assert len(events) == LEDGER_SIZE and events[-1] == ("release", "vae", "vae")


# -- per-view state (the LoRA extension point) --------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ScaleOut:
    """A stand-in for a LoRA stack: scales the DiT's output projection while it is applied."""

    factor: float
    kind: str = "lora"
    log: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    def apply(self, components, names):
        for name in names:
            if name == "transformer":
                with torch.no_grad():
                    assert components[name].proj_out.weight.device.type == "cpu"  # plain modules, no hooks
                    components[name].proj_out.weight.mul_(self.factor)
                self.log.append(("apply", name))

    def remove(self, components, names):
        for name in names:
            if name == "transformer":
                with torch.no_grad():
                    components[name].proj_out.weight.div_(self.factor)
                self.log.append(("remove", name))


@pytest.mark.parametrize("mode", ["model", "sequential"])
def test_view_state_is_applied_at_stage_entry_and_removed_for_other_views(fixtures_root, mode):
    handle = configure(_open(fixtures_root), mode)
    cond = stages.encode_prompt(handle, "a boat", None)
    plain = stages.denoise(handle, cond, **DN)
    state = ScaleOut(2.0)
    scaled_view = handle.with_view_state(state)
    scaled = stages.denoise(scaled_view, cond, **DN)
    assert not torch.equal(scaled, plain)
    assert torch.equal(stages.denoise(scaled_view, cond, **DN), scaled)  # applied once, not again
    assert state.log == [("apply", "transformer")]
    assert torch.equal(stages.denoise(handle, cond, **DN), plain)  # the plain view takes it off
    assert state.log[-1] == ("remove", "transformer")
    assert _inventory(handle) == _inventory(configure(handle, mode))
    # a reloaded component gets the state again
    handle.shared.folder and door.release(handle, ["transformer"])
    assert torch.equal(stages.denoise(scaled_view, cond, **DN), scaled)


# -- structure -------------------------------------------------------------------------------------

def _imports(path: Path, package_root: Path) -> set[str]:
    module = ".".join(path.relative_to(package_root.parent).with_suffix("").parts)
    if module.endswith(".__init__"):
        module = module[: -len(".__init__")]
        base = module.split(".")
    else:
        base = module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("lingbot_core"):
                if node.module:  # `from . import x` imports the submodule x, not the package's face
                    found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lingbot_core"))
    return found


def _import_graph() -> dict[str, set[str]]:
    root = Path(__file__).resolve().parents[1] / "lingbot_core"
    files = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        files[name] = path
    # every import counts, also those inside functions (a deferred import is still a dependency)
    return {name: {t for t in _imports(path, root) if t in files and t != name} for name, path in files.items()}


def _circles(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each module that reaches itself through imports -> what it imports."""
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    return {n: sorted(graph[n]) for n in graph if n in reach(n)}


def test_no_import_circles_in_lingbot_core():
    graph = _import_graph()
    assert len(graph) > 50  # the walk found the package
    assert not _circles(graph), _circles(graph)
    settings = graph["lingbot_core.placement.settings"]
    assert not settings, f"settings.py must be a leaf, imports {settings}"
    errors = graph["lingbot_core.errors"]
    assert not errors, f"errors.py must be a leaf, imports {errors}"


def test_the_circle_check_finds_a_circle():
    graph = _import_graph()
    graph["lingbot_core.errors"] = {"lingbot_core.checkpoints.loading"}  # checkpoint imports errors: a loop
    assert "lingbot_core.errors" in _circles(graph)


def test_offload_gpu_fault_checks_run_on_cpu(tmp_path):
    """The GPU check's cancel/error-then-rerun path, at tiny size on the CPU (memory levels: n/a)."""
    from bench import offload_gpu

    result = offload_gpu.main(["--tiny", "--threads", "1", "--modes", "sequential", "--steps", "1", "--frames", "5",
                               "--warmup-steps", "0", "--extra-sizes", "", "--fault-checks",
                               "--workdir", str(tmp_path)])
    faults = result["rows"][0]["faults"]
    for kind in ("cancel", "error"):
        assert faults[kind]["raised"] and faults[kind]["rerun_equal"], faults
        assert faults[kind]["back_to_clean"] is None  # no device memory to read on the CPU


def test_an_unindexed_cuda_is_the_current_gpu(monkeypatch):
    """Under torchrun each rank sets its GPU current (`torch.cuda.set_device`) and a handle opened on `cuda` puts
    its weights there: on rank 1 they report `cuda:1`. The stage door's device check must take that as the
    handle's device (it refused every rank but 0 when `cuda` meant `cuda:0`). Faked CUDA: current device 1."""
    from lingbot_core.placement import state
    from lingbot_core.placement.settings import same_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert same_device(torch.device("cuda:1"), torch.device("cuda")) and same_device("cuda", "cuda:1")
    assert not same_device(torch.device("cuda:0"), torch.device("cuda"))
    assert same_device("cpu", "cpu") and not same_device("cpu", "cuda:1")
    monkeypatch.setattr(state, "component_device", lambda module: torch.device("cuda:1"))
    state.check_device("transformer", torch.nn.Linear(2, 2), torch.device("cuda"))  # rank 1's weights: accepted
    with pytest.raises(RuntimeError, match="set up to run on cuda:1 but the handle's execution device is cuda:0"):
        state.check_device("transformer", torch.nn.Linear(2, 2), torch.device("cuda:0"))
