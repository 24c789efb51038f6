"""Hardware recipes: for a GPU's memory and the host's RAM, which model, weights and offload settings fit.

Every answer comes from the estimate and the fit check `auto` decides with (`estimate`, `fit`), on the
published configurations (`lingbot_core/configs/`) built on the `meta` device, so nothing is allocated
and nothing runs: an ESTIMATE until a GPU run confirms it. The README's recipe table
(`bench/recipes.py`) and the doctor's row for the machine it runs on (`python -m lingbot_core.doctor`)
both come from `recipe_for`.

How a recipe is chosen, in order:
1. the model: the MoE when its base pass at 832x480x121 fits, else the dense model;
2. the weights and where the offloaded DiT lives: bf16, then GGUF Q8_0, then Q4_0 with
   `offload_to: ram` (fastest); else `offload_to: disk` with the largest format whose DiT file(s) the
   page cache can still hold (else Q4_0, read from the disk every step);
3. the fastest offload mode that fits, with Decode tiling;
4. the largest base size (`fit.BASE_SIZES`; 121 frames) and, for the MoE, the largest refine size
   (`fit.REFINE_SIZES`) that fit under that setting.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from . import fit as _fit
from .estimate import AUTO_CHUNK, RESERVE_BYTES, Geometry, GiB, ModelSizes, host_bytes
from .fit import BASE_SIZES, REFINE_SIZES, _best_mode

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
DIT_CONFIGS = {"dense": CONFIGS / "dense-1.3b.transformer.json", "moe": CONFIGS / "moe-30b-a3b.transformer.json"}
TEXT_ENCODER_CONFIG = CONFIGS / "qwen3-vl-4b.text_encoder.json"
VAE_CONFIG = CONFIGS / "wan2.1.vae.json"
VARIANTS = ("moe", "dense")  # tried in this order: the MoE when it fits
FORMATS = ("bf16", "GGUF Q8_0", "GGUF Q4_0")
FRAMES = 121
DESKTOP_GIB = 0.5
"""Of a card's memory, what the driver and a desktop take before any run (the README's machines)."""
SYSTEM_GIB = 4.0
"""Of the host's RAM, what the OS and other programs keep."""
NOTHING = "—"


def _config(path: Path) -> dict[str, Any]:
    return {k: v for k, v in json.loads(path.read_text(encoding="utf-8")).items() if not k.startswith("_")}


