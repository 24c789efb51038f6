"""Random-weight LingBot-Video checkpoints, built offline, in the real on-disk layout.

Why: the README's run command and most tests need a complete checkpoint (DiT, VAE, Qwen3-VL text
encoder, processor with tokenizer, scheduler config) that runs on a laptop CPU in seconds and that a
fresh machine can produce without downloading anything. The folders written here have the same file
names and config styles as `robbyant/lingbot-video-dense-1.3b` / `-moe-30b-a3b`, so the ordinary
loader reads them; only the sizes are tiny and the weights random.

Everything is derived from the installed packages plus the constants in this file, and every tensor
is drawn from its own generator seeded by (seed, component, parameter name): the same seed gives
byte-identical safetensors files with the same library versions.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .components import REFINER, TRANSFORMER

__all__ = [
    "TINY_FORMAT_VERSION",
    "TINY_MARKER",
    "TINY_VARIANTS",
    "STUDENT_VARIANT",
    "build_tiny_checkpoint",
    "default_tiny_dir",
    "ensure_tiny_checkpoint",
    "is_tiny_checkpoint",
]

logger = logging.getLogger(__name__)

TINY_FORMAT_VERSION = 1
"""Bump when the generated content changes, so cached checkpoints get rebuilt."""

TINY_MARKER = "lingbot_tiny.json"
"""Written last into a finished build: variant, seed, format version and the size of every file."""

TINY_VARIANTS = ("dense", "moe", "moe-dmd")
STUDENT_VARIANT = "moe-dmd"
"""Laid out like the published DMD student root (`robbyant/lingbot-video-moe-dmd-30b-a3b`): the MoE
architecture, its own transformer weights (a stand-in for the distilled student), the base's text
encoder, processor and VAE, and no refiner/."""

# --- sizes -------------------------------------------------------------------------------------------

_TEXT_HIDDEN = 32  # Qwen3-VL text hidden size; the DiT's text_dim must equal it (no adapter in between)
_TOKENIZER_MAX_VOCAB = 1024

_SPECIAL_TOKENS = (
    "<|endoftext|>",  # id 0, also the pad token
    "<|im_start|>",
    "<|im_end|>",  # id 2, the eos token of the text config
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Wan 2.1 latent statistics (the AutoencoderKLWan defaults); written explicitly so that a later diffusers
# default cannot change the file.
_WAN_LATENTS_MEAN = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
]  # fmt: skip
_WAN_LATENTS_STD = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916,
]  # fmt: skip

_VAE_CONFIG: dict[str, Any] = {
    "base_dim": 8,
    "decoder_base_dim": None,
    "z_dim": 16,
    "dim_mult": [1, 2, 2, 2],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "latents_mean": _WAN_LATENTS_MEAN,
    "latents_std": _WAN_LATENTS_STD,
    "is_residual": False,
    "in_channels": 3,
    "out_channels": 3,
    "patch_size": None,
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 8,
}

_DIT_CONFIG: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "in_channels": 16,
    "out_channels": 16,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "depth": 2,
    "intermediate_size": 64,
    "text_dim": _TEXT_HIDDEN,
    "freq_dim": 32,
    "norm_eps": 1e-6,
    "rope_theta": 256.0,
    "axes_dims": (4, 6, 6),
    "axes_lens": (256, 64, 64),
    "qkv_bias": False,
    "out_bias": True,
    "patch_embed_bias": True,
    "timestep_mlp_bias": True,
    # dense: the class defaults (no experts); the MoE variant overrides these below
    "num_experts": 0,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "mlp_only_layers": (),
    "n_shared_experts": None,
    "score_func": "sigmoid",
    "norm_topk_prob": True,
    "n_group": None,
    "topk_group": None,
    "routed_scaling_factor": 1.0,
}

_DIT_MOE_OVERRIDES: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
}

_SCHEDULER_CONFIG: dict[str, Any] = {
    "_class_name": "FlowUniPCMultistepScheduler",
    "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995,
    "final_sigmas_type": "zero",
    "lower_order_final": True,
    "num_train_timesteps": 1000,
    "predict_x0": True,
    "prediction_type": "flow_prediction",
    "sample_max_value": 1.0,
    "shift": 1.0,
    "solver_order": 2,
    "solver_p": None,
    "solver_type": "bh2",
    "steps_offset": 0,
    "thresholding": False,
    "timestep_spacing": "linspace",
    "use_dynamic_shifting": False,
}

_MODEL_INDEX_COMPONENTS: dict[str, list[str]] = {
    "processor": ["transformers", "Qwen3VLProcessor"],
    "scheduler": ["lingbot_video.scheduling_flow_unipc", "FlowUniPCMultistepScheduler"],
    "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
    "transformer": ["lingbot_video.transformer_lingbot_video", "LingBotVideoTransformer3DModel"],
    "vae": ["diffusers", "AutoencoderKLWan"],
}

# Same rendering as the Qwen3-VL template for plain text / image / video content, without tools.
_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# BPE training text: the flavour of the LingBot system prompt, JSON captions and negatives, and common
# words. Any text still round-trips (byte-level BPE); this only decides which words get short ids.
_CORPUS = (
    "system\nuser\nassistant\n",
    "Given a user input that may include a text prompt alone, a text prompt with an image reference, "
    'or a text prompt with a video reference or a video reference alone, generate an "Enhanced prompt" '
    "that provides detailed visual descriptions suitable for video generation. Evaluate the level of detail "
    "in the user's input: if it is simple, enrich it by adding specifics about colors, shapes, sizes, "
    "textures, lighting, motion dynamics, camera movement, temporal progression, and spatial relationships "
    "to create vivid, concrete, and temporally coherent scenes. Please generate only the enhanced "
    "description for the prompt below and avoid including any additional commentary or evaluations:",
    '{"subject": "a red fox", "action": "runs across a snowy field", "scene": {"setting": "forest edge", '
    '"time_of_day": "golden hour", "weather": "light snow"}, "camera": {"shot": "wide shot", '
    '"movement": "slow pan left", "lens": "35mm"}, "lighting": "warm backlight", "style": "photorealistic", '
    '"colors": ["orange", "white", "deep blue"], "motion": ["steady", "smooth"], "duration": 5}',
    '{"caption":"A small boat drifts on a calm lake at dawn.","camera":{"shot":"close-up",'
    '"movement":"static"},"style":"cinematic","quality":["high detail","sharp focus"]}',
    '{"universal_negative": {"visual_quality": ["low quality", "worst quality", "blurry", "pixelated", '
    '"jpeg artifacts", "low resolution", "color flicker", "overexposed"], "artistic_style": ["painting", '
    '"cartoon", "3d render", "sketch"], "composition_and_content": ["text", "watermark", "logo", '
    '"subtitles"], "temporal_and_motion_stability": ["flickering", "jittery", "motion blur", "warping", '
    '"morphing", "unnatural movement", "frame-to-frame inconsistency"]}}',
    "the of and to in is that it was for on are as with his they at be this from have or by one had not "
    "but what all were when we there can an your which their said if do will each about how up out them "
    "then she many some so these would other into has more her two like him see time could no make than "
    "first been its who now people my made over did down only way find use may water long little very "
    "after words called just where most know get through back much go good new write our me man too any "
    "day same right look think also around another came come work three word must because does part even "
    "place well such here take why things help put years different away again off went old number great "
    "tell men say small every found still between name should home big give air line set own under read "
    "last never us left end along while might next sound below saw something thought both few those always "
    "looked show large often together asked house world going want school important until form food keep "
    "children feet land side without boy once animals life enough took sometimes four head above kind "
    "began almost live page got earth need far hand high year mother light parts country father let night "
    "following picture being study second eyes soon times story boys since white days ever paper hard near "
    "sentence better best across during today others however sure means knew try told young miles sun "
    "ways thing whole hear example heard several change answer room sea against top turned learn point "
    "city play toward five using himself usually woman girl walks slowly red green blue black bright dark "
    "soft warm cold fast slow sky tree street car dog cat bird river mountain ocean forest rain snow wind "
    "smile hair face hands walking running flying standing sitting holding looking moving turning",
    "0 1 2 3 4 5 6 7 8 9 10 24 30 60 100 16:9 9:16 4K 1080p - _ . , : ; ! ? ( ) [ ] { } \" ' / \\ # % & * + =",
)

_ENCODING = "utf-8"


# --- public API --------------------------------------------------------------------------------------


def tiny_dit_config(variant: str = "dense") -> dict[str, Any]:
    """The tiny DiT's config of `variant` (what `transformer/config.json` of a tiny build holds, less
    the diffusers bookkeeping): single-file loading knows this shape as well as the published ones."""
    _check_variant(variant)
    config = {**_DIT_CONFIG, **(_DIT_MOE_OVERRIDES if _architecture(variant) == "moe" else {})}
    return json.loads(json.dumps(config))  # tuples as lists, as a config file holds them


def tiny_text_encoder_config() -> dict[str, Any]:
    """The tiny text encoder's config (as `text_encoder/config.json` of a tiny build holds it, vocabulary
    size left to the file): single-file loading knows this shape as well as Qwen3-VL-4B's. The special
    tokens take the first ids, in `_SPECIAL_TOKENS` order, as `_build_tokenizer` trains them."""
    class _Ids:
        @staticmethod
        def convert_tokens_to_ids(token: str) -> int:
            return _SPECIAL_TOKENS.index(token)

    return _text_encoder_config(len(_SPECIAL_TOKENS), _Ids()).to_dict()


def default_tiny_dir(variant: str = "dense") -> Path:
    """Per-user cache folder of the tiny checkpoint, so it is built once and reused by every run.

    `$LINGBOT_TINY_DIR/tiny-<variant>` when the variable is set (a parent folder, so both variants can live
    side by side), else `$XDG_CACHE_HOME` or `~/.cache`, then `lingbot-nodes/tiny-<variant>`.
    """
    _check_variant(variant)
    return cache_root() / f"tiny-{variant}"


def cache_root() -> Path:
    """The per-user folder of everything lingbot-nodes builds once and reuses (tiny checkpoints, the
    converted-weights cache of disk offload): `$LINGBOT_TINY_DIR`, else `$XDG_CACHE_HOME` or
    `~/.cache`, then `lingbot-nodes`."""
    root = os.environ.get("LINGBOT_TINY_DIR")
    if root:
        return Path(root).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "lingbot-nodes"


def check_cache_folder(folder: Path) -> None:
    """Refuse, with the fix, a cache folder that cannot be made because a file is in its way (the cache
    root or one of its parents is a file: `LINGBOT_TINY_DIR=~/somefile`, say)."""
    for where in (folder, *folder.parents):
        if where.exists() or where.is_symlink():
            if not where.is_dir():
                root = cache_root()
                raise NotADirectoryError(
                    f"the lingbot-nodes cache folder {root} cannot be used: {where} is a file, not a folder. Set "
                    "LINGBOT_TINY_DIR (or XDG_CACHE_HOME) to a folder, or move that file away.")
            return


def ensure_tiny_checkpoint(variant: str = "dense") -> Path:
    """The default tiny checkpoint of `variant` (seed 0) in the user cache, built on first use."""
    return build_tiny_checkpoint(default_tiny_dir(variant), variant)


def is_tiny_checkpoint(
    folder: str | os.PathLike[str], variant: str | None = None, seed: int | None = None
) -> bool:
    """True when `folder` holds a finished tiny build of this format (and of `variant` / `seed` if given).

    Every file listed in the marker must exist with its recorded size, so a deleted or truncated file makes
    the folder count as incomplete.
    """
    folder = Path(folder)
    try:
        marker = json.loads((folder / TINY_MARKER).read_text(encoding=_ENCODING))
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or marker.get("format_version") != TINY_FORMAT_VERSION:
        return False
    if variant is not None and marker.get("variant") != variant:
        return False
    if seed is not None and marker.get("seed") != seed:
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for rel, size in files.items():
        path = folder / rel
        try:
            if not path.is_file() or path.stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def build_tiny_checkpoint(
    folder: str | os.PathLike[str], variant: str = "dense", *, seed: int = 0, overwrite: bool = False
) -> Path:
    """Write a random-weight LingBot-Video checkpoint of `variant` to `folder`: "dense", "moe" (with a
    refiner), or "moe-dmd" (`STUDENT_VARIANT`: the DMD student release's layout, no refiner/).

    Returns the existing folder untouched when it already holds a complete build of the same variant,
    seed and format (unless `overwrite`). The build goes to a temporary sibling folder that is renamed
    into place at the end, so an interrupted build never leaves a folder that looks complete. A non-empty
    folder that is not a tiny checkpoint is never replaced (FileExistsError).
    """
    _check_variant(variant)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    folder = Path(folder).expanduser().absolute()
    if not overwrite and is_tiny_checkpoint(folder, variant, seed):
        return folder
    check_cache_folder(folder.parent)
    _check_replaceable(folder)

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{uuid.uuid4().hex[:12]}")
    tmp.mkdir()  # not mkdtemp: the renamed folder should get the usual umask permissions, not 0700
    try:
        logger.info("building tiny LingBot-Video %s checkpoint (seed %d) at %s", variant, seed, folder)
        _write_checkpoint(tmp, variant, seed)
        _install(tmp, folder, variant, seed, overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


# --- install / marker --------------------------------------------------------------------------------


def _check_variant(variant: str) -> None:
    if variant not in TINY_VARIANTS:
        raise ValueError(f"unknown tiny checkpoint variant {variant!r}; expected one of {TINY_VARIANTS}")


def _architecture(variant: str) -> str:
    """The DiT architecture of a tiny variant: the student root is a MoE."""
    return "moe" if variant == STUDENT_VARIANT else variant


def _check_replaceable(folder: Path) -> None:
    """Refuse to replace a user's folder: only empty folders and earlier tiny builds may go."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise FileExistsError(f"{folder} exists and is not a folder; not writing a tiny checkpoint there")
    if (folder / TINY_MARKER).is_file() or not any(folder.iterdir()):
        return
    raise FileExistsError(
        f"{folder} is not empty and is not a tiny LingBot checkpoint (no {TINY_MARKER}); refusing to replace it"
    )


def _install(tmp: Path, folder: Path, variant: str, seed: int, overwrite: bool) -> None:
    """Move the finished build into place. Another process may have finished the same build first."""
    try:
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        os.rename(tmp, folder)
        return
    except OSError:
        if not folder.exists():
            raise
    if not overwrite and is_tiny_checkpoint(folder, variant, seed):
        return  # a concurrent build of the same checkpoint won; ours is discarded by the caller
    _check_replaceable(folder)
    old = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(folder, old)
    os.rename(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def _write_marker(root: Path, variant: str, seed: int) -> None:
    files = {p.relative_to(root).as_posix(): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}
    marker = {"format_version": TINY_FORMAT_VERSION, "variant": variant, "seed": seed, "files": files}
    _write_json(root / TINY_MARKER, marker)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding=_ENCODING)


# --- the build ---------------------------------------------------------------------------------------


def _write_checkpoint(root: Path, variant: str, seed: int) -> None:
    import diffusers
    import torch

    with _quiet_progress_bars(), _float32_default(torch), torch.random.fork_rng(devices=[]):
        # Module constructors draw from the global RNG: seed it (inside the fork, so the caller's RNG state
        # is untouched) although every tensor is overwritten from its own generator afterwards.
        torch.manual_seed(seed)
        tokenizer = _build_tokenizer()
        _write_processor(root / "processor", tokenizer)
        _write_text_encoder(root / "text_encoder", len(tokenizer), tokenizer, seed)
        _write_vae(root / "vae", seed)
        # The student's transformer draws from its own streams: the same architecture as the tiny MoE's,
        # other weights (so a test can tell which DiT ran); the text encoder, processor and VAE are the base's.
        _write_transformer(root / TRANSFORMER, _architecture(variant), seed,
                           "transformer-dmd" if variant == STUDENT_VARIANT else TRANSFORMER)
        if variant == "moe":
            _write_transformer(root / REFINER, variant, seed, REFINER)
    version = {"_diffusers_version": diffusers.__version__}
    _write_json(root / "scheduler" / "scheduler_config.json", {**_SCHEDULER_CONFIG, **version})
    _write_json(
        root / "model_index.json",
        {"_class_name": "LingBotVideoPipeline", **version, **_MODEL_INDEX_COMPONENTS},
    )
    _write_marker(root, variant, seed)  # last: its presence means the build finished
    # safetensors writes its files 0600; give every file the mode a plain write gets (umask applied).
    mode = (root / TINY_MARKER).stat().st_mode & 0o777
    for path in root.rglob("*"):
        if path.is_file():
            path.chmod(mode)


@contextlib.contextmanager
def _float32_default(torch: Any) -> Iterator[None]:
    """Build in float32 even if the caller changed torch's default dtype (the checkpoints are fp32)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """save_pretrained draws progress bars; a silent cache build should not."""
    from diffusers.utils import logging as d_logging
    from transformers.utils import logging as t_logging

    was = (t_logging.is_progress_bar_enabled(), d_logging.is_progress_bar_enabled())
    t_logging.disable_progress_bar()
    d_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was[0]:
            t_logging.enable_progress_bar()
        if was[1]:
            d_logging.enable_progress_bar()


def _build_tokenizer() -> Any:
    """A small byte-level BPE with the Qwen special tokens at ids 0-6, wrapped as transformers 5 does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import TokenizersBackend

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TOKENIZER_MAX_VOCAB,
        min_frequency=1,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(list(_CORPUS), trainer=trainer)
    return TokenizersBackend(
        tokenizer_object=backend,
        pad_token=_SPECIAL_TOKENS[0],
        extra_special_tokens=list(_SPECIAL_TOKENS[1:]),
    )


def _write_processor(path: Path, tokenizer: Any) -> None:
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    common = {
        "patch_size": 16,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
    }
    image_processor = Qwen2VLImageProcessor(size={"shortest_edge": 65536, "longest_edge": 16777216}, **common)
    video_processor = Qwen3VLVideoProcessor(
        size={"shortest_edge": 131072, "longest_edge": 786432},
        fps=2,
        min_frames=4,
        max_frames=768,
        do_sample_frames=True,
        **common,
    )
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    # The published checkpoint also carries the older per-component files; write them too.
    image_processor.save_pretrained(path)
    video_processor.save_pretrained(path)


def _text_encoder_config(vocab_size: int, tokenizer: Any) -> Any:
    from transformers import Qwen3VLConfig

    # The model finds images and videos by these ids: they must be the tokenizer's.
    ids = {
        "image_token_id": tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        "video_token_id": tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        "vision_start_token_id": tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        "vision_end_token_id": tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    }
    return Qwen3VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": _TEXT_HIDDEN,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "pad_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
            "bos_token_id": None,
            # mrope sections (t, h, w) sum to head_dim / 2
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": _TEXT_HIDDEN,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0, 1],
        },
        tie_word_embeddings=True,
        **ids,
    )


