"""Fast kernels by trial (`lingbot_core.kernels`): a refusing or differing kernel gives the plain path's
output, with one warning, for the rest of the process; CUDA-only branches through fakes."""

from __future__ import annotations

import logging

import pytest
import torch

from bench._common import random_dit
from lingbot_core import kernels
from lingbot_core.models import moe as moe_module

TINY_MOE = dict(hidden_size=32, num_attention_heads=2, depth=2, intermediate_size=64, text_dim=32, freq_dim=32,
                axes_dims=(4, 6, 6), axes_lens=(64, 32, 32), num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5)
SM90_ONLY = "torch._grouped_mm is only supported on CUDA devices with compute capability = 9.0"
NEEDS_GROUPED_MM = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"),
                                      reason=f"torch {torch.__version__} has no _grouped_mm (added in 2.8)")


def _inputs(b=1, text=8):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(b, 16, 2, 4, 4, generator=g), torch.tensor([700.0] * b),
            torch.randn(b, text, 32, generator=g))


def _loop_only(model):
    for m in model.modules():
        if isinstance(m, moe_module.SparseMoE):
            m.use_grouped_mm = False


def test_a_refusing_grouped_mm_falls_back_to_the_expert_loop(monkeypatch):
    """The issue's reproduction: torch <= 2.8 off sm90 raises inside the first MoE block."""
    model = random_dit(TINY_MOE).to(torch.bfloat16)
    x, t, text = _inputs()

    def refuses(*args, **kwargs):
        raise RuntimeError(SM90_ONLY)

    monkeypatch.setattr(torch, "_grouped_mm", refuses, raising=False)  # torch < 2.8 has none
    with torch.no_grad():
        got = model(x, t, text).sample
        _loop_only(model)
        want = model(x, t, text).sample
    assert torch.equal(got, want)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_the_refusal_is_warned_once_and_the_kernel_is_not_called_again(monkeypatch, caplog):
    model = random_dit(TINY_MOE).to(torch.bfloat16)
    calls = []

    def refuses(*args, **kwargs):
        calls.append(1)
        raise RuntimeError(SM90_ONLY + "\nmore detail")

    monkeypatch.setattr(torch, "_grouped_mm", refuses, raising=False)  # torch < 2.8 has none
    with caplog.at_level(logging.WARNING), torch.no_grad():
        first = model(*_inputs()).sample
        second = model(*_inputs()).sample
    assert torch.equal(first, second) and calls == [1]
    said = _warnings(caplog)
    assert len(said) == 1 and "grouped_mm" in said[0] and SM90_ONLY in said[0] and "more detail" not in said[0]
    assert kernels.KERNELS["grouped_mm"].fallback in said[0]
    [row] = kernels.verdicts()
    assert (row["kernel"], row["verdict"], row["dtype"]) == ("grouped_mm", kernels.REFUSED, "bfloat16")
    assert SM90_ONLY in row["reason"]


@NEEDS_GROUPED_MM
def test_a_differing_grouped_mm_gives_the_loop_output_with_one_warning(monkeypatch, caplog):
    model = random_dit(TINY_MOE).to(torch.bfloat16)
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: real(*a, **k) * 1.5)
    with caplog.at_level(logging.WARNING), torch.no_grad():
        got = [model(*_inputs()).sample for _ in range(2)]
        _loop_only(model)
        want = model(*_inputs()).sample
    assert torch.equal(got[0], want) and torch.equal(got[1], want)
    said = _warnings(caplog)
    assert len(said) == 1 and "grouped_mm" in said[0] and "relative error" in said[0]
    assert [r["verdict"] for r in kernels.verdicts()] == [kernels.MISMATCH]


@NEEDS_GROUPED_MM
def test_a_working_grouped_mm_is_trusted_after_its_first_call(monkeypatch):
    model = random_dit(TINY_MOE).to(torch.bfloat16)
    checks = []
    real = kernels.differs
    monkeypatch.setattr(kernels, "differs", lambda *a: checks.append(1) or real(*a))
    with torch.no_grad():
        model(*_inputs())
        model(*_inputs())
    assert [r["verdict"] for r in kernels.verdicts()] == [kernels.FAST]
    assert len(checks) == 1  # the first MoE call of the first forward only (one trial key)


