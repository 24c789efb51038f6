"""A LoRA on the MoE refiner, through the real refine stage.

Both ways of aiming a LoRA at the refiner are covered: the file says so (`refiner.` key prefix,
apply_to auto) and the node/handle input says so (a prefix-less file, apply_to="refiner"). Each is
compared with a direct computation: a fresh handle whose refiner weights were changed by hand to
W + strength * scale * (B @ A) in float64, run through the same refine stage with the same inputs
and seeds. The base transformer must stay untouched, taking the LoRA off must give the plain
refiner back bit for bit, and every offload mode must give what `none` gives.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from lingbot_core import lora as lora_ops
from lingbot_core import stages
from lingbot_core.handle import PipelineHandle
from lingbot_core.placement.door import configure_offload
from lingbot_core.placement.modes import MODE_ORDER

MODES = list(MODE_ORDER)  # every registered offload mode
OPTS = {"group": {"use_stream": False}}
REFINE = dict(height=32, width=32, steps=2, seed=1, decode_output=False)
BASE = dict(height=32, width=32, num_frames=5, steps=1, guidance_scale=1.0, seed=0)
STRENGTH = 0.8
RANK = 2
ALPHA = 3.0  # on to_out only: scale alpha/rank there, 1 elsewhere

# (module on the refiner, file suffix pair, alpha?) — the LightX2V mix of spellings in one file.
TARGETS = [
    ("blocks.0.attn.to_q", (".lora.down.weight", ".lora.up.weight"), False),
    ("blocks.1.attn.to_out", (".lora_A.weight", ".lora_B.weight"), True),
    ("blocks.0.ffn.shared_experts.gate_proj", (".lora_A.weight", ".lora_B.weight"), False),
    ("blocks.1.ffn.shared_experts.down_proj", (".lora_A.weight", ".lora_B.weight"), False),
]


def _open(fixtures_root) -> PipelineHandle:
    return PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu")


def _frames() -> torch.Tensor:
    return torch.rand(5, 32, 32, 3, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def factors(fixtures_root):
    """module -> (down, up, scale), shaped for the tiny refiner."""
    refiner = _open(fixtures_root).component("refiner")
    params = dict(refiner.named_parameters())
    g = torch.Generator().manual_seed(21)
    out = {}
    for module, _suffixes, with_alpha in TARGETS:
        rows, cols = params[f"{module}.weight"].shape
        out[module] = (torch.randn(RANK, cols, generator=g) * 0.3, torch.randn(rows, RANK, generator=g) * 0.3,
                       ALPHA / RANK if with_alpha else 1.0)
    return out


def _write(path, factors, prefix: str):
    tensors = {}
    for module, (down_sfx, up_sfx), with_alpha in TARGETS:
        down, up, _scale = factors[module]
        tensors[f"{prefix}{module}{down_sfx}"], tensors[f"{prefix}{module}{up_sfx}"] = down, up
        if with_alpha:
            tensors[f"{prefix}{module}.alpha"] = torch.tensor(ALPHA)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory, factors):
    folder = tmp_path_factory.mktemp("refiner-loras")
    return {"prefixed": _write(folder / "refiner_prefixed.safetensors", factors, "refiner."),
            "bare": _write(folder / "bare.safetensors", factors, "")}


def _hand_merged(refiner: torch.nn.Module, factors) -> dict[str, torch.Tensor]:
    params = dict(refiner.named_parameters())
    return {f"{m}.weight": (params[f"{m}.weight"].double()
                            + STRENGTH * scale * (up.double() @ down.double())).to(params[f"{m}.weight"].dtype)
            for m, (down, up, scale) in factors.items()}


@pytest.fixture(scope="module")
def expected(fixtures_root, factors):
    """Plain refine, and refine with the refiner's weights changed by hand (each on a fresh handle)."""
    frames = _frames()
    plain_handle = _open(fixtures_root)
    cond = stages.encode_prompt(plain_handle, "a boat", None)
    plain = stages.refine(plain_handle, frames, cond, **REFINE)
    base_plain = stages.denoise(plain_handle, cond, **BASE)

    hand = _open(fixtures_root)
    refiner = hand.component("refiner")
    merged = _hand_merged(refiner, factors)
    with torch.no_grad():
        for name, p in refiner.named_parameters():
            if name in merged:
                p.copy_(merged[name])
    lora = stages.refine(hand, frames, stages.encode_prompt(hand, "a boat", None), **REFINE)
    return {"plain": plain, "lora": lora, "merged": merged, "base_plain": base_plain}


