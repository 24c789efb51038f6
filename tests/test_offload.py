"""Offload on CPU: every mode equals `none` exactly, in any stage order, through failures and releases.

On CPU nothing really moves, so residency is read from the offload ledger and, for sequential
offload, from `meta` weights between calls (a direct weight read outside a hooked forward fails).
"""

from __future__ import annotations

import gc
import itertools
import os
import weakref

import pytest
import torch

from lingbot_core import hooks, stages
from lingbot_core.handle import PipelineHandle
from lingbot_core.hooks import inventory as hook_inventory
from lingbot_core.placement import door
from lingbot_core.placement.door import configure_offload, release
from lingbot_core.placement.modes import MODE_ORDER

MODES = list(MODE_ORDER)  # every registered offload mode
OPTS = {"group": {"use_stream": False}}
GEOM = dict(height=32, width=32, num_frames=5, steps=2, guidance_scale=3.0, seed=7)
REFINE = dict(height=48, width=48, steps=2, seed=7)
# The permutation sweep runs 1200 stages per mode: keep each one minimal.
SWEEP_STEPS = 1
STAGE_NAMES = ("text", "image", "denoise", "refine", "decode")


def configure(handle, mode):
    return configure_offload(handle, mode, **OPTS.get(mode, {}))


@pytest.fixture
def moe(fixtures_root):
    return PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu")


def _image():
    g = torch.Generator().manual_seed(3)
    return torch.rand(1, 40, 36, 3, generator=g)


class Inputs:
    """Fixed inputs per stage, so stages can run in any order."""

    def __init__(self, handle):
        self.image_cond = stages.encode_image(handle, _image(), 32, 32)
        self.cond = stages.encode_prompt(handle, "a red boat", "", image=self.image_cond, mode="ti2v")
        self.text_cond = stages.encode_prompt(handle, "a red boat", None)
        self.latents = stages.denoise(handle, self.cond, image_cond=self.image_cond, **_dn())
        self.frames = stages.decode(handle, self.latents)


def _dn():
    return dict(height=GEOM["height"], width=GEOM["width"], num_frames=GEOM["num_frames"], steps=SWEEP_STEPS,
                guidance_scale=GEOM["guidance_scale"], seed=GEOM["seed"])


def run_stage(handle, name, inp):
    if name == "text":
        c = stages.encode_prompt(handle, "a red boat", "", image=inp.image_cond, mode="ti2v")
        return torch.cat([c.positive.embeds.flatten(), c.negative.embeds.flatten()])
    if name == "image":
        return stages.encode_image(handle, _image(), 32, 32).latent_mean
    if name == "denoise":
        return stages.denoise(handle, inp.cond, image_cond=inp.image_cond, **_dn())
    if name == "refine":
        # release_base off: dropping and reloading the base DiT is covered by its own tests, and would
        # turn this sweep into a reload benchmark.
        return stages.refine(handle, inp.frames, inp.text_cond, decode_output=False, release_base=False,
                             **{**REFINE, "height": 32, "width": 32, "steps": SWEEP_STEPS})
    if name == "decode":
        return stages.decode(handle, inp.latents)
    raise AssertionError(name)


class AcquireSpy:
    """Fails a test if a component computes while the offload state does not hold it."""

    def __init__(self, handle):
        self.handle = handle
        self.hooks = []
        self.violations = []

    def watch(self):
        shared = self.handle.shared
        targets = {
            "text_encoder": [shared.loaded["text_encoder"].model],
            "transformer": [shared.loaded["transformer"]],
            "refiner": [shared.loaded["refiner"]] if "refiner" in shared.loaded else [],
            "vae": [shared.loaded["vae"].encoder, shared.loaded["vae"].decoder],
        }
        for name, modules in targets.items():
            for m in modules:
                self.hooks.append(m.register_forward_pre_hook(self._check(name)))

    def _check(self, name):
        def hook(_module, _args):
            if name not in door.resident_components(self.handle):
                self.violations.append(name)
        return hook

    def close(self):
        for h in self.hooks:
            h.remove()


def assert_clean(handle):
    """The invariant between stages: only what the mode allows is held, hooks match the mode."""
    mode = door.installed_mode(handle)
    assert door.resident_components(handle) <= door.allowed_resident(handle)
    for name, module in handle.shared.loaded.items():
        if not isinstance(module, torch.nn.Module):
            continue
        inv = hook_inventory(module)
        metas = [n for n, p in module.named_parameters() if p.device.type == "meta"]
        if mode == "sequential" and name in ("text_encoder", "transformer", "refiner"):
            assert inv["accelerate"] > 0
            assert metas, f"{name}: sequential offload should leave weights on meta between stages"
        else:
            assert not metas, f"{name}: weights left on meta: {metas[:3]}"
        if mode in ("none",) or (mode in ("sequential", "group") and name == "vae"):
            assert inv["accelerate"] == inv["diffusers"] == 0, (name, inv)
        if mode == "model":  # no hooks: the door moves whole components
            assert inv["accelerate"] == inv["diffusers"] == 0, (name, inv)
        if mode == "group" and name != "vae":
            assert inv["diffusers"] > 0 and inv["accelerate"] == 0, (name, inv)