def _write_text_encoder(path: Path, vocab_size: int, tokenizer: Any, seed: int) -> None:
    from transformers import Qwen3VLForConditionalGeneration

    config = _text_encoder_config(vocab_size, tokenizer)
    model = Qwen3VLForConditionalGeneration(config).eval()
    _randomize(model, seed, "text_encoder")
    model.save_pretrained(path, safe_serialization=True)


def _write_vae(path: Path, seed: int) -> None:
    import torch
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(**_VAE_CONFIG).eval()
    _randomize(vae, seed, "vae")
    with torch.no_grad():
        # Posterior log-variance around -4: encodes are close to their mean, as in a trained VAE.
        z = _VAE_CONFIG["z_dim"]
        g = _generator(seed, "vae", "quant_conv.bias#logvar")
        vae.quant_conv.bias[z:] = -4.0 + 0.1 * torch.randn(z, generator=g)
    vae.save_pretrained(path, safe_serialization=True)


def _write_transformer(path: Path, variant: str, seed: int, component: str) -> None:

    from .models.transformer import LingBotVideoTransformer3DModel

    config = dict(_DIT_CONFIG)
    if variant == "moe":
        config.update(_DIT_MOE_OVERRIDES)
    model = LingBotVideoTransformer3DModel(**config).eval()
    _randomize(model, seed, component)
    model.save_pretrained(path, safe_serialization=True)