# -- the rule itself, with device labels and fakes -------------------------------------------------

def _refuse():
    raise RuntimeError("no kernel image is available for execution on the device")


def test_each_capability_dtype_and_torch_version_is_tried_on_its_own(monkeypatch):
    cuda = torch.device("cuda")  # a label: the work below runs on the CPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    assert kernels.run("grouped_mm", _refuse, lambda: "plain", device=cuda, dtype=torch.bfloat16) == "plain"
    assert kernels.run("grouped_mm", lambda: "fast", lambda: "plain", device=cuda, dtype=torch.bfloat16) == "plain"
    assert kernels.run("grouped_mm", lambda: "fast", lambda: "plain", device=cuda, dtype=torch.float16) == "fast"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert kernels.run("grouped_mm", lambda: "fast", lambda: "plain", device=cuda, dtype=torch.bfloat16) == "fast"
    monkeypatch.setattr(torch, "__version__", "2.7.1+cu126")
    assert kernels.run("grouped_mm", _refuse, lambda: "plain", device=cuda, dtype=torch.bfloat16) == "plain"
    rows = {(r["capability"], r["dtype"], r["torch"]): r["verdict"] for r in kernels.verdicts()}
    now = str(torch.torch_version.__version__)
    assert rows == {("8.6", "bfloat16", now): kernels.REFUSED, ("8.6", "float16", now): kernels.FAST,
                    ("9.0", "bfloat16", now): kernels.FAST, ("9.0", "bfloat16", "2.7.1+cu126"): kernels.REFUSED}
    assert kernels.verdict("grouped_mm", cuda, torch.bfloat16) == kernels.REFUSED
    assert not kernels.usable("grouped_mm", cuda, torch.bfloat16)
    assert kernels.usable("grouped_mm", cuda, torch.float32)  # not tried yet


def test_running_out_of_memory_or_an_interrupt_is_not_a_refusal():
    from lingbot_core.workflow.errors import Interrupted

    for error in (torch.OutOfMemoryError("CUDA out of memory"), Interrupted("stop")):
        def fails(error=error):
            raise error

        with pytest.raises(type(error)):
            kernels.run("grouped_mm", fails, lambda: "plain", device="cpu", dtype=torch.bfloat16)
    assert kernels.verdicts() == []


def test_unknown_kernels_are_refused_by_name():
    with pytest.raises(KeyError, match="unknown fast kernel 'warp_mm'"):
        kernels.run("warp_mm", lambda: 1, lambda: 2, device="cpu", dtype=None)


def test_relative_error_tells_nan_positions_apart():
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert kernels.relative_error(a, a.clone()) == 0.0
    assert kernels.relative_error(a, torch.tensor([1.0, 2.0, 3.0])) == float("inf")
    assert kernels.differs(a * 1.5, a, 0.1) and kernels.differs(a * 1.01, a, 0.1) is None


def test_every_kernel_family_registers_a_probe_trial():
    assert [row["name"] for row in kernels.describe()] == list(kernels.KERNELS)
    for name in kernels.KERNELS:
        row = kernels.probe(name, "meta", torch.bfloat16)
        assert row["kernel"] == name and "no trial is registered" not in row["reason"], row


def test_probing_grouped_mm_reports_a_refusal_and_keeps_no_good_verdict(monkeypatch, caplog):
    if hasattr(torch, "_grouped_mm"):
        good = kernels.probe("grouped_mm", "cpu", torch.bfloat16)
        assert good["verdict"] == kernels.FAST and kernels.verdicts() == []  # the first real call is the trial
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: _refuse(), raising=False)
    with caplog.at_level(logging.WARNING):
        bad = kernels.probe("grouped_mm", "cpu", torch.bfloat16)
    assert bad["verdict"] == kernels.REFUSED and "no kernel image" in bad["reason"]
    assert not _warnings(caplog)  # the prober says it; the process remembers it
    assert kernels.verdicts() == [bad]
    assert kernels.probe("grouped_mm", "cpu", torch.float32)["verdict"] == kernels.REFUSED  # not a dtype it runs


# -- torch._scaled_mm (fp8 linears) ---------------------------------------------------------------------