def _lora_view(handle, files, how):
    """The two ways to aim a LoRA at the refiner: the file's prefix, or the node's apply_to input."""
    if how == "prefixed":
        return lora_ops.with_lora(handle, files["prefixed"], STRENGTH)
    from lingbot_nodes.lora import LingBotLoRA

    (view,) = LingBotLoRA.execute(handle, "none", STRENGTH, apply_to="refiner", path=str(files["bare"])).args
    return view


def _close(actual, wanted):
    torch.testing.assert_close(actual, wanted, atol=1e-5, rtol=1e-5)


def test_the_hand_merged_refiner_changes_the_refined_video(expected):
    assert (expected["lora"] - expected["plain"]).abs().max() > 1e-2


@pytest.mark.parametrize("how", ["prefixed", "bare"])
def test_refiner_lora_matches_a_direct_computation_and_spares_the_transformer(fixtures_root, files, expected, how):
    handle = _open(fixtures_root)
    cond = stages.encode_prompt(handle, "a boat", None)
    base = {n: p.detach().clone() for n, p in handle.component("transformer").named_parameters()}
    refiner_plain = {n: p.detach().clone() for n, p in handle.component("refiner").named_parameters()}
    view = _lora_view(handle, files, how)
    (report,) = lora_ops.plan(handle, lora_ops.lora_stack(view).items[0].lora,
                              STRENGTH, lora_ops.lora_stack(view).items[0].apply_to)
    assert report.component == "refiner" and report.modules == len(TARGETS) and not report.unmatched

    out = stages.refine(view, _frames(), cond, release_base=False, **REFINE)
    _close(out, expected["lora"])
    # Between stages under `none` the refiner holds the merged weights; only the targets changed.
    for name, p in handle.component("refiner").named_parameters():
        if name in expected["merged"]:
            torch.testing.assert_close(p, expected["merged"][name], atol=1e-6, rtol=0)
        else:
            assert torch.equal(p, refiner_plain[name]), name
    # The base DiT carries nothing: same weights, no saved copies, and its stage gives the plain result.
    transformer = handle.component("transformer")
    assert all(torch.equal(p, base[n]) for n, p in transformer.named_parameters())
    assert lora_ops.pristine_copies(handle.shared.states.get("transformer")) == {}
    assert torch.equal(stages.denoise(view, cond, **BASE), expected["base_plain"])

    # Taking the LoRA off (a plain view's stage) restores the refiner bit for bit.
    assert torch.equal(stages.refine(handle, _frames(), cond, release_base=False, **REFINE), expected["plain"])
    assert all(torch.equal(p, refiner_plain[n]) for n, p in handle.component("refiner").named_parameters())
    assert lora_ops.pristine_copies(handle.shared.states.get("refiner")) == {}
    strength_zero = lora_ops.with_lora(handle, files["prefixed"], 0.0)
    assert torch.equal(stages.refine(strength_zero, _frames(), cond, release_base=False, **REFINE), expected["plain"])


@pytest.mark.parametrize("mode", MODES)
def test_refiner_lora_under_every_offload_mode(fixtures_root, files, expected, mode):
    handle = _open(fixtures_root)
    cond = stages.encode_prompt(handle, "a boat", None)
    reference = stages.refine(_lora_view(_open(fixtures_root), files, "prefixed"), _frames(), cond, **REFINE)
    _close(reference, expected["lora"])
    for how in ("prefixed", "bare"):
        view = configure_offload(_lora_view(handle, files, how), mode, **OPTS.get(mode, {}))
        # The base stage first (so refine has a base DiT to release under the offload modes), then refine.
        assert torch.equal(stages.denoise(view, cond, **BASE), expected["base_plain"]), (mode, how)
        assert torch.equal(stages.refine(view, _frames(), cond, **REFINE), reference), (mode, how)
        plain = configure_offload(handle, mode, **OPTS.get(mode, {}))
        assert torch.equal(stages.refine(plain, _frames(), cond, **REFINE), expected["plain"]), (mode, how)


def test_refiner_lora_on_fp8_weights_is_a_runtime_delta_under_every_mode(fixtures_root, files):
    """Quantized refiner layers take the LoRA at run time: the same result wherever the weights live."""
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu", weights="fp8_e4m3")
    cond = stages.encode_prompt(handle, "a boat", None)
    plain = stages.refine(handle, _frames(), cond, **REFINE)
    results = {mode: stages.refine(configure_offload(_lora_view(handle, files, "prefixed"), mode,
                                                     **OPTS.get(mode, {})), _frames(), cond, **REFINE)
               for mode in MODES}
    assert (results["none"] - plain).abs().max() > 1e-2
    for mode, out in results.items():
        assert torch.equal(out, results["none"]), mode
    assert torch.equal(stages.refine(handle, _frames(), cond, **REFINE), plain)