def meta_dit(variant: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The published DiT of `variant` on the `meta` device (shapes and dtypes only, nothing allocated)."""
    from ..models.transformer import LingBotVideoTransformer3DModel

    with torch.device("meta"):
        model = LingBotVideoTransformer3DModel.from_config(_config(DIT_CONFIGS[variant]))
    if dtype != torch.float32:
        model.to(dtype)  # the fp32-kept modules stay float32, as a load does
    return model.eval().requires_grad_(False)


def meta_components(variant: str) -> dict[str, torch.nn.Module]:
    """Every model component of the published `variant` on `meta`, in the dtypes a GPU loads them in
    (bf16 DiT(s) and text encoder, fp32 VAE)."""
    from diffusers import AutoencoderKLWan
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    with torch.device("meta"):
        text = Qwen3VLForConditionalGeneration(Qwen3VLConfig.from_dict(_config(TEXT_ENCODER_CONFIG)))
        vae = AutoencoderKLWan(**_config(VAE_CONFIG))
    for p in text.parameters():  # parameters only: rotary tables stay float32, as from_pretrained keeps them
        if p.is_floating_point():
            p.data = p.data.to(torch.bfloat16)
    dit = meta_dit(variant)
    components = {"transformer": dit, "text_encoder": text.eval(), "vae": vae.eval()}
    if variant == "moe":
        components["refiner"] = dit  # same class and config as the base DiT; its own weights on disk
    return components


def dit_format_bytes(dit: torch.nn.Module) -> dict[str, int]:
    """Bytes of one DiT per format, from its tensors (quantizable ones packed as `lingbot_core.quantize`
    writes them: Q8_0 34 bytes per 32 values, Q4_0 18 per 32; fp8 one byte per value plus a row scale)."""
    from ..weights.loader import quantizable

    out = dict.fromkeys((*FORMATS, "fp8"), 0)
    for key, t in dit.state_dict().items():
        n, shape = t.numel(), tuple(t.shape)
        packs = quantizable(key, shape) and shape[-1] % 32 == 0
        out["bf16"] += 2 * n
        out["GGUF Q8_0"] += n * 34 // 32 if packs else 2 * n
        out["GGUF Q4_0"] += n * 18 // 32 if packs else 2 * n
        out["fp8"] += n + 4 * (n // shape[-1]) if quantizable(key, shape) else 2 * n
    return out


@functools.cache
def model_facts() -> dict[str, dict[str, Any]]:
    """Per variant (cached: building the MoE on meta takes seconds): `ModelSizes` in bf16 (as `auto` sees
    the published folder), DiT bytes per format, download bytes, and the refiner's bytes (MoE)."""
    facts = {}
    for variant in ("dense", "moe"):
        components = meta_components(variant)
        sizes = ModelSizes.from_modules(components)
        disk = sum(sum(p.numel() for p in m.parameters()) * (4 if n == "vae" else 2) for n, m in components.items())
        facts[variant] = dict(sizes=sizes, dit=dit_format_bytes(components["transformer"]), download=disk,
                              refiner=sizes.refiner if variant == "moe" else 0)
    return facts


def sizes_for(variant: str, fmt: str, facts: dict[str, dict[str, Any]] | None = None) -> ModelSizes:
    """The variant's ModelSizes with its DiT(s) held in `fmt` (the block shrinks in proportion)."""
    facts = (facts or model_facts())[variant]
    sizes, dit = facts["sizes"], facts["dit"]
    ratio = dit[fmt] / dit["bf16"]
    # the pinned copies (group offload's) scale alike: the same tensors, each at its share of the format's bytes
    return replace(sizes, transformer=int(sizes.transformer * ratio), refiner=int(sizes.refiner * ratio),
                   largest_block=int(sizes.largest_block * ratio),
                   pinned_transformer=int(sizes.pinned("transformer") * ratio),
                   pinned_refiner=int(sizes.pinned("refiner") * ratio))


@dataclass(frozen=True)
class Recipe:
    """One machine's recipe; the labels (`vram_gb`, `ram_gb`) name the machine, the rest what fits it."""

    vram_gb: float
    ram_gb: float
    model: str = NOTHING
    files: str = NOTHING
    weights: str = NOTHING
    mode: str = NOTHING
    offload_to: str = NOTHING
    base: str = "nothing fits"
    refine: str = NOTHING
    need_gib: float | None = None  # the fit check's VRAM figure for the headline run (refined when it refines)
    chunk: int | None = None  # the FFN/MoE chunk `ffn_chunk: auto` resolves to for that run (None: whole)

    def settings(self) -> dict[str, str]:
        """What the recipe says to use (everything but the machine's labels)."""
        return {k: getattr(self, k) for k in ("model", "files", "weights", "mode", "offload_to", "base", "refine")}

    def row(self) -> list[str]:
        def gb(v: float) -> str:
            return f"{v:g} GB"

        return [gb(self.vram_gb), gb(self.ram_gb), self.model, self.files, self.weights,
                f"`{self.mode}`" if self.mode != NOTHING else NOTHING,
                f"`{self.offload_to}`" if self.offload_to != NOTHING else NOTHING, self.base, self.refine]


def vram_needed(mode: str, sizes: ModelSizes, geometry: Geometry, vram_bytes: int | None) -> tuple[int, int | None]:
    """The VRAM the fit check says a run needs on a card with `vram_bytes` free (`fit.check`: the estimate,
    an `"auto"` FFN chunk resolved against that card, plus `RESERVE_BYTES`), and that chunk (None: whole
    sequences): the one figure every README table, example and workflow Note prints. `vram_bytes=0`
    gives the least any card needs (`"auto"` at its smallest chunk where chunks help)."""
    verdict = _fit.check(sizes, geometry, mode, vram_free=vram_bytes, host_free=None)
    return verdict.vram_needed + RESERVE_BYTES, verdict.ffn_chunk


def _plan(sizes: ModelSizes, variant: str, dit_bytes: int, to: str, vram: int, host: int,
          ffn_chunk: int | str | None = AUTO_CHUNK) -> dict | None:
    """What fits with these weights and home: the largest base size, the largest refine size (MoE),
    and the fastest mode for the headline run (the refined run when one fits, else the largest base)."""
    def geometry(h: int, w: int, **more: Any) -> Geometry:
        return Geometry(h, w, FRAMES, vae_tiling=True, ffn_chunk=ffn_chunk, **more)

    if to == "disk":  # only worth it when the page cache can keep the DiT file(s) a step reads
        mode = _best_mode(sizes, geometry(480, 832), to, vram, host)
        if mode is None or dit_bytes > host - host_bytes("sequential", sizes, to):
            return None
    bases = [(h, w) for h, w in BASE_SIZES if _best_mode(sizes, geometry(h, w), to, vram, host)]
    if not bases:
        return None
    refine, mode, g = None, None, None
    if variant == "moe":
        for size in REFINE_SIZES:
            g = geometry(480, 832, refine=size, release_base=True)
            mode = _best_mode(sizes, g, to, vram, host)
            if mode:
                refine = size
                break
    if mode is None:
        g = geometry(*bases[0])
        mode = _best_mode(sizes, g, to, vram, host)
    return dict(base=bases[0], refine=refine, mode=mode, geometry=g)


def plan_for(variant: str, sizes: ModelSizes, dit_bytes: int, vram: int, host: int,
             ffn_chunk: int | str | None = AUTO_CHUNK) -> tuple[str, dict] | None:
    """(`offload_to`, plan) for one DiT format given by its `sizes` and file bytes (a format `FORMATS` does not
    list, e.g. a community GGUF): RAM when it fits, else disk; None when neither does. The plan's keys:
    `base`, `refine` (MoE; None when no refine size fits), `mode`, `geometry` (the headline run)."""
    for to in ("ram", "disk"):
        plan = _plan(sizes, variant, dit_bytes, to, vram, host, ffn_chunk)
        if plan is not None:
            return to, plan
    return None


def recipe_for(vram_bytes: int, host_bytes_free: int, *, vram_gb: float | None = None, ram_gb: float | None = None,
               facts: dict[str, dict[str, Any]] | None = None, ffn_chunk: int | str | None = AUTO_CHUNK,
               variants: tuple[str, ...] = VARIANTS) -> Recipe:
    """The recipe for `vram_bytes` of usable accelerator memory and `host_bytes_free` of usable host RAM
    (labelled `vram_gb` / `ram_gb`; by default those bytes in GiB). `ffn_chunk`: the Loaders' FFN chunk
    setting the runs use (their default, `"auto"`: chunked where the card needs it, as the fit check counts);
    `variants`: the models to try, in order (the dense model alone: `("dense",)`)."""
    facts = facts or model_facts()
    label_v = vram_gb if vram_gb is not None else round(vram_bytes / GiB, 1)
    label_r = ram_gb if ram_gb is not None else round(host_bytes_free / GiB, 1)
    for variant in variants:
        fact = facts[variant]
        options = []
        for to in ("ram", "disk"):
            for fmt in FORMATS:
                plan = _plan(sizes_for(variant, fmt, facts), variant, fact["dit"][fmt], to, vram_bytes,
                             host_bytes_free, ffn_chunk)
                if plan is not None and (variant != "moe" or plan["base"][0] * plan["base"][1] >= 480 * 832):
                    options.append((fmt, to, plan))  # rule 1: the MoE only at 832x480 or more
        if not options:
            continue

        def area(hw: tuple[int, int] | None) -> int:
            return hw[0] * hw[1] if hw else 0

        # the best output first (refine size, then base size), then bf16 over smaller formats, RAM over disk
        fmt, to, plan = max(options, key=lambda o: (area(o[2]["refine"]), area(o[2]["base"]),
                                                    -FORMATS.index(o[0]), o[1] == "ram"))
        refine = plan["refine"]
        moe = variant == "moe"
        download = fact["download"] - (fact["refiner"] if moe and refine is None else 0)
        files = f"{variant} folder, {download / 1e9:.1f} GB" + (" (no refiner/)" if moe and refine is None else "")
        weights = fmt if fmt == "bf16" else f"{fmt} (quantize: {fact['dit'][fmt] / 1e9:.1f} GB per DiT)"
        base = plan["base"]
        sizes = sizes_for(variant, fmt, facts)
        need, chunk = vram_needed(plan["mode"], sizes, plan["geometry"], vram_bytes)
        return Recipe(label_v, label_r, "MoE 30B-A3B" if moe else "dense 1.3B", files, weights, plan["mode"], to,
                      f"{base[1]}x{base[0]}x{FRAMES}",
                      f"{refine[1]}x{refine[0]}" if refine else ("no" if moe else NOTHING), need / GiB, chunk)
    return Recipe(label_v, label_r)


def machine_budget(vram_gb: float, ram_gb: float) -> tuple[int, int]:
    """Usable bytes of a card of `vram_gb` GB (read as GiB, less the desktop's share) and of `ram_gb` GB
    of host RAM (less the system's share): the README's machines."""
    return int((vram_gb - DESKTOP_GIB) * GiB), int((ram_gb - SYSTEM_GIB) * GiB)