def _fp8_layer(wanted="scaled_mm"):
    from lingbot_core.weights.modules import FP8, Packing, QuantizedLinear, pack_fp8

    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) * 0.02
    layer = QuantizedLinear(Packing(FP8, (32, 64)), *pack_fp8(weight), torch.zeros(32), torch.bfloat16)
    layer.fp8_matmul = wanted
    return layer


def _on_a_fake_gpu(monkeypatch, capability=(8, 9)):
    """The CPU passes for a CUDA device with fp8 tensor cores: the fp8 matmul choice admits it and the
    kernel itself (torch's CPU _scaled_mm, or a fake) is what the trial judges."""
    from lingbot_core.weights import fp8

    monkeypatch.setattr(fp8, "scaled_mm_problem", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.parametrize("wanted", ["scaled_mm", "auto"])
def test_a_refusing_scaled_mm_decodes_with_one_warning(monkeypatch, caplog, wanted):
    layer = _fp8_layer(wanted)
    x = torch.randn(5, 64).bfloat16()
    want = torch.nn.functional.linear(x, layer.dequantized_weight(torch.bfloat16), layer.bias.bfloat16())
    _on_a_fake_gpu(monkeypatch)
    assert layer.matmul_path(x) == "scaled_mm"
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: _refuse())
    with caplog.at_level(logging.WARNING):
        got = [layer(x) for _ in range(3)]
    assert all(torch.equal(g, want) for g in got)
    said = _warnings(caplog)
    assert len(said) == 1 and "scaled_mm" in said[0] and "no kernel image" in said[0]
    assert [r["verdict"] for r in kernels.verdicts()] == [kernels.REFUSED]


def test_scaled_mm_on_activations_it_does_not_take_decodes_instead_of_raising(monkeypatch):
    """An explicit scaled_mm on fp16 activations: where the kernel refuses the dtype, the layer decodes."""
    layer = _fp8_layer()
    x = torch.randn(5, 64).half()
    want = torch.nn.functional.linear(x, layer.dequantized_weight(torch.float16), layer.bias.half())
    _on_a_fake_gpu(monkeypatch)

    def bf16_only(*args, out_dtype=None, **kwargs):
        if out_dtype != torch.bfloat16:
            raise RuntimeError("Only bf16 high precision output types are supported for row-wise scaling.")
        return real(*args, out_dtype=out_dtype, **kwargs)

    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", bf16_only)
    assert torch.equal(layer(x), want)
    assert kernels.verdict("scaled_mm", "cpu", torch.float16) == kernels.REFUSED


def test_a_differing_scaled_mm_decodes(monkeypatch, caplog):
    layer = _fp8_layer()
    x = torch.randn(5, 64).bfloat16()
    want = torch.nn.functional.linear(x, layer.dequantized_weight(torch.bfloat16), layer.bias.bfloat16())
    _on_a_fake_gpu(monkeypatch, capability=(12, 0))
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **k: torch.zeros(a.shape[0], b.shape[1], dtype=k["out_dtype"]))
    with caplog.at_level(logging.WARNING):
        assert torch.equal(layer(x), want) and torch.equal(layer(x), want)
    assert len(_warnings(caplog)) == 1
    [row] = kernels.verdicts()
    assert (row["verdict"], row["capability"]) == (kernels.MISMATCH, "-")  # the work ran on the CPU


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="this torch has no _scaled_mm")
def test_a_working_scaled_mm_is_kept_within_its_tolerance(monkeypatch):
    from lingbot_core.weights.fp8 import SCALED_MM_TOLERANCE

    layer = _fp8_layer()
    x = torch.randn(5, 64).bfloat16()
    _on_a_fake_gpu(monkeypatch)
    try:
        torch._scaled_mm(torch.zeros(16, 16, dtype=torch.float8_e4m3fn), torch.zeros(16, 16, dtype=torch.float8_e4m3fn).t(),
                         scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except Exception:
        pytest.skip("this torch has no CPU _scaled_mm")
    got = layer(x)
    want = torch.nn.functional.linear(x, layer.dequantized_weight(torch.bfloat16), layer.bias.bfloat16())
    assert [r["verdict"] for r in kernels.verdicts()] == [kernels.FAST]
    assert 0 < kernels.relative_error(got, want) < SCALED_MM_TOLERANCE  # quantized activations: close, not equal


def test_the_handle_refuses_an_explicit_scaled_mm_that_cannot_run_when_it_opens(monkeypatch, tmp_path):
    """Before anything loads (the folder does not even exist): on the CPU for want of CUDA, on a (faked)
    GPU because the probe's trial failed, with the kernel's reason."""
    from lingbot_core.handle import PipelineHandle

    with pytest.raises(ValueError, match="fp8_matmul scaled_mm cannot run here: fp8 matmuls need a CUDA device"):
        PipelineHandle.open(tmp_path / "missing", device="cpu", fp8_matmul="scaled_mm")
    _on_a_fake_gpu(monkeypatch, capability=(8, 6))
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: _refuse())
    with pytest.raises(ValueError, match="scaled_mm cannot run here: torch._scaled_mm refused: RuntimeError: no kernel"):
        PipelineHandle.open(tmp_path / "missing", device="cpu", fp8_matmul="scaled_mm")