@pytest.fixture(scope="module")
def reference_outputs(fixtures_root):
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu")
    inp = Inputs(handle)
    return inp, {name: run_stage(handle, name, inp) for name in STAGE_NAMES}


def every_transition(names) -> list:
    """A run order in which every stage follows every stage (itself included) once: an Euler circuit of the
    complete graph with loops, len(names)**2 + 1 runs. What one stage leaves behind is what the next one
    meets, so this covers every pair a shuffled graph can produce; the sweep over all permutations, each
    twice, is `bench/sweeps.py` (LINGBOT_FULL_SWEEPS=1)."""
    left = {name: list(names) for name in names}
    stack, circuit = [names[0]], []
    while stack:
        if left[stack[-1]]:
            stack.append(left[stack[-1]].pop())
        else:
            circuit.append(stack.pop())
    return circuit[::-1]


def test_every_transition_is_one_order_covering_each_pair():
    order = every_transition(STAGE_NAMES)
    assert set(zip(order, order[1:])) == set(itertools.product(STAGE_NAMES, repeat=2))
    assert len(order) == len(STAGE_NAMES) ** 2 + 1


def _orders():
    if os.environ.get("LINGBOT_FULL_SWEEPS") == "1":
        return [order + order for order in itertools.permutations(STAGE_NAMES)]
    return [tuple(every_transition(STAGE_NAMES))]


@pytest.mark.parametrize("mode", MODES)
def test_every_permutation_twice_equals_natural_order(moe, mode, reference_outputs):
    inp, expected = reference_outputs
    handle = configure(moe, mode)
    for name in STAGE_NAMES:  # load everything so the spy can watch it
        handle.component("refiner" if name == "refine" else "vae")
    handle.component("text_encoder"), handle.component("transformer")
    spy = AcquireSpy(handle)
    spy.watch()
    try:
        for order in _orders():
            for name in order:
                out = run_stage(handle, name, inp)
                assert torch.equal(out, expected[name]), f"{mode}: {name} differs in order {order}"
                assert_clean(handle)
    finally:
        spy.close()
    assert not spy.violations, f"components computed without being acquired: {set(spy.violations)}"


