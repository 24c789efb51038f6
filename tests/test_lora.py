"""LoRA loading: every key format against a direct computation, exact removal, and bad input."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import save_file

from lingbot_core import lora as lora_ops
from lingbot_core.checkpoints.loading import load_transformer
from lingbot_core.lora import LoraError, LoraItem, LoraStack
from lingbot_core.weights.state import Models

RANK = 3


@pytest.fixture(scope="module")
def moe_dit(fixtures_root):
    return load_transformer(fixtures_root / "models" / "tiny-moe")


@pytest.fixture(scope="module")
def dense_dit(fixtures_root):
    return load_transformer(fixtures_root / "models" / "tiny-dense")


def _factors(shape, seed, experts=None):
    g = torch.Generator().manual_seed(seed)
    if experts is None:
        out, inp = shape
        return torch.randn(RANK, inp, generator=g) * 0.1, torch.randn(out, RANK, generator=g) * 0.1
    e, out, inp = shape
    return torch.randn(e, RANK, inp, generator=g) * 0.1, torch.randn(e, out, RANK, generator=g) * 0.1


# (format name, how a module path and role become a file key, alpha written?)
FORMATS = {
    "peft": (lambda m, r: f"{m}.lora_{'A' if r == 'down' else 'B'}.weight", False),
    "peft_no_weight": (lambda m, r: f"{m}.lora_{'A' if r == 'down' else 'B'}", False),
    "diffusers_lora_dot": (lambda m, r: f"{m}.lora.{r}.weight", False),
    "diffsynth_default": (lambda m, r: f"{m}.lora_{'A' if r == 'down' else 'B'}.default.weight", False),
    "diffusers_pipeline": (lambda m, r: f"transformer.{m}.lora_{'A' if r == 'down' else 'B'}.weight", False),
    "comfy_diffusion_model": (lambda m, r: f"diffusion_model.{m}.lora_{r}.weight", True),
    "kohya_underscore": (lambda m, r: f"lora_unet_{m.replace('.', '_')}.lora_{r}.weight", True),
    "mirai_dotted_kohya": (lambda m, r: f"lora_unet.{m}.lora_{r}.weight", True),
    "lora_linear_layer": (lambda m, r: f"{m}.lora_linear_layer.{r}.weight", False),
}
MODULES = ["blocks.0.attn.to_q", "blocks.1.attn.to_out", "blocks.0.ffn.shared_experts.down_proj"]


def _alpha_key(fmt, module):
    return FORMATS[fmt][0](module, "down").replace(".lora_down.weight", ".alpha")


def _write(tmp_path, tensors, name="lora.safetensors", dtype=None):
    path = tmp_path / name
    save_file({k: (v.to(dtype) if dtype is not None else v).contiguous() for k, v in tensors.items()}, path)
    return path


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_key_format_merges_w_plus_scaled_product(tmp_path, moe_dit, fmt):
    key_of, with_alpha = FORMATS[fmt]
    params = dict(moe_dit.named_parameters())
    tensors, want = {}, {}
    strength, alpha = 0.7, 6.0
    scale = alpha / RANK if with_alpha else 1.0
    for i, module in enumerate(MODULES):
        w = params[f"{module}.weight"]
        down, up = _factors(tuple(w.shape), seed=i)
        tensors[key_of(module, "down")], tensors[key_of(module, "up")] = down, up
        if with_alpha:
            tensors[_alpha_key(fmt, module)] = torch.tensor(alpha)
        want[f"{module}.weight"] = (w.double() + strength * scale * (up.double() @ down.double())).float()
    lora = lora_ops.load_lora_file(_write(tmp_path, tensors))
    report = lora_ops.match(lora, moe_dit, "transformer")
    assert sorted(p.param for p in report.patches) == sorted(want) and not report.unmatched

    before = {n: p.detach().clone() for n, p in moe_dit.named_parameters()}
    stack = LoraStack((LoraItem(lora, strength),))
    parts = Models({"transformer": moe_dit})  # the modules and the owner of their state
    stack.apply(parts, ["transformer"])
    try:
        for name, p in moe_dit.named_parameters():
            if name in want:
                torch.testing.assert_close(p, want[name], atol=1e-6, rtol=0)
                assert not torch.equal(p, before[name])
            else:
                assert torch.equal(p, before[name]), f"{fmt}: {name} changed"
    finally:
        stack.remove(parts, ["transformer"])
    assert all(torch.equal(p, before[n]) for n, p in moe_dit.named_parameters())


def test_full_deltas_and_3d_expert_and_router_loras(tmp_path, moe_dit):
    params = dict(moe_dit.named_parameters())
    g = torch.Generator().manual_seed(9)
    diff = torch.randn(32, 32, generator=g) * 0.01
    diff_b = torch.randn(32, generator=g) * 0.01
    down_e, up_e = _factors((4, 16, 32), seed=3, experts=True)
    down_r, up_r = _factors((4, 32), seed=4)
    tensors = {
        "diffusion_model.blocks.0.attn.to_out.diff": diff,
        "diffusion_model.blocks.0.attn.to_out.diff_b": diff_b,
        "lora_unet.blocks.1.ffn.experts.w1.lora_down.weight": down_e,
        "lora_unet.blocks.1.ffn.experts.w1.lora_up.weight": up_e,
        "lora_unet.blocks.1.ffn.experts.w1.alpha": torch.tensor(1.5),
        "lora_unet.blocks.0.ffn.router.weight.lora_down.weight": down_r,
        "lora_unet.blocks.0.ffn.router.weight.lora_up.weight": up_r,
    }
    lora = lora_ops.load_lora_file(_write(tmp_path, tensors))
    s = 0.5
    want = {
        "blocks.0.attn.to_out.weight": params["blocks.0.attn.to_out.weight"].double() + s * diff.double(),
        "blocks.0.attn.to_out.bias": params["blocks.0.attn.to_out.bias"].double() + s * diff_b.double(),
        "blocks.1.ffn.experts.w1": params["blocks.1.ffn.experts.w1"].double()
        + s * 0.5 * torch.stack([up_e[e].double() @ down_e[e].double() for e in range(4)]),
        "blocks.0.ffn.router.weight": params["blocks.0.ffn.router.weight"].double()
        + s * (up_r.double() @ down_r.double()),
    }
    stack = LoraStack((LoraItem(lora, s),))
    parts = Models({"transformer": moe_dit})  # the modules and the owner of their state
    stack.apply(parts, ["transformer"])
    try:
        now = dict(moe_dit.named_parameters())
        for name, value in want.items():
            torch.testing.assert_close(now[name].double(), value, atol=1e-6, rtol=0)
    finally:
        stack.remove(parts, ["transformer"])


def test_bf16_weights_merge_in_fp32_and_restore_exactly(fixtures_root, tmp_path):
    dit = load_transformer(fixtures_root / "models" / "tiny-dense", dtype=torch.bfloat16)
    w = dit.blocks[0].attn.to_q.weight
    original = w.detach().clone()
    down, up = _factors((32, 32), seed=1)
    lora = lora_ops.LoraFile.from_state_dict({"blocks.0.attn.to_q.lora_A.weight": down.bfloat16(),
                                              "blocks.0.attn.to_q.lora_B.weight": up.bfloat16()})
    stack = LoraStack((LoraItem(lora, 1.0),))
    parts = Models({"transformer": dit})  # the modules and the owner of their state
    stack.apply(parts, ["transformer"])
    expected = (original.float() + up.bfloat16().float() @ down.bfloat16().float()).to(torch.bfloat16)
    assert w.dtype == torch.bfloat16 and torch.equal(w, expected)
    # A strength change re-merges from the pristine copy, not from the merged weight.
    LoraStack((LoraItem(lora, 0.25),)).apply(parts, ["transformer"])
    expected = (original.float() + 0.25 * (up.bfloat16().float() @ down.bfloat16().float())).to(torch.bfloat16)
    assert torch.equal(w, expected)
    stack.remove(parts, ["transformer"])
    assert torch.equal(w, original)
    assert lora_ops.pristine_copies(parts.state("transformer")) == {}


def test_two_loras_on_one_weight_add_up(moe_dit):
    w = dict(moe_dit.named_parameters())["blocks.0.attn.to_q.weight"]
    a, b = _factors((32, 32), seed=5), _factors((32, 32), seed=6)
    first = lora_ops.LoraFile.from_state_dict({"blocks.0.attn.to_q.lora_A.weight": a[0],
                                               "blocks.0.attn.to_q.lora_B.weight": a[1]}, name="a")
    second = lora_ops.LoraFile.from_state_dict({"blocks.0.attn.to_q.lora_A.weight": b[0],
                                                "blocks.0.attn.to_q.lora_B.weight": b[1]}, name="b")
    original = w.detach().clone()
    stack = LoraStack((LoraItem(first, 1.0), LoraItem(second, -0.5)))
    parts = Models({"transformer": moe_dit})  # the modules and the owner of their state
    stack.apply(parts, ["transformer"])
    try:
        want = original.double() + a[1].double() @ a[0].double() - 0.5 * (b[1].double() @ b[0].double())
        torch.testing.assert_close(w.double(), want, atol=1e-6, rtol=0)
    finally:
        stack.remove(parts, ["transformer"])
    assert torch.equal(w, original)


def test_refiner_prefix_and_apply_to(moe_dit):
    down, up = _factors((32, 32), seed=7)
    lora = lora_ops.LoraFile.from_state_dict({"refiner.blocks.0.attn.to_q.lora_A.weight": down,
                                              "refiner.blocks.0.attn.to_q.lora_B.weight": up})
    assert lora.components() == {"refiner"}
    assert not lora_ops.match(lora, moe_dit, "transformer").patches  # auto: the file says refiner
    assert len(lora_ops.match(lora, moe_dit, "refiner").patches) == 1
    assert len(lora_ops.match(lora, moe_dit, "transformer", apply_to="transformer").patches) == 1
    assert not lora_ops.match(lora, moe_dit, "refiner", apply_to="transformer").patches
    assert len(lora_ops.match(lora, moe_dit, "transformer", apply_to="both").patches) == 1


# -- bad input ---------------------------------------------------------------------------------------

def test_unreadable_and_non_safetensors_files(tmp_path):
    with pytest.raises(LoraError, match="does not exist"):
        lora_ops.load_lora_file(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(LoraError, match="not a readable safetensors file"):
        lora_ops.load_lora_file(junk)
    pickled = tmp_path / "lora.pt"
    torch.save({"blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 2)}, pickled)
    with pytest.raises(LoraError, match="pickled.*safetensors"):
        lora_ops.load_lora_file(pickled)
    disguised = tmp_path / "disguised.safetensors"
    disguised.write_bytes(pickled.read_bytes())
    with pytest.raises(LoraError, match="pickled"):
        lora_ops.load_lora_file(disguised)
    empty = _write(tmp_path, {"some.other.tensor": torch.zeros(2)}, "other.safetensors")
    with pytest.raises(LoraError, match="no LoRA keys found.*some.other.tensor"):
        lora_ops.load_lora_file(empty)


def test_keys_matching_nothing_are_refused(fixtures_root, tmp_path):
    from lingbot_core.handle import PipelineHandle

    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    down, up = _factors((32, 32), seed=1)
    lora = lora_ops.LoraFile.from_state_dict({"unet.down_blocks.0.to_q.lora_A.weight": down,
                                              "unet.down_blocks.0.to_q.lora_B.weight": up}, name="sdxl.safetensors")
    with pytest.raises(LoraError, match="sdxl.safetensors: none of its 2 keys matches.*another model"):
        lora_ops.plan(handle, lora)
    assert "transformer" not in handle.shared.loaded  # checked on the config's layout, no weights loaded


@pytest.mark.parametrize("tensors, pattern", [
    ({"blocks.0.attn.to_q.lora_A.weight": torch.zeros(3, 32), "blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 4)},
     "rank mismatch.*rank 3"),
    ({"blocks.0.attn.to_q.lora_A.weight": torch.zeros(3, 32)}, "no matching up factor"),
    ({"blocks.0.attn.to_q.lora_A.weight": torch.zeros(3, 64), "blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, 3)},
     "another size"),
    ({"lora_unet.blocks.0.ffn.experts.w1.lora_down.weight": torch.zeros(8, 3, 32),
      "lora_unet.blocks.0.ffn.experts.w1.lora_up.weight": torch.zeros(8, 16, 3)}, "8 experts.*has 4"),
    ({"blocks.0.ffn.experts.w1.lora_A.weight": torch.zeros(3, 32), "blocks.0.ffn.experts.w1.lora_B.weight":
      torch.zeros(16, 3)}, "2-D factors.*3-D"),
    ({"blocks.0.attn.to_q.lora_A.weight": torch.full((3, 32), float("nan")),
      "blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 3)}, "non-finite"),
    ({"blocks.0.attn.to_q.lora_A.weight": torch.zeros(3, 32, dtype=torch.bfloat16),
      "blocks.0.attn.to_q.lora_B.weight": torch.full((32, 3), -float("inf"), dtype=torch.bfloat16)}, "non-finite"),
    ({"blocks.0.attn.to_out.diff": torch.zeros(32, 32).index_fill_(0, torch.tensor([7]), float("nan"))},
     "non-finite"),
    ({"blocks.0.attn.to_q.diff": torch.zeros(16, 16)}, r"is \(16, 16\) but blocks.0.attn.to_q.weight"),
    ({"blocks.0.attn.to_q.lora_A.weight": torch.zeros(0, 32), "blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 0),
      "blocks.0.attn.to_q.alpha": torch.tensor(4.0)}, "rank 0"),
    ({"blocks.0.attn.to_q.lora_A.weight": torch.tensor(1.0), "blocks.0.attn.to_q.lora_B.weight": torch.tensor(1.0)},
     "not a LoRA pair"),
    ({"blocks.0.attn.to_q.lora_A.weight": torch.zeros(3, 32), "blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 3),
      "blocks.0.attn.to_q.alpha": torch.ones(3)}, "alpha must hold one number"),
    ({"blocks.0.attn.to_q.lora_A.weight": torch.zeros(3, 32), "blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 3),
      "blocks.0.attn.to_q.alpha": torch.tensor(float("inf"))}, "alpha is not finite"),
    ({"blocks.0.attn.to_q.lora_A.weight": torch.zeros(3, 32, dtype=torch.int8),
      "blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 3, dtype=torch.int8)}, "non-float"),
])
def test_bad_factors_are_refused_with_the_key(moe_dit, tensors, pattern):
    lora = lora_ops.LoraFile.from_state_dict(tensors, name="bad.safetensors")
    with pytest.raises(LoraError, match=pattern):
        lora_ops.match(lora, moe_dit, "transformer")


def test_two_spellings_of_one_factor_are_refused():
    with pytest.raises(LoraError, match="two keys give the down of blocks.0.attn.to_q"):
        lora_ops.LoraFile.from_state_dict({"blocks.0.attn.to_q.lora_A.weight": torch.zeros(3, 32),
                                           "blocks.0.attn.to_q.lora.down.weight": torch.zeros(3, 32)})


def test_a_file_that_cannot_be_opened_is_refused(tmp_path, monkeypatch):
    """A file the process may not read (running as root here, so the failure is simulated)."""
    import builtins

    path = _write(tmp_path, {"blocks.0.attn.to_q.diff": torch.zeros(32, 32)})
    real_open = builtins.open

    def deny(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", deny)
    monkeypatch.setattr("safetensors.safe_open", lambda *a, **k: deny(path))
    with pytest.raises(LoraError, match="cannot be read.*Permission denied.*permissions"):
        lora_ops.load_lora_file(path)


def test_refiner_loras_on_a_checkpoint_without_a_refiner(fixtures_root, caplog):
    from lingbot_core.handle import PipelineHandle

    dense = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    down, up = _factors((32, 32), seed=2)
    only_refiner = lora_ops.LoraFile.from_state_dict({"refiner.blocks.0.attn.to_q.lora_A.weight": down,
                                                      "refiner.blocks.0.attn.to_q.lora_B.weight": up}, name="r")
    with pytest.raises(LoraError, match="r is for the refiner, but this checkpoint has none"):
        lora_ops.plan(dense, only_refiner)
    both = lora_ops.LoraFile.from_state_dict({"refiner.blocks.0.attn.to_q.lora_A.weight": down,
                                              "refiner.blocks.0.attn.to_q.lora_B.weight": up,
                                              "transformer.blocks.0.attn.to_k.lora_A.weight": down,
                                              "transformer.blocks.0.attn.to_k.lora_B.weight": up}, name="b")
    with caplog.at_level(logging.WARNING, logger="lingbot_core.lora"):
        (report,) = lora_ops.plan(dense, both)
    assert [p.param for p in report.patches] == ["blocks.0.attn.to_k.weight"]
    assert "no refiner" in caplog.text and "not applied" in caplog.text


def test_unsupported_adapter_kinds_are_refused():
    with pytest.raises(LoraError, match="DoRA"):
        lora_ops.LoraFile.from_state_dict({"blocks.0.attn.to_q.lora_A.weight": torch.zeros(3, 32),
                                           "blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 3),
                                           "blocks.0.attn.to_q.dora_scale": torch.zeros(32)})
    with pytest.raises(LoraError, match="strength must be a finite number"):
        LoraItem(lora_ops.LoraFile.from_state_dict({"blocks.0.attn.to_q.diff": torch.zeros(32, 32)}), float("inf"))


def test_a_moe_lora_on_the_dense_model_warns_partial(fixtures_root, caplog):
    from lingbot_core.handle import PipelineHandle

    dense = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    path = fixtures_root.parent / "lingbot-lora" / "cases" / "lora-lightx2v-mixed-moe" / "lora.safetensors"
    lora = lora_ops.load_lora_file(path)
    with caplog.at_level(logging.WARNING, logger="lingbot_core.lora"):
        (report,) = lora_ops.plan(dense, lora)
    assert len(report.patches) == 8 and len(report.unmatched) == 12  # attention matches, shared experts do not
    assert "matches only part" in caplog.text and "MoE model" in caplog.text


# -- quantized weights: runtime deltas --------------------------------------------------------------

def test_fp8_layers_take_a_lora_as_a_runtime_delta(fixtures_root):
    from lingbot_core.weights.modules import QuantizedLinear

    dit = load_transformer(fixtures_root / "models" / "tiny-moe", weights="fp8_e4m3")
    layer = dit.blocks[0].attn.to_q
    assert isinstance(layer, QuantizedLinear)
    packed = layer.qdata.detach().clone()
    down, up = _factors((32, 32), seed=11)
    lora = lora_ops.LoraFile.from_state_dict({"blocks.0.attn.to_q.lora.down.weight": down,
                                              "blocks.0.attn.to_q.lora.up.weight": up,
                                              "blocks.0.attn.to_q.alpha": torch.tensor(1.5)})
    assert [p.param for p in lora_ops.match(lora, dit, "transformer").patches] == ["blocks.0.attn.to_q.weight"]
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    parts = Models({"transformer": dit})  # the modules and the owner of their state
    with torch.no_grad():
        plain = layer(x)
        stack = LoraStack((LoraItem(lora, 0.8),))
        stack.apply(parts, ["transformer"])
        adapted = layer(x)
        want = plain.double() + 0.8 * 0.5 * (x.double() @ (up.double() @ down.double()).T)
        torch.testing.assert_close(adapted.double(), want, atol=1e-5, rtol=0)
        assert torch.equal(layer.qdata, packed)  # the packed weight is never touched
        stack.remove(parts, ["transformer"])
        assert torch.equal(layer(x), plain) and layer.deltas == []


@pytest.fixture(scope="module")
def packed_moe(tmp_path_factory, fixtures_root):
    """The tiny MoE DiT with packed experts: fp8 quantized on load, and a Q8_0 GGUF file."""
    from lingbot_core.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("lora-gguf")
    gguf_folder = quantize_checkpoint(fixtures_root / "models" / "tiny-moe", root / "moe", "gguf-q8_0")
    split_folder = quantize_checkpoint(fixtures_root / "models" / "tiny-moe", root / "split", "gguf-q8_0",
                                       per_expert=True)
    return {"fp8": load_transformer(fixtures_root / "models" / "tiny-moe", weights="fp8_e4m3"),
            "gguf": load_transformer(gguf_folder), "gguf-per-expert": load_transformer(split_folder)}


def _plain_moe_with(ffn, weights):
    """A plain copy of a MoE FFN whose experts hold `weights` (name -> [E, out, in] float32)."""
    import copy

    from lingbot_core.models.moe import ExpertWeights

    ref = copy.deepcopy(ffn)
    e, inner, hidden = weights["w1"].shape
    ref.experts = ExpertWeights(e, hidden, inner)
    for name, w in weights.items():
        setattr(ref.experts, name, torch.nn.Parameter(w, requires_grad=False))
    ref.use_grouped_mm = False
    return ref


@pytest.mark.parametrize("fmt", ["fp8", "gguf", "gguf-per-expert"])
def test_a_3d_lora_on_packed_experts_is_a_runtime_delta_on_routed_experts(packed_moe, fmt):
    from lingbot_core.weights.modules import QuantizedExperts

    dit = packed_moe[fmt]
    ffn = dit.blocks[0].ffn
    experts = ffn.experts
    assert isinstance(experts, QuantizedExperts)
    stored = {n: p.detach().clone() for n, p in experts.named_parameters()}
    down1, up1 = _factors((4, 16, 32), seed=3, experts=True)
    down2, up2 = _factors((4, 32, 16), seed=4, experts=True)
    lora = lora_ops.LoraFile.from_state_dict({
        "lora_unet.blocks.0.ffn.experts.w1.lora_down.weight": down1,
        "lora_unet.blocks.0.ffn.experts.w1.lora_up.weight": up1,
        "lora_unet.blocks.0.ffn.experts.w1.alpha": torch.tensor(1.5),
        "blocks.0.ffn.experts.w2.lora_A.weight": down2,
        "blocks.0.ffn.experts.w2.lora_B.weight": up2,
    })
    strength = 0.8
    x = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(5))
    dequantized = {n: torch.stack([experts.expert(n, e, torch.float32) for e in range(4)]) for n in experts.NAMES}
    merged = dict(dequantized)
    merged["w1"] = (dequantized["w1"].double() + strength * 0.5 * (up1.double() @ down1.double())).float()
    merged["w2"] = (dequantized["w2"].double() + strength * (up2.double() @ down2.double())).float()
    parts = Models({"transformer": dit})  # the modules and the owner of their state
    with torch.no_grad():
        plain = ffn(x)
        torch.testing.assert_close(plain, _plain_moe_with(ffn, dequantized)(x), atol=1e-6, rtol=0)
        stack = LoraStack((LoraItem(lora, strength),))
        stack.apply(parts, ["transformer"])
        try:
            assert sorted(name for name, _ in experts.deltas) == ["w1", "w2"]
            # count which experts' deltas run: exactly the experts the router sends the tokens to
            called: list[tuple[str, int]] = []
            original = list(experts.deltas)

            def counting(name, fn):
                def wrapped(e, rows):
                    called.append((name, e))
                    return fn(e, rows)
                return wrapped
            experts.deltas[:] = [(name, counting(name, fn)) for name, fn in original]
            one_token = x[:, :1]
            adapted_one = ffn(one_token)
            experts.deltas[:] = original
            chosen, _ = ffn.router(one_token.reshape(-1, 32))
            routed = sorted(int(e) for e in chosen.flatten())
            assert sorted(e for n, e in called if n == "w1") == routed == sorted(e for n, e in called if n == "w2")
            assert len(routed) == 2  # of 4 experts
            torch.testing.assert_close(adapted_one, _plain_moe_with(ffn, merged)(one_token), atol=1e-5, rtol=0)
            adapted = ffn(x)
            torch.testing.assert_close(adapted, _plain_moe_with(ffn, merged)(x), atol=1e-5, rtol=0)
            assert not torch.allclose(adapted, plain, atol=1e-3)
            assert all(torch.equal(p, stored[n]) for n, p in experts.named_parameters())  # packed bytes untouched
        finally:
            stack.remove(parts, ["transformer"])
        assert experts.deltas == [] and torch.equal(ffn(x), plain)
        zero = LoraStack((LoraItem(lora, 0.0),))
        zero.apply(parts, ["transformer"])
        assert experts.deltas == [] and torch.equal(ffn(x), plain)
        zero.remove(parts, ["transformer"])


def test_a_3d_lora_of_the_wrong_expert_count_on_packed_experts_is_refused(packed_moe):
    down, up = _factors((3, 16, 32), seed=3, experts=True)
    lora = lora_ops.LoraFile.from_state_dict({"lora_unet.blocks.0.ffn.experts.w1.lora_down.weight": down,
                                              "lora_unet.blocks.0.ffn.experts.w1.lora_up.weight": up})
    with pytest.raises(LoraError, match="the LoRA has 3 experts, blocks.0.ffn.experts.w1 has 4"):
        lora_ops.match(lora, packed_moe["fp8"], "transformer")


def test_each_factor_is_scanned_once_however_often_the_stack_resolves(moe_dit, monkeypatch):
    """Stage entries resolve the stack again every time; the finite scan of a tensor runs once."""
    scanned = []
    from lingbot_core.lora import files

    real = files._float_and_finite
    monkeypatch.setattr(files, "_float_and_finite", lambda t: scanned.append(id(t)) or real(t))
    good = lora_ops.LoraFile.from_state_dict({"blocks.0.attn.to_q.lora_A.weight": torch.ones(3, 32),
                                              "blocks.0.attn.to_q.lora_B.weight": torch.ones(32, 3),
                                              "blocks.0.attn.to_out.diff": torch.ones(32, 32)})
    first = lora_ops.match(good, moe_dit, "transformer")
    second = lora_ops.match(good, moe_dit, "transformer")
    assert len(first.patches) == len(second.patches) == 2
    assert len(scanned) == len(set(scanned)) == 3
    bad = lora_ops.LoraFile.from_state_dict({"blocks.0.attn.to_out.diff": torch.full((32, 32), float("nan"))})
    for _ in range(2):  # a failed scan is not remembered as passed
        with pytest.raises(LoraError, match="non-finite"):
            lora_ops.match(bad, moe_dit, "transformer")


def test_fp8_factors_merge_as_their_exact_bf16_values(moe_dit, tmp_path):
    """fp8 (e4m3 / e5m2) factors are widened to bf16 on read (exact) and merge like a bf16 file;
    a scaled-fp8 file is refused when it is read."""
    down, up = _factors((32, 32), seed=11)
    w = dict(moe_dit.named_parameters())["blocks.0.attn.to_q.weight"]
    original = w.detach().clone()
    results = []
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        fp8 = {"blocks.0.attn.to_q.lora_A.weight": down.to(dtype), "blocks.0.attn.to_q.lora_B.weight": up.to(dtype)}
        wide = {k: v.to(torch.bfloat16) for k, v in fp8.items()}
        for tensors in (fp8, wide):
            lora = lora_ops.load_lora_file(_write(tmp_path, tensors))
            parts = Models({"transformer": moe_dit})
            stack = LoraStack((LoraItem(lora, 1.0),))
            stack.apply(parts, ["transformer"])
            results.append(w.detach().clone())
            stack.remove(parts, ["transformer"])
            assert torch.equal(w, original)
        assert torch.equal(results[-2], results[-1]) and not torch.equal(results[-1], original)
    scaled = {"blocks.0.attn.to_q.lora_A.weight": down.to(torch.float8_e4m3fn),
              "blocks.0.attn.to_q.lora_B.weight": up.to(torch.float8_e4m3fn),
              "blocks.0.attn.to_q.scale_weight": torch.tensor(0.5)}
    with pytest.raises(LoraError, match="scaled fp8 factors"):
        lora_ops.load_lora_file(_write(tmp_path, scaled))
