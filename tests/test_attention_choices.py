"""The attention choices come from diffusers' backend registry (what it offers and what is installed
here), FlashAttention-3 and cuDNN included, each through the kernel trial rule; the names the Loaders
offered before stay (saved workflows keep loading). On the CPU through fakes of the registry."""

from __future__ import annotations

import logging

import pytest
import torch

from lingbot_core import kernels
from lingbot_core.handle import attention_choices
from lingbot_core.models import transformer as tr
from lingbot_core.models.sparse_attention import SPARSE


def _installed(monkeypatch, *names: str, missing: tuple[str, ...] = ()) -> None:
    """diffusers' requirement check as if the packages of `names` were installed and those of `missing`
    were not (every other backend: the real check)."""
    from diffusers.models import attention_dispatch

    real = attention_dispatch._check_attention_backend_requirements

    def check(backend):
        if backend.value in missing:
            raise RuntimeError(f"backend {backend.value!r} is not usable: its package is missing")
        if backend.value not in names:
            real(backend)

    monkeypatch.setattr(attention_dispatch, "_check_attention_backend_requirements", check)


def test_the_choices_are_the_registrys_installed_backends_after_the_saved_names(monkeypatch):
    from diffusers.models.attention_dispatch import AttentionBackendName

    _installed(monkeypatch, "sage_varlen", "_flash_varlen_3", missing=("flex",))
    offered = tr.attention_backends()
    assert offered[:len(tr.OFFERED_ALWAYS)] == list(tr.OFFERED_ALWAYS)  # saved workflows' names, always
    assert {"_flash_3", "_native_cudnn"} <= set(offered)  # FlashAttention-3 and cuDNN
    assert "sage_varlen" in offered and "_flash_varlen_3" in offered  # installed: offered
    assert "flex" not in offered  # not installed: not offered
    assert not [n for n in offered if n.endswith(tr.HUB_SUFFIX)]  # no code is fetched at run time
    assert set(offered) <= {b.value for b in AttentionBackendName}
    assert len(offered) == len(set(offered))
    assert attention_choices() == ["default", *offered, SPARSE]

    _installed(monkeypatch, missing=("sage_varlen", "_flash_varlen_3"))
    assert "sage_varlen" not in tr.attention_backends() and "_flash_3" in tr.attention_backends()


def test_both_loaders_offer_the_choices_and_the_old_values_still_validate(monkeypatch):
    from lingbot_nodes.files import LingBotLoaderFiles
    from lingbot_nodes.loader import LingBotLoader, attention_problem_at_run

    _installed(monkeypatch, "sage_varlen")
    for cls in (LingBotLoader, LingBotLoaderFiles):
        spec = {**cls.INPUT_TYPES()["required"], **cls.INPUT_TYPES().get("optional", {})}
        options, extra = spec["attention"]
        assert list(options) == attention_choices() and extra["default"] == "default"
        assert "sage_varlen" in options
    for old in ("default", *tr.OFFERED_ALWAYS, SPARSE):  # a value saved before: never "must be one of"
        problem = attention_problem_at_run(old, "cpu") or ""
        assert "must be one of" not in problem, old
    # a registered backend not installed here: refused with diffusers' reason, not as an unknown name
    _installed(monkeypatch, missing=("sage_varlen",))
    problem = attention_problem_at_run("sage_varlen", "cpu")
    assert problem and "cannot be used here" in problem and "package is missing" in problem
    assert "must be one of" in attention_problem_at_run("warp", "cpu")


def _qkv():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(1, 48, 2, 32, generator=g) for _ in range(3)]


@pytest.mark.parametrize("off_by, verdict", [(None, kernels.REFUSED), (0.5, kernels.MISMATCH)])
def test_a_registry_backend_is_tried_checked_and_falls_back_with_one_warning(monkeypatch, caplog, off_by, verdict):
    """A backend only the registry names (no line of ours mentions it) goes through the trial rule."""
    _installed(monkeypatch, "sage_varlen")
    assert "sage_varlen" in attention_choices()
    real = tr.dispatch_attention_fn
    calls = []

    def dispatch(q, k, v, attn_mask=None, backend=None, **kwargs):
        if backend != "sage_varlen":
            return real(q, k, v, attn_mask=attn_mask, backend=backend, **kwargs)
        calls.append(backend)
        if off_by is None:
            raise RuntimeError("no kernel image is available for execution on the device")
        return real(q, k, v, attn_mask=attn_mask, backend="native", **kwargs) * (1 + off_by)

    monkeypatch.setattr(tr, "dispatch_attention_fn", dispatch)
    q, k, v = _qkv()
    want = real(q, k, v, backend="native")
    with caplog.at_level(logging.WARNING, logger="lingbot_core.kernels"):
        got = [tr.attend(q, k, v, None, "sage_varlen") for _ in range(3)]
    assert all(torch.equal(g, want) for g in got) and calls == ["sage_varlen"]  # tried once
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "attention/sage_varlen" in said[0] and "SDPA" in said[0]
    assert [r["verdict"] for r in kernels.verdicts()] == [verdict]


@pytest.mark.parametrize("backend", ["_flash_3", "_native_cudnn"])
def test_flash_attention_3_and_cudnn_fall_back_to_sdpa_where_they_cannot_run(backend, caplog):
    """Real diffusers on this CPU: neither kernel runs here; the call gives SDPA's output, with one warning."""
    q, k, v = _qkv()
    want = tr.dispatch_attention_fn(q, k, v, backend="native")
    with caplog.at_level(logging.WARNING, logger="lingbot_core.kernels"):
        got = [tr.attend(q, k, v, None, backend) for _ in range(2)]
    assert all(torch.equal(g, want) for g in got)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and f"attention/{backend}" in said[0]
    assert [r["verdict"] for r in kernels.verdicts()] == [kernels.REFUSED]
