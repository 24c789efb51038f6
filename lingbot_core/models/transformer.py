"""The LingBot-Video DiT: a single-stream transformer over [video tokens; text tokens].

It loads the `transformer/` and `refiner/` folders of the published checkpoints as they are (same
config fields, same state-dict keys). Differences from the reference that change no output:
- the timestep modulation is computed once per sample and broadcast over tokens (the reference
  materialises it per token in float32: gigabytes at video sizes);
- a batch with padded text runs through one masked attention call (plain SDPA works), instead of
  the reference's packed FlashAttention-3 path; padded tokens never reach a real token;
- inputs are cast to the weights' dtype here, so a bf16 model also runs without autocast.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin

from .layers import RMSNorm, Rope3D, SwiGLU, apply_rope, joint_positions
from .moe import SparseMoE

FP32_MODULES = (
    "time_embedder",
    "time_modulation",
    "scale_shift_table",
    "norm",
    "norm1",
    "norm2",
    "norm_q",
    "norm_k",
    "norm_post_attn",
    "norm_post_ffn",
    "norm_out",
    "norm_out_modulation",
    "router",
)


def keeps_fp32(name: str) -> bool:
    """A parameter stays float32 when any dotted segment of its name is in FP32_MODULES."""
    return any(part in FP32_MODULES for part in name.split("."))


class TextEmbedder(nn.Module):
    def __init__(self, text_dim: int, hidden_size: int):
        super().__init__()
        self.norm = RMSNorm(text_dim, eps=1e-6)
        self.linear_1 = nn.Linear(text_dim, hidden_size)
        self.linear_2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(self.norm(x))))


class Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, eps: float, qkv_bias: bool, out_bias: bool):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.to_q = nn.Linear(hidden_size, hidden_size, bias=qkv_bias)
        self.to_k = nn.Linear(hidden_size, hidden_size, bias=qkv_bias)
        self.to_v = nn.Linear(hidden_size, hidden_size, bias=qkv_bias)
        self.norm_q = RMSNorm(self.head_dim, eps)
        self.norm_k = RMSNorm(self.head_dim, eps)
        self.to_out = nn.Linear(hidden_size, hidden_size, bias=out_bias)
        self.backend: str | None = None

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        heads = (self.num_heads, self.head_dim)
        q = apply_rope(self.norm_q(self.to_q(x).unflatten(2, heads)), rotations)
        k = apply_rope(self.norm_k(self.to_k(x).unflatten(2, heads)), rotations)
        v = self.to_v(x).unflatten(2, heads)
        out = dispatch_attention_fn(q, k, v, attn_mask=key_mask, backend=self.backend)
        return self.to_out(out.flatten(2).type_as(x))


class LingBotVideoBlock(nn.Module):
    def __init__(self, cfg: dict, layer_idx: int):
        super().__init__()
        d, eps = cfg["hidden_size"], cfg["norm_eps"]
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 6 * d))
        self.norm1 = RMSNorm(d, eps)
        self.attn = Attention(d, cfg["num_attention_heads"], eps, cfg["qkv_bias"], cfg["out_bias"])
        self.norm_post_attn = RMSNorm(d, eps)
        self.norm2 = RMSNorm(d, eps)
        sparse = (
            cfg["num_experts"] > 0
            and layer_idx not in tuple(cfg["mlp_only_layers"])
            and (layer_idx + 1) % cfg["decoder_sparse_step"] == 0
        )
        if sparse:
            self.ffn: nn.Module = SparseMoE(
                d,
                cfg["num_experts"],
                cfg["num_experts_per_tok"],
                cfg["moe_intermediate_size"],
                cfg["score_func"],
                cfg["norm_topk_prob"],
                cfg["n_group"],
                cfg["topk_group"],
                cfg["routed_scaling_factor"],
                cfg["n_shared_experts"],
            )
        else:
            self.ffn = SwiGLU(d, cfg["intermediate_size"])
        self.norm_post_ffn = RMSNorm(d, eps)

    def forward(
        self, x: torch.Tensor, temb6: torch.Tensor, rotations: torch.Tensor, key_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """temb6: (B, 1, 6D) float32, broadcast over the sequence."""
        mod = temb6 + self.scale_shift_table
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = mod.chunk(6, dim=-1)
        compute_dtype = self.attn.to_q.weight.dtype
        a = (self.norm1(x) * (1.0 + scale_a) + shift_a).to(compute_dtype)
        x = x + (gate_a.tanh() * self.norm_post_attn(self.attn(a, rotations, key_mask))).to(x.dtype)
        f = (self.norm2(x) * (1.0 + scale_f) + shift_f).to(compute_dtype)
        return x + (gate_f.tanh() * self.norm_post_ffn(self.ffn(f))).to(x.dtype)


class LingBotVideoTransformer3DModel(ModelMixin, ConfigMixin):
    _supports_gradient_checkpointing = False
    _no_split_modules = ["LingBotVideoBlock"]
    _keep_in_fp32_modules = list(FP32_MODULES)
    _skip_layerwise_casting_patterns = list(FP32_MODULES)

    @register_to_config
    def __init__(
        self,
        patch_size: tuple[int, int, int] = (1, 2, 2),
        in_channels: int = 16,
        out_channels: int = 16,
        hidden_size: int = 2048,
        num_attention_heads: int = 16,
        depth: int = 24,
        intermediate_size: int = 6144,
        text_dim: int = 2560,
        freq_dim: int = 256,
        norm_eps: float = 1e-6,
        rope_theta: float = 256.0,
        axes_dims: tuple[int, int, int] = (32, 48, 48),
        axes_lens: tuple[int, int, int] = (8192, 1024, 1024),
        qkv_bias: bool = False,
        out_bias: bool = True,
        patch_embed_bias: bool = True,
        timestep_mlp_bias: bool = True,
        num_experts: int = 0,
        num_experts_per_tok: int = 8,
        moe_intermediate_size: int = 512,
        decoder_sparse_step: int = 1,
        mlp_only_layers: tuple[int, ...] = (),
        n_shared_experts: int | None = None,
        score_func: str = "sigmoid",
        norm_topk_prob: bool = True,
        n_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
    ):
        super().__init__()
        head_dim = hidden_size // num_attention_heads
        if head_dim * num_attention_heads != hidden_size or sum(axes_dims) != head_dim:
            raise ValueError(
                f"config mismatch: hidden_size {hidden_size} / {num_attention_heads} heads must give a head_dim "
                f"equal to sum(axes_dims)={sum(axes_dims)}"
            )
        cfg = dict(self.config)
        patch_dim = in_channels * math.prod(patch_size)
        self.patch_embedder = nn.Linear(patch_dim, hidden_size, bias=patch_embed_bias)
        self.time_proj = Timesteps(freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embedder = TimestepEmbedding(freq_dim, hidden_size, act_fn="silu", sample_proj_bias=timestep_mlp_bias)
        self.time_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        self.text_embedder = TextEmbedder(text_dim, hidden_size)
        self.rope = Rope3D(tuple(axes_dims), tuple(axes_lens), rope_theta)
        self.blocks = nn.ModuleList([LingBotVideoBlock(cfg, i) for i in range(depth)])
        self.norm_out = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=norm_eps)
        self.norm_out_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))
        self.proj_out = nn.Linear(hidden_size, math.prod(patch_size) * out_channels)

    # -- dtype handling -------------------------------------------------------------------------
    def to(self, *args, **kwargs):
        """Like nn.Module.to, but a cast to a half dtype keeps the FP32_MODULES in float32."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is None or dtype == torch.float32 or not dtype.is_floating_point:
            return super().to(*args, **kwargs)
        if device is not None:
            super().to(device=device, non_blocking=non_blocking)
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(torch.float32 if keeps_fp32(name) else dtype, non_blocking=non_blocking)
        return self

    def set_attention_backend(self, backend: str | None) -> None:
        """Route every attention call through diffusers' dispatcher with this backend (None = active default)."""
        if backend is not None:
            from diffusers.models.attention_dispatch import AttentionBackendName

            AttentionBackendName(backend)  # raises ValueError for an unknown name
        for module in self.modules():
            if isinstance(module, Attention):
                module.backend = backend

    # -- forward --------------------------------------------------------------------------------
    def _patchify(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        pt, ph, pw = self.config.patch_size
        x = x.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw)
        return x.permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(b, (t // pt) * (h // ph) * (w // pw), -1)

    def _unpatchify(self, tokens: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        b, _, t, h, w = shape
        pt, ph, pw = self.config.patch_size
        c = self.config.out_channels
        x = tokens.reshape(b, t // pt, h // ph, w // pw, pt, ph, pw, c)
        return x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, c, t, h, w)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        return_dict: bool = True,
    ):
        """Flow prediction for latents (B, C, T, H, W) at timesteps (B,) on the sigma*1000 scale.

        `encoder_attention_mask` (B, L), 1 = valid, valid tokens left-aligned; None means all valid.
        """
        b, _, t, h, w = hidden_states.shape
        pt, ph, pw = self.config.patch_size
        if t % pt or h % ph or w % pw:
            raise ValueError(f"latent size {(t, h, w)} is not divisible by patch_size {tuple(self.config.patch_size)}")
        grid = (t // pt, h // ph, w // pw)
        n_video = math.prod(grid)
        n_text = encoder_hidden_states.shape[1]
        device = hidden_states.device

        weight_dtype = self.patch_embedder.weight.dtype
        video = self.patch_embedder(self._patchify(hidden_states).to(weight_dtype))
        text = self.text_embedder(encoder_hidden_states.to(self.text_embedder.linear_1.weight.dtype))
        x = torch.cat([video, text.to(video.dtype)], dim=1)

        if encoder_attention_mask is None:
            text_lens = [n_text] * b
            key_mask = None
        else:
            valid = encoder_attention_mask.to(device=device).bool()
            text_lens = valid.sum(-1).tolist()
            key_mask = None
            if min(text_lens) < n_text:
                full = torch.ones(b, n_video, dtype=torch.bool, device=device)
                key_mask = torch.cat([full, valid], dim=1)[:, None, None, :]
        rotations = torch.stack([self.rope(joint_positions(n, n_text, grid, device)) for n in text_lens])

        timestep = timestep.to(device=device).float().reshape(-1).expand(b)
        t_emb = self.time_embedder(self.time_proj(timestep).to(self.time_embedder.linear_1.weight.dtype))
        temb6 = self.time_modulation(t_emb).float().unsqueeze(1)

        for block in self.blocks:
            x = block(x, temb6, rotations, key_mask)

        shift, scale = self.norm_out_modulation(t_emb).float().unsqueeze(1).chunk(2, dim=-1)
        x = self.norm_out(x[:, :n_video]) * (1.0 + scale) + shift
        out = self._unpatchify(self.proj_out(x.to(self.proj_out.weight.dtype)), hidden_states.shape)
        if not return_dict:
            return (out,)
        return Transformer2DModelOutput(sample=out)
