"""The LingBot-Video DiT: one transformer over the joint sequence [video tokens; text tokens].

It reads the published `transformer/` and `refiner/` folders unchanged (same `config.json` keys,
same state-dict keys). The architecture comes from one parsed `DiTConfig` (`model.spec`);
diffusers' flat `model.config` is kept alongside for `save_pretrained` and for callers that read it.

Where we part from the reference without changing an output:
- the timestep modulation is computed once per sample and broadcast over the tokens (the reference
  expands it to every token in float32 first: gigabytes at video sizes);
- a batch whose prompts are right-padded runs as one masked attention call through diffusers'
  dispatcher (plain SDPA works) instead of a packed FlashAttention-3 path; pads never reach a real
  token;
- inputs are cast to the weights' dtype here, so a bf16 model also runs without autocast.

Attention goes through `attend`: PyTorch SDPA (diffusers' `native`, the default) directly; any other
backend (flash, flash 3, sage, xformers, cuDNN...) is the `attention/<backend>` kernel of
`lingbot_core.kernels`, tried on its first call, its first query rows compared with SDPA's, and SDPA
serves where it refuses or differs. Masked calls (padded prompts in one batch, Ulysses padding) are
tried as `attention/<backend>+mask`: flash and sage take no mask (diffusers refuses it), so those
calls go to SDPA while unmasked calls keep the fast backend.
`sparse` (not a diffusers backend) is block-sparse attention (`models/sparse_attention.py`), with
its own safeguards and trial; its dense calls are SDPA.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from diffusers.configuration_utils import ConfigMixin
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin

from .. import hooks, kernels
from . import precision, sparse_attention
from .compile import COMPILED_REGION, run_compiled
from .config import DiTConfig
from .layers import CaptionProjection, RMSNorm, SwiGLU
from .moe import SparseMoE
from .rotary import AxialRotary, joint_positions, rotate_pairs
from .shards import is_sharded
from .sparse_attention import SPARSE, SparseSettings, attend_sparse, scope

__all__ = ["BlockRunner", "DiTConfig", "JointBlock", "LingBotVideoTransformer3DModel", "attend"]

#: diffusers attention backends that are PyTorch SDPA choosing its own kernel: the plain path, never tried
SDPA_BACKENDS = ("native", "_native_math")
#: the backends the Loaders offered before their list came from diffusers' registry: always offered (a
#: saved workflow holding one still loads anywhere; where it cannot run it is refused with the reason)
OFFERED_ALWAYS = ("native", "_native_math", "_native_flash", "_native_efficient", "flash", "sage", "xformers",
                  "_flash_3", "_native_cudnn")
#: a backend whose name ends so fetches its kernel from a model hub on first use: not offered (a run
#: downloads no code); it can still be named in Python
HUB_SUFFIX = "_hub"
#: query rows of a fast backend's first result compared with SDPA's (`kernels.run`'s check)
CHECK_QUERIES = 64
#: how far (relative error) a backend's first result may be from SDPA's: both round to the half-precision
#: dtype in another order; backends that quantize queries and keys (sage: int8) get the wider one
ATTENTION_TOLERANCE = 2e-2
QUANTIZED_ATTENTION_TOLERANCE = 0.1

#: runs the block stack: (blocks, x, temb6, rotations, key_mask) -> x
BlockRunner = Callable[[nn.ModuleList, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class SelfAttention(nn.Module):
    """Multi-head self-attention with RMS-normed, rotary-rotated queries and keys."""

    def __init__(self, spec: DiTConfig):
        super().__init__()
        width = spec.hidden_size
        self.heads = (spec.num_attention_heads, spec.head_dim)
        self.to_q = nn.Linear(width, width, bias=spec.qkv_bias)
        self.to_k = nn.Linear(width, width, bias=spec.qkv_bias)
        self.to_v = nn.Linear(width, width, bias=spec.qkv_bias)
        self.norm_q = RMSNorm(spec.head_dim, spec.norm_eps)
        self.norm_k = RMSNorm(spec.head_dim, spec.norm_eps)
        self.to_out = nn.Linear(width, width, bias=spec.out_bias)
        self.backend: str | None = None  # diffusers attention backend name or `sparse`; None = diffusers' default
        self.layer: int | None = None  # the block's index (sparse attention's dense_blocks)

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        q = rotate_pairs(self.norm_q(self.to_q(x).unflatten(-1, self.heads)), rotations)
        k = rotate_pairs(self.norm_k(self.to_k(x).unflatten(-1, self.heads)), rotations)
        v = self.to_v(x).unflatten(-1, self.heads)
        mixed = attend(q, k, v, key_mask, self.backend, layer=self.layer)
        return self.to_out(mixed.flatten(-2).type_as(x))


def _backend_name(backend: str | None) -> str:
    """The diffusers backend a call with `backend` uses: None is diffusers' active default (`native`
    unless DIFFUSERS_ATTN_BACKEND or its `attention_backend` context says otherwise)."""
    if backend is not None:
        return str(backend)
    from diffusers.models import attention_dispatch

    registry = getattr(attention_dispatch, "_AttentionBackendRegistry", None)
    active = getattr(registry, "_active_backend", "native")
    return str(getattr(active, "value", active))


def attention_backends() -> list[str]:
    """The diffusers attention backends offered for the DiTs: `OFFERED_ALWAYS` first, then every other
    backend registered in diffusers' dispatcher whose requirements are met here (its package is
    installed: diffusers' own check), in the registry's order; hub-fetched ones aside (`HUB_SUFFIX`).
    Each backend but SDPA is still tried on its first call (`attend`, `kernels.run`)."""
    from diffusers.models import attention_dispatch

    registry = getattr(attention_dispatch, "_AttentionBackendRegistry", None)
    registered = getattr(registry, "_backends", None)
    names = [getattr(b, "value", str(b)) for b in (registered or attention_dispatch.AttentionBackendName)]
    check = getattr(attention_dispatch, "_check_attention_backend_requirements", None)
    offered = list(OFFERED_ALWAYS)
    for name in names:
        if name in offered or name.endswith(HUB_SUFFIX):
            continue
        if check is not None:
            try:
                check(attention_dispatch.AttentionBackendName(name))
            except Exception:  # noqa: BLE001 - any failure of diffusers' check: not installed here
                continue
        offered.append(name)
    return offered


_TAKES_MASK: dict[str, bool] = {}


def _takes_mask(name: str) -> bool:
    """Whether diffusers passes an `attn_mask` to backend `name` at all (one without the argument would
    drop the mask silently); where the registry cannot say, the trial decides. Read once per backend."""
    if name not in _TAKES_MASK:
        from diffusers.models import attention_dispatch

        registry = getattr(attention_dispatch, "_AttentionBackendRegistry", None)
        names = getattr(registry, "_supported_arg_names", {})
        found = [args for key, args in names.items() if str(getattr(key, "value", key)) == name]
        _TAKES_MASK[name] = not found or "attn_mask" in found[0]
    return _TAKES_MASK[name]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
           backend: str | None, layer: int | None = None) -> torch.Tensor:
    """Attention over (B, S, H, D) q, k, v with an optional (B, 1, 1, S) boolean key mask, through
    diffusers' dispatcher: SDPA directly, any other backend by trial (`lingbot_core.kernels`, kernel
    `attention/<backend>`, `+mask` for a masked call), SDPA where it refuses or differs. `sparse`:
    `sparse_attention.attend_sparse` (`layer`, the block index, for its dense blocks)."""
    if backend == SPARSE:
        return attend_sparse(q, k, v, key_mask, layer,
                             lambda: dispatch_attention_fn(q, k, v, attn_mask=key_mask, backend="native"))
    name = _backend_name(backend)
    if name in SDPA_BACKENDS:
        return dispatch_attention_fn(q, k, v, attn_mask=key_mask, backend=backend)

    def sdpa(queries: torch.Tensor = q) -> torch.Tensor:
        return dispatch_attention_fn(queries, k, v, attn_mask=key_mask, backend="native")

    if key_mask is not None and not _takes_mask(name):
        return sdpa()
    tolerance = QUANTIZED_ATTENTION_TOLERANCE if name.lstrip("_").startswith("sage") else ATTENTION_TOLERANCE

    def against_sdpa(out: torch.Tensor) -> str | None:
        return kernels.differs(out[:, :CHECK_QUERIES], sdpa(q[:, :CHECK_QUERIES]), tolerance)

    kernel = f"attention/{name}" + ("+mask" if key_mask is not None else "")
    return kernels.run(kernel, lambda: dispatch_attention_fn(q, k, v, attn_mask=key_mask, backend=backend), sdpa,
                       device=q.device, dtype=q.dtype, check=against_sdpa)


@kernels.trial_for("attention")
def _attention_trial(device: torch.device, dtype: torch.dtype, variant: str = "") -> str | None:
    """`kernels.probe`'s small trial of backend `variant` (`flash`, `sage+mask`, ...; none: the backend
    diffusers uses by default): 2 heads of 64 over 32 tokens in `dtype` on `device` through `attend`;
    why it cannot be tried at all, or None."""
    name, masked = variant.removesuffix("+mask"), variant.endswith("+mask")
    name = name or _backend_name(None)
    if name in SDPA_BACKENDS:
        return None  # SDPA is the plain path itself
    from diffusers.models import attention_dispatch

    try:
        backend = attention_dispatch.AttentionBackendName(name)
    except ValueError:
        return f"unknown attention backend {name!r}"
    check = getattr(attention_dispatch, "_check_attention_backend_requirements", None)
    if check is not None:
        check(backend)  # a missing package raises with diffusers' own message
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 32, 2, 64, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    mask = None
    if masked:
        mask = torch.ones(1, 1, 1, 32, dtype=torch.bool)
        mask[..., 24:] = False
        mask = mask.to(device)
    attend(q, k, v, mask, name)
    return None


class JointBlock(nn.Module):
    """Attention then FFN, each as a gated residual branch modulated by the timestep.

    A branch computes x + tanh(gate) * post_norm(inner(pre_norm(x) * (1 + scale) + shift)), with
    (shift, scale, gate) taken from the per-sample modulation plus this block's learned table.
    """

    def __init__(self, spec: DiTConfig, layer: int):
        super().__init__()
        width = spec.hidden_size
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 6 * width))
        self.norm1 = RMSNorm(width, spec.norm_eps)
        self.attn = SelfAttention(spec)
        self.attn.layer = layer
        self.norm_post_attn = RMSNorm(width, spec.norm_eps)
        self.norm2 = RMSNorm(width, spec.norm_eps)
        if spec.moe.is_sparse(layer):
            self.ffn: nn.Module = SparseMoE(width, spec.moe)
        else:
            self.ffn = SwiGLU(width, spec.intermediate_size)
        self.norm_post_ffn = RMSNorm(width, spec.norm_eps)
        self.ffn_chunk: int | None = None  # tokens per FFN/MoE pass (`set_ffn_chunk`); None = all at once

    def compute_dtype(self) -> torch.dtype:
        """The dtype the branch inputs are cast to: that of the block's matmul weights."""
        return precision.matmul_dtype(self.attn.to_q)

    def _branch(self, x, pre_norm, inner, post_norm, shift, scale, gate) -> torch.Tensor:
        h = (pre_norm(x) * (1.0 + scale) + shift).to(self.compute_dtype())
        return x + (gate.tanh() * post_norm(inner(h))).to(x.dtype)

    def _ffn_branch(self, x: torch.Tensor, shift, scale, gate) -> torch.Tensor:
        """The FFN branch, over `ffn_chunk` tokens at a time when set: every step of it (norms,
        modulation, FFN or routed experts, gate) is per token, so chunks change no token's math;
        they bound its intermediates (FFN width, MoE routing buffers) to one chunk."""
        chunk = self.ffn_chunk
        if chunk is None or chunk >= x.shape[1]:
            return self._branch(x, self.norm2, self.ffn, self.norm_post_ffn, shift, scale, gate)
        out = torch.empty_like(x)
        for start in range(0, x.shape[1], chunk):
            part = x[:, start:start + chunk]
            out[:, start:start + chunk] = self._branch(part, self.norm2, self.ffn, self.norm_post_ffn, shift, scale, gate)
        return out

    def forward(
        self, x: torch.Tensor, temb6: torch.Tensor, rotations: torch.Tensor, key_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """`temb6`: (B, 1, 6*D) float32 modulation, broadcast over the sequence.

        Runs `compute`, or its compiled form when the block carries a compiled-region hook
        (`models/compile.py`, a named hook in `lingbot_core.hooks`): the other hooks attached to the
        block wrap this method and so stay outside the compiled region."""
        region = hooks.find(self, COMPILED_REGION)
        if region is not None:
            return run_compiled(self, region.compute, x, temb6, rotations, key_mask)
        return self.compute(x, temb6, rotations, key_mask)

    def compute(
        self, x: torch.Tensor, temb6: torch.Tensor, rotations: torch.Tensor, key_mask: torch.Tensor | None
    ) -> torch.Tensor:
        pieces = (temb6 + self.scale_shift_table).chunk(6, dim=-1)
        x = self._branch(x, self.norm1, lambda h: self.attn(h, rotations, key_mask), self.norm_post_attn, *pieces[:3])
        return self._ffn_branch(x, *pieces[3:])


class LingBotVideoTransformer3DModel(ModelMixin, ConfigMixin):
    """Flow-prediction DiT. Build it from a `DiTConfig`, or from `config.json` fields as keywords.

    diffusers learns the config keys from `__init__`'s signature, which is therefore published as
    the `DiTConfig` key list (see the assignment after the class); `from_pretrained`, `from_config`
    and `save_pretrained` work as for any diffusers model.
    """

    _supports_gradient_checkpointing = False
    _no_split_modules = ["JointBlock"]
    _repeated_blocks = ["JointBlock"]  # regional compile (models/compile.py; diffusers reads it too)
    _keep_in_fp32_modules = list(precision.FLOAT32_NAMES)
    _skip_layerwise_casting_patterns = list(precision.FLOAT32_NAMES)

    def __init__(self, spec: DiTConfig | None = None, /, **fields: Any):
        super().__init__()
        if spec is None:
            spec = DiTConfig.from_mapping(fields)
        elif fields:
            raise TypeError("give either a DiTConfig or config.json fields, not both")
        self.register_to_config(**spec.to_mapping())
        self.spec = spec

        width = spec.hidden_size
        self.patch_embedder = nn.Linear(spec.in_channels * spec.patch_volume, width, bias=spec.patch_embed_bias)
        self.text_embedder = CaptionProjection(spec.text_dim, width)
        self.time_proj = Timesteps(spec.freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embedder = TimestepEmbedding(spec.freq_dim, width, act_fn="silu",
                                               sample_proj_bias=spec.timestep_mlp_bias)
        self.time_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 6 * width))
        self.rope = AxialRotary(spec.axes_dims, spec.axes_lens, spec.rope_theta)
        self.blocks = nn.ModuleList(JointBlock(spec, layer) for layer in range(spec.depth))
        self.norm_out = nn.LayerNorm(width, elementwise_affine=False, eps=spec.norm_eps)
        self.norm_out_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))
        self.proj_out = nn.Linear(width, spec.patch_volume * spec.out_channels)
        self.sparse_settings: SparseSettings | None = None  # set with `attention: sparse`

    # -- precision and backends ------------------------------------------------------------------

    def to(self, *args, **kwargs):
        """`nn.Module.to`, except that a cast to bf16/fp16 (any float but float32) stores the
        tensors of `precision.FLOAT32_NAMES` in float32.

        An FSDP-sharded DiT (`distributed/fsdp.py`) moves outside inference mode, where ComfyUI and the
        workflow engine run: under it `Tensor.to` reaches a DTensor as `aten.to.dtype_layout`, which torch
        2.7's DTensor has no rule for (later torch decomposes it), so every FSDP stage failed at the door."""
        if torch.is_inference_mode_enabled() and is_sharded(self):
            with torch.inference_mode(False):
                return self.to(*args, **kwargs)
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if precision.is_split_precision_cast(dtype):
            placed = self if device is None else super().to(device=device, non_blocking=non_blocking)
            precision.cast_split_precision(placed, dtype, non_blocking=non_blocking)
            return placed
        return super().to(*args, **kwargs)

    def set_attention_backend(self, backend: str | None, sparse: SparseSettings | None = None) -> None:
        """Send every attention call to this diffusers backend (None = diffusers' active default), or
        to block-sparse attention (`sparse`, with `sparse` settings; default `sparse_attention.DEFAULTS`)."""
        self.sparse_settings = (sparse or sparse_attention.DEFAULTS) if backend == SPARSE else None
        if backend is not None and backend != SPARSE:
            from diffusers.models.attention_dispatch import AttentionBackendName

            AttentionBackendName(backend)  # an unknown name raises ValueError here, not mid-run
        for module in self.modules():
            if isinstance(module, SelfAttention):
                module.backend = backend

    def set_ffn_chunk(self, tokens: int | None) -> None:
        """Run every block's FFN / MoE over `tokens` tokens at a time (None or 0: the whole sequence).

        Bounds the FFN intermediates and MoE routing buffers to one chunk; see `JointBlock._ffn_branch`.
        `placement.estimate.ffn_chunk_tokens` picks a size for a memory budget."""
        if tokens is not None and int(tokens) < 0:
            raise ValueError(f"an FFN chunk is a number of tokens >= 0 (0 = no chunks), not {tokens}")
        for block in self.blocks:
            block.ffn_chunk = int(tokens) if tokens else None

    # -- token layout ----------------------------------------------------------------------------

    def _patchify(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T, H, W) -> (B, tokens, pt*ph*pw*C): tokens in (t, h, w) order, features patch-major."""
        b, c, t, h, w = x.shape
        pt, ph, pw = self.spec.patch_size
        cut = x.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw)
        return cut.permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(b, (t // pt) * (h // ph) * (w // pw), -1)

    def _unpatchify(self, tokens: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """Inverse of `_patchify` for the output channels."""
        b, _, t, h, w = shape
        pt, ph, pw = self.spec.patch_size
        c = self.spec.out_channels
        cut = tokens.reshape(b, t // pt, h // ph, w // pw, pt, ph, pw, c)
        return cut.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, c, t, h, w)

    def _latent_grid(self, shape: torch.Size) -> tuple[int, int, int]:
        t, h, w = shape[2:]
        pt, ph, pw = self.spec.patch_size
        if t % pt or h % ph or w % pw:
            raise ValueError(f"the latent's (frames, height, width) {(t, h, w)} must be multiples of the "
                             f"model's patch size {tuple(self.spec.patch_size)}")
        return t // pt, h // ph, w // pw

    @staticmethod
    def _text_layout(mask: torch.Tensor | None, batch: int, n_video: int, n_text: int, device: torch.device):
        """Real text length per sample and the (B, 1, 1, S) key mask (None when nothing is padded)."""
        if mask is None:
            return [n_text] * batch, None
        valid = mask.to(device=device).bool()
        lengths = valid.sum(dim=-1).tolist()
        if min(lengths) == n_text:
            return lengths, None
        video_keys = torch.ones(batch, n_video, dtype=torch.bool, device=device)
        return lengths, torch.cat((video_keys, valid), dim=1)[:, None, None, :]

    def _time_embedding(self, timestep: torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
        """(B,) timesteps on the 0..1000 scale -> (B, D) embedding from the float32 timestep MLP."""
        t = timestep.to(device=device).float().reshape(-1).expand(batch)
        return self.time_embedder(self.time_proj(t).to(precision.matmul_dtype(self.time_embedder.linear_1)))

    # -- forward ---------------------------------------------------------------------------------

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        return_dict: bool = True,
        block_runner: BlockRunner | None = None,
    ):
        """Flow prediction for latents (B, C, T, H, W) at timesteps (B,) on the sigma*1000 scale.

        `encoder_attention_mask` (B, L): 1 marks real text tokens, which come first in each row;
        None means every token is real. `block_runner(blocks, x, temb6, rotations, key_mask)`, when
        given, runs the block stack instead of the plain loop (a step cache that may skip blocks
        without calling them); it must return the stack's output for `x`.
        """
        batch = hidden_states.shape[0]
        grid = self._latent_grid(hidden_states.shape)
        n_video = grid[0] * grid[1] * grid[2]
        n_text = encoder_hidden_states.shape[1]
        device = hidden_states.device

        video = self.patch_embedder(self._patchify(hidden_states).to(precision.matmul_dtype(self.patch_embedder)))
        text = self.text_embedder(encoder_hidden_states.to(precision.matmul_dtype(self.text_embedder.linear_1)))
        x = torch.cat((video, text.to(video.dtype)), dim=1)

        text_lens, key_mask = self._text_layout(encoder_attention_mask, batch, n_video, n_text, device)
        rotations = torch.stack([self.rope(joint_positions(n, n_text, grid, device)) for n in text_lens])

        t_emb = self._time_embedding(timestep, batch, device)
        temb6 = self.time_modulation(t_emb).float().unsqueeze(1)
        sparse = contextlib.nullcontext()
        if self.sparse_settings is not None:  # the earliest (noisiest) timestep of the batch decides
            sparse = scope(self.sparse_settings, n_video, float(timestep.detach().float().max()))
        with sparse:
            if block_runner is not None:
                x = block_runner(self.blocks, x, temb6, rotations, key_mask)
            else:
                for block in self.blocks:
                    x = block(x, temb6, rotations, key_mask)

        shift, scale = self.norm_out_modulation(t_emb).float().unsqueeze(1).chunk(2, dim=-1)
        x = self.norm_out(x[:, :n_video]) * (1.0 + scale) + shift
        out = self._unpatchify(self.proj_out(x.to(precision.matmul_dtype(self.proj_out))), hidden_states.shape)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)


def _published_signature() -> inspect.Signature:
    """`(self, spec=None, /, *, <every config.json key>=<default>)`, the signature diffusers reads."""
    defaults = DiTConfig().to_mapping()
    params = [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY),
        inspect.Parameter("spec", inspect.Parameter.POSITIONAL_ONLY, default=None),
    ]
    params += [inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=defaults[key]) for key in DiTConfig.keys()]
    return inspect.Signature(params)


LingBotVideoTransformer3DModel.__init__.__signature__ = _published_signature()  # type: ignore[attr-defined]