# --- deterministic random weights --------------------------------------------------------------------


def _generator(seed: int, component: str, name: str) -> Any:
    """An independent CPU generator per tensor: adding a parameter elsewhere changes no other tensor."""
    import torch

    digest = hashlib.sha256(f"lingbot-tiny/{seed}/{component}/{name}".encode(_ENCODING)).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _randomize(model: Any, seed: int, component: str) -> None:
    """Overwrite every parameter and persistent float buffer with small, sensible random values.

    Matrices: normal / sqrt(fan_in); embeddings: normal * 0.5; norm gains: 1 + 0.1 * normal; biases:
    0.05 * normal; the DiT's scale_shift_table and the MoE score-correction bias: 0.1 * normal (non-zero on
    purpose, so code that drops them produces different outputs).
    """
    import torch
    import torch.nn as nn

    seen: set[int] = set()
    with torch.no_grad():
        for module_name, module in model.named_modules():
            prefix = f"{module_name}." if module_name else ""
            for name, param in module.named_parameters(recurse=False):
                if id(param) in seen:  # tied weights (lm_head <- embed_tokens)
                    continue
                seen.add(id(param))
                full = prefix + name
                param.copy_(_draw(full, param, module, _generator(seed, component, full), nn))
            for name, buf in module.named_buffers(recurse=False):
                if name in module._non_persistent_buffers_set or not buf.is_floating_point():
                    continue
                full = prefix + name
                if name != "e_score_correction_bias":
                    raise RuntimeError(f"tiny checkpoint: no init rule for persistent buffer {full}")
                g = _generator(seed, component, full)
                buf.copy_(0.1 * torch.randn(buf.shape, generator=g, dtype=torch.float32))


def _draw(name: str, param: Any, module: Any, g: Any, nn: Any) -> Any:
    import torch

    shape = tuple(param.shape)
    noise = torch.randn(shape, generator=g, dtype=torch.float32)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "scale_shift_table":
        return 0.1 * noise
    if leaf == "bias":
        return 0.05 * noise
    if leaf == "gamma" or (leaf == "weight" and len(shape) == 1):  # RMSNorm / LayerNorm gains
        return 1.0 + 0.1 * noise
    if isinstance(module, nn.Embedding):
        return 0.5 * noise
    if len(shape) < 2:
        raise RuntimeError(f"tiny checkpoint: no init rule for parameter {name} {shape}")
    if isinstance(module, nn.modules.conv._ConvNd):
        fan_in = math.prod(shape[1:])
    else:  # Linear [out, in], stacked experts [E, out, in]
        fan_in = shape[-1]
    return noise / math.sqrt(fan_in)