# -- attention backends ---------------------------------------------------------------------------------

def _padded_inputs():
    x, t, text = _inputs(b=2)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0  # the second prompt is shorter: one masked attention call per block
    return x, t, text, mask


def _fake_flash(monkeypatch, *, masks: bool = False, off_by: float = 0.0):
    """diffusers' `flash` on the CPU: SDPA's values (times `off_by` more), refusing a mask as flash-attn
    2 does unless `masks`; returns the backends each call asked for."""
    from lingbot_core.models import transformer as tr

    real = tr.dispatch_attention_fn
    asked = []

    def dispatch(q, k, v, attn_mask=None, backend=None, **kwargs):
        asked.append((backend, attn_mask is not None))
        if backend != "flash":
            return real(q, k, v, attn_mask=attn_mask, backend=backend, **kwargs)
        if attn_mask is not None and not masks:
            raise ValueError("`attn_mask` is not supported for flash-attn 2.")
        return real(q, k, v, attn_mask=attn_mask, backend="native", **kwargs) * (1 + off_by)

    monkeypatch.setattr(tr, "dispatch_attention_fn", dispatch)
    return asked


def test_a_masked_call_on_a_backend_that_takes_no_mask_goes_to_sdpa(monkeypatch, caplog):
    model = random_dit(TINY_MOE)
    x, t, text, mask = _padded_inputs()
    with torch.no_grad():
        want_masked = model(x, t, text, mask).sample
        want_plain = model(x, t, text).sample
        asked = _fake_flash(monkeypatch)
        model.set_attention_backend("flash")
        with caplog.at_level(logging.WARNING):
            got_masked = [model(x, t, text, mask).sample for _ in range(2)]
            got_plain = model(x, t, text).sample
    assert all(torch.equal(g, want_masked) for g in got_masked) and torch.equal(got_plain, want_plain)
    rows = {r["kernel"]: r["verdict"] for r in kernels.verdicts()}
    assert rows == {"attention/flash+mask": kernels.REFUSED, "attention/flash": kernels.FAST}
    assert ("flash", False) in asked  # unmasked calls keep the fast backend
    assert asked.count(("flash", True)) == 1  # tried once, then straight to SDPA
    said = _warnings(caplog)
    assert len(said) == 1 and "attention/flash+mask" in said[0] and "not supported for flash-attn 2" in said[0]


def test_a_backend_diffusers_passes_no_mask_to_is_not_even_tried_with_one(monkeypatch):
    from lingbot_core.models import transformer as tr

    model = random_dit(TINY_MOE)
    x, t, text, mask = _padded_inputs()
    with torch.no_grad():
        want = model(x, t, text, mask).sample
        asked = _fake_flash(monkeypatch, masks=True)
        monkeypatch.setattr(tr, "_takes_mask", lambda name: False)  # it would drop the mask silently
        model.set_attention_backend("flash")
        assert torch.equal(model(x, t, text, mask).sample, want)
    assert ("flash", True) not in asked and kernels.verdicts() == []


def test_a_differing_attention_backend_gives_sdpa_output(monkeypatch, caplog):
    model = random_dit(TINY_MOE)
    x, t, text = _inputs()
    with torch.no_grad():
        want = model(x, t, text).sample
        _fake_flash(monkeypatch, off_by=0.5)
        model.set_attention_backend("flash")
        with caplog.at_level(logging.WARNING):
            got = [model(x, t, text).sample for _ in range(2)]
    assert all(torch.equal(g, want) for g in got)
    assert [r["verdict"] for r in kernels.verdicts()] == [kernels.MISMATCH] and len(_warnings(caplog)) == 1