@pytest.mark.parametrize("mode", MODES)
def test_generate_matches_none_for_every_mode(fixtures_root, mode):
    results = {}
    for m in ("none", mode):
        handle = configure(PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu"), m)
        t2v = stages.generate(handle, "a boat", **{**GEOM, "num_frames": 5})
        ti2v = stages.generate(handle, "a boat", mode="ti2v", image=_image(), **GEOM)
        refined = stages.refine(handle, t2v.frames, stages.encode_prompt(handle, "a boat", None), **REFINE)
        results[m] = (t2v.frames, ti2v.frames, refined)
        assert_clean(handle)
    for a, b in zip(results["none"], results[mode]):
        assert (a - b).abs().max() == 0


class Boom(Exception):
    pass


def _break_once(monkeypatch, module, exc):
    original = module.forward
    state = {"armed": True}

    def forward(*args, **kwargs):
        if state["armed"]:
            state["armed"] = False
            raise exc
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "forward", forward)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["text_encoder", "denoise_step", "vae_encode"])
@pytest.mark.parametrize("exc", [Boom("injected"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_failure_leaves_handle_clean_and_next_run_matches_reference(fixtures_root, monkeypatch, mode, where, exc):
    from parity_cases import discover

    case = next(c for c in discover({"ti2v"}) if c.name == "ti2v-dense")
    spec, expected = case.spec, case.expected()
    handle = configure(PipelineHandle.open(case.model_dir, device="cpu"), mode)
    kwargs = dict(mode="ti2v", image=case.path / spec["image"], negative_prompt=spec["negative_prompt"],
                  height=spec["height"], width=spec["width"], num_frames=spec["num_frames"],
                  steps=spec["num_inference_steps"], guidance_scale=spec["guidance_scale"], shift=spec["shift"],
                  seed=spec["seed"])
    callback = None
    if where == "text_encoder":
        _break_once(monkeypatch, handle.component("text_encoder").model.language_model.layers[1].mlp, exc)
    elif where == "vae_encode":
        _break_once(monkeypatch, handle.component("vae").encoder, exc)
    else:
        def callback(step, total, latents):
            if step == 2:
                raise exc

    with pytest.raises(type(exc)):
        stages.generate(handle, spec["prompt"], callback=callback, **kwargs)
    assert_clean(handle)
    monkeypatch.undo()
    result = stages.generate(handle, spec["prompt"], **kwargs)
    case.check("frames", result.frames, expected)
    case.check("final_latents", result.latents, expected)
    assert_clean(handle)


def _fresh_inventory(fixtures_root, mode):
    handle = configure(PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu"), mode)
    for name in ("text_encoder", "transformer", "vae"):
        handle.component(name)
    configure(handle, mode)
    return {n: hook_inventory(m) for n, m in handle.shared.loaded.items() if isinstance(m, torch.nn.Module)}


def test_configure_twice_and_switch_in_every_order(fixtures_root, moe, reference_outputs):
    inp, expected = reference_outputs
    fresh = {m: _fresh_inventory(fixtures_root, m) for m in MODES}
    modules = {n: moe.component(n) for n in ("text_encoder", "transformer", "vae")}
    originals = {n: type(m).forward for n, m in modules.items()}
    for order in itertools.permutations(MODES):
        for mode in order:
            for _ in range(2):
                handle = configure(moe, mode)
                inventory = {n: hook_inventory(m) for n, m in modules.items()}
                assert inventory == fresh[mode], f"hooks stacked after {order}"
            assert torch.equal(run_stage(handle, "denoise", inp), expected["denoise"])
        handle = configure(moe, "none")
        for name, module in modules.items():
            assert all(v == 0 for v in hook_inventory(module).values()), name
            assert module.forward.__func__ is originals[name]
        vae = modules["vae"]
        assert "encode" not in vae.__dict__ and "decode" not in vae.__dict__


def test_failed_install_restores_the_previous_state(moe, monkeypatch, reference_outputs):
    inp, expected = reference_outputs
    handle = configure(moe, "model")
    for name in ("text_encoder", "transformer", "vae"):
        handle.component(name)
    handle = configure(moe, "model")
    before = {n: hook_inventory(m) for n, m in moe.shared.loaded.items() if isinstance(m, torch.nn.Module)}

    import accelerate

    real = accelerate.cpu_offload

    def flaky(module, *args, **kwargs):
        if type(module).__name__ == "LingBotVideoTransformer3DModel":
            raise RuntimeError("install failed half way")
        return real(module, *args, **kwargs)

    monkeypatch.setattr(accelerate, "cpu_offload", flaky)
    with pytest.raises(RuntimeError, match="half way"):
        configure(moe, "sequential")
    assert door.installed_mode(moe) == "model"
    after = {n: hook_inventory(m) for n, m in moe.shared.loaded.items() if isinstance(m, torch.nn.Module)}
    assert after == before
    assert torch.equal(run_stage(handle, "denoise", inp), expected["denoise"])


@pytest.mark.parametrize("mode", MODES)
def test_release_frees_components_and_the_handle_reloads(moe, mode, reference_outputs):
    inp, expected = reference_outputs
    handle = configure(moe, mode)
    assert torch.equal(run_stage(handle, "denoise", inp), expected["denoise"])
    run_stage(handle, "text", inp)
    run_stage(handle, "decode", inp)
    modules = {n: m for n, m in handle.shared.loaded.items() if isinstance(m, torch.nn.Module)}
    refs = [weakref.ref(m) for m in modules.values()]
    refs += [weakref.ref(p) for m in modules.values() for p in m.parameters()]
    subs = [weakref.ref(s) for m in modules.values() for s in m.modules()]
    del modules
    released = release(handle)
    assert {"text_encoder", "transformer", "vae"} <= set(released)
    gc.collect()
    alive = [r for r in refs + subs if r() is not None]
    assert not alive, f"{len(alive)} objects survived release, e.g. {type(alive[0]()).__name__}"
    # The same handle (as ComfyUI's cache hands it back) reloads and gives the same result.
    assert torch.equal(run_stage(handle, "denoise", inp), expected["denoise"])
    assert handle.shared.load_count["transformer"] == 2
    assert_clean(handle)


@pytest.mark.parametrize("mode", MODES)
def test_release_strips_every_hook(moe, mode, reference_outputs):
    inp, _ = reference_outputs
    handle = configure(moe, mode)
    run_stage(handle, "text", inp)
    run_stage(handle, "denoise", inp)
    kept = {n: handle.shared.loaded[n] for n in ("text_encoder", "transformer")}
    release(handle, ["text_encoder", "transformer"])
    for name, module in kept.items():
        for sub in module.modules():
            assert not {"_hf_hook", "_old_forward", "_diffusers_hook", "forward"} & set(sub.__dict__), name
        assert all(p.device.type != "meta" for p in module.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_base_and_refiner_share_modules_and_survive_releasing_one(moe, mode, reference_outputs):
    inp, expected = reference_outputs
    handle = configure(moe, mode)
    encoder = handle.component("text_encoder")
    assert torch.equal(run_stage(handle, "denoise", inp), expected["denoise"])
    assert torch.equal(run_stage(handle, "refine", inp), expected["refine"])
    refiner = handle.component("refiner")
    release(handle, ["transformer"])
    assert "transformer" not in handle.shared.loaded
    assert handle.component("refiner") is refiner and handle.component("text_encoder") is encoder
    assert torch.equal(run_stage(handle, "refine", inp), expected["refine"])
    assert torch.equal(run_stage(handle, "denoise", inp), expected["denoise"])  # base reloads
    assert handle.component("text_encoder") is encoder  # one copy, shared
    assert_clean(handle)


@pytest.mark.parametrize("mode", MODES)
def test_execution_device_comes_from_the_handle(moe, mode):
    handle = configure(moe, mode)
    for name in ("vae", "transformer", "text_encoder"):
        handle.component(name)
    handle = configure(moe, mode)
    loaded = handle.shared.loaded
    handle.shared.loaded = dict(reversed(list(loaded.items())))  # component order must not matter
    for name in ("vae", "transformer", "text_encoder"):
        assert door.execution_device(handle, name) == torch.device("cpu")
        with door.stage(handle, name) as device:
            assert device == handle.device


def test_guards(moe, monkeypatch):
    with pytest.raises(ValueError, match="unknown offload mode 'fast'"):
        configure_offload(moe, "fast")
    with pytest.raises(ValueError, match=r"does not take use_stream"):
        configure_offload(moe, "model", use_stream=True)
    with pytest.raises(ValueError, match="needs an accelerator with streams"):
        configure_offload(moe, "group", use_stream=True)
    with pytest.raises(ValueError, match="num_blocks_per_group"):
        configure_offload(moe, "group", use_stream=False, num_blocks_per_group=0)
    from lingbot_core.distributed import stage as parallel_stage
    from lingbot_core.distributed.layout import ParallelLayout

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    # a data-parallel rank (--jobs under torchrun) runs whole videos alone: a world of 2 is no reason to refuse
    assert moe.with_offload("sequential").offload.mode == "sequential"
    for fsdp in (False, True):  # a view that shares one video (sequence/CFG parallel, FSDP) refuses
        layout = ParallelLayout(cfg=1, ulysses=2, mesh=object(), fsdp=fsdp)
        with pytest.raises(ValueError, match="multi-process group"):
            moe.with_parallel(layout).with_offload("sequential")
        try:  # so does every view of a headless --parallel process (the process layout)
            parallel_stage.use_process_layout(layout)
            with pytest.raises(ValueError, match="multi-process group"):
                configure_offload(moe, "group", use_stream=False)
        finally:
            parallel_stage.use_process_layout(None)
    assert moe.with_parallel(ParallelLayout.single()).with_offload("model").offload.mode == "model"
    monkeypatch.undo()

    class FSDPModule(torch.nn.Module):
        pass

    moe.component("transformer").add_module("probe", FSDPModule())
    with pytest.raises(ValueError, match="sharded component 'transformer'"):
        configure_offload(moe, "model")
    assert door.installed_mode(moe) in (None, "none")


class Cancelled(Exception):
    pass


@pytest.mark.parametrize("stage_name,component", [("text", "text_encoder"), ("denoise", "transformer"),
                                                  ("decode", "vae"), ("image", "vae")])
def test_interrupt_checker_cancels_inside_model_work(moe, reference_outputs, stage_name, component):
    from lingbot_core.interrupt import interrupt_checker

    inp, expected = reference_outputs
    calls = {"n": 0}

    seen = []

    def check():
        calls["n"] += 1
        seen.extend(name for _path, name in hooks.listing(moe.component(component)))
        if calls["n"] == 3:  # not at stage entry: inside the component's blocks
            raise Cancelled

    with interrupt_checker(check), pytest.raises(Cancelled):
        run_stage(moe, stage_name, inp)
    assert calls["n"] == 3
    assert "lingbot.interrupt" in seen and set(seen) <= set(hooks.KNOWN)  # every hook is a registered name
    assert "lingbot.interrupt" not in {name for _path, name in hooks.listing(moe.component(component))}
    assert not any(m._forward_pre_hooks for m in moe.component(component).modules())
    assert torch.equal(run_stage(moe, stage_name, inp), expected[stage_name])