def test_sdpa_backends_are_the_plain_path_and_never_tried(monkeypatch):
    from lingbot_core.models.transformer import SDPA_BACKENDS

    model = random_dit(TINY_MOE)
    for backend in (None, *SDPA_BACKENDS):
        model.set_attention_backend(backend)
        with torch.no_grad():
            model(*_padded_inputs())
    assert kernels.verdicts() == []


def test_the_handle_refuses_an_attention_backend_that_cannot_run_when_it_opens(monkeypatch, fixtures_root):
    import importlib.util

    from lingbot_core.handle import PipelineHandle

    folder = fixtures_root / "models" / "tiny-dense"
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ValueError, match="attention 'flash' cannot run on cpu in float32: .*flash"):
            PipelineHandle.open(folder, device="cpu", attention_backend="flash")
        kernels.reset()  # the process remembers the refusal; the fakes below install a working "flash"
    from diffusers.models import attention_dispatch

    monkeypatch.setattr(attention_dispatch, "_check_attention_backend_requirements", lambda backend: None)
    _fake_flash(monkeypatch)  # installed, and refusing masks: unmasked trial passes, so the handle opens
    handle = PipelineHandle.open(folder, device="cpu", attention_backend="flash")
    assert handle.shared.attention_backend == "flash" and kernels.verdicts() == []
    _fake_flash(monkeypatch, off_by=1.0)
    with pytest.raises(ValueError, match="attention 'flash' cannot run.*relative error.*mismatch"):
        PipelineHandle.open(folder, device="cpu", attention_backend="flash")
    assert PipelineHandle.open(folder, device="cpu", attention_backend="_native_math").shared.attention_backend


def test_probing_a_masked_variant_reports_the_refusal():
    from diffusers.models import attention_dispatch

    if not hasattr(attention_dispatch, "_check_attention_backend_requirements"):
        pytest.skip("an older diffusers")
    assert kernels.probe("attention/_native_math", "cpu", torch.float32)["verdict"] == kernels.FAST
    row = kernels.probe("attention/_native_flash+mask", "cpu", torch.float32)  # SDPA's flash kernel takes no mask
    assert row["kernel"] == "attention/_native_flash+mask" and row["verdict"] == kernels.REFUSED, row


# -- the Memory Report ------------------------------------------------------------------------------

def test_the_memory_report_shows_each_tried_kernel_with_its_verdict(monkeypatch, fixtures_root):
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.placement.door import memory_report

    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    assert "fast kernel" not in str(memory_report(handle))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    kernels.run("grouped_mm", lambda: _refuse(), lambda: None, device="cuda", dtype=torch.bfloat16)
    kernels.run("attention/flash", lambda: None, lambda: None, device="cpu", dtype=torch.float32)
    report = memory_report(handle)
    text, line = str(report), report.one_line()
    for shown in (text, line):
        assert ("fast kernel grouped_mm on cuda 8.6, bfloat16: refused (RuntimeError: no kernel image is available "
                "for execution on the device)") in shown
        assert "fast kernel attention/flash on cpu, float32: fast" in shown


# -- compiled regions -------------------------------------------------------------------------------

def test_a_compiler_that_fails_leaves_the_blocks_eager_with_one_warning(caplog):
    from lingbot_core.models import compile as regional

    def too_old(graph, example_inputs):
        raise RuntimeError("Found NVIDIA GeForce GTX 1080 which is too old to be supported by the triton GPU compiler")

    model = random_dit(TINY_MOE)
    with torch.no_grad():
        want = model(*_inputs()).sample
        assert regional.compile_blocks(model, backend=too_old) == len(model.blocks)
        with caplog.at_level(logging.WARNING):
            got = [model(*_inputs()).sample for _ in range(2)]
    assert all(torch.equal(g, want) for g in got)
    said = _warnings(caplog)
    assert len(said) == 1 and "compiled_blocks" in said[0] and "too old" in said[0]
    assert [(r["kernel"], r["verdict"]) for r in kernels.verdicts()] == [("compiled_blocks", kernels.REFUSED)]


def test_a_compiled_block_that_differs_is_not_trusted(monkeypatch):
    from lingbot_core.models import compile as regional

    model = random_dit(TINY_MOE)
    with torch.no_grad():
        want = model(*_inputs()).sample
        regional.compile_blocks(model, backend="eager")
        monkeypatch.setattr(regional, "_through", lambda block, compute, inside, *args: block.compute(*args) * 1.5)
        assert torch.equal(model(*_inputs()).sample, want)
    assert [r["verdict"] for r in kernels.verdicts()] == [kernels.MISMATCH]


@pytest.mark.parametrize("class_type", ["LingBotLoader", "LingBotLoaderFiles"])
def test_both_loaders_refuse_an_explicit_kernel_that_cannot_run_when_they_open(monkeypatch, class_type):
    """Not mid-run: the Loader's execute raises with the kernel's reason, before any model loads."""
    from diffusers.models import attention_dispatch

    from lingbot_nodes import NODE_CLASS_MAPPINGS, runtime

    loader = NODE_CLASS_MAPPINGS[class_type]
    args = (("tiny (built-in dense)", "auto", "auto") if class_type == "LingBotLoader"
            else ("(from checkpoint)", "(from checkpoint)", "(from checkpoint)", "tiny (built-in dense)", "(from checkpoint)",
                  "auto"))
    _on_a_fake_gpu(monkeypatch)
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: _refuse())
    with pytest.raises(ValueError, match="scaled_mm cannot run here: torch._scaled_mm refused: RuntimeError: no kernel"):
        loader.execute(*args, attention="default", device="cpu", weights="fp8_e4m3", fp8_matmul="scaled_mm")
    monkeypatch.setattr(runtime, "attention_problem", lambda *a, **k: None)  # the package is there, say
    monkeypatch.setattr(attention_dispatch, "_check_attention_backend_requirements", lambda backend: None)
    _fake_flash(monkeypatch, off_by=1.0)
    with pytest.raises(ValueError, match="attention 'flash' cannot run on cpu in float32: relative error"):
        loader.execute(*args, attention="flash", device="cpu")


@torch.library.custom_op("lingbot_test::refusing_grouped_mm", mutates_args=())
def _refusing_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    raise RuntimeError(SM90_ONLY)


@_refusing_grouped_mm.register_fake
def _(a, b, offs):
    return a.new_empty(a.shape[0], b.shape[-1])


def test_a_kernel_refused_eagerly_is_left_out_of_compiled_blocks(monkeypatch):
    """While the compiler traces nothing is tried: a kernel some trial refused takes its plain path in
    the graph, so the compiled block does not fail on it."""
    from lingbot_core.models import compile as regional

    model = random_dit(TINY_MOE).to(torch.bfloat16)
    monkeypatch.setattr(torch, "_grouped_mm", _refusing_grouped_mm, raising=False)  # traces, refuses when run
    with torch.no_grad():
        want = model(*_inputs()).sample  # grouped_mm refused here, the loop from now on
        regional.compile_blocks(model, backend="eager")
        got = model(*_inputs()).sample
    rows = {r["kernel"]: r["verdict"] for r in kernels.verdicts()}
    assert rows == {"grouped_mm": kernels.REFUSED, "compiled_blocks": kernels.FAST}
    assert kernels.relative_error(got.float(), want.float()) < 1e-2


def test_a_probe_logs_the_warnings_its_kernel_raises_instead_of_showing_them(monkeypatch, caplog):
    """The doctor probes every backend on small inputs; what a library warns about while one runs there
    (torch: flex attention "called without torch.compile()") is about the probe: logged at INFO, not shown."""
    import warnings

    def noisy(device, dtype, variant):
        warnings.warn("this kernel runs unfused here\nSOLUTION: compile it", UserWarning, stacklevel=1)
        return None

    monkeypatch.setitem(kernels._probes, "grouped_mm", noisy)
    with caplog.at_level(logging.INFO, logger=kernels.log.name), warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        row = kernels.probe("grouped_mm", "cpu", torch.bfloat16)
    assert row["verdict"] == kernels.FAST
    assert not [w for w in shown if "unfused" in str(w.message)]
    assert "probing grouped_mm on cpu: UserWarning: this kernel runs unfused here" in caplog.text
