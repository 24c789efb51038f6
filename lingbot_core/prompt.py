"""Text conditioning for LingBot-Video: caption strings, the chat template and the Qwen3-VL encoder.

Which strings get compacted (matching the reference CLI):

* The *positive* prompt goes through :func:`caption_to_text`. Structured captions (a dict, a list, or a
  string that starts with ``{`` / ``[``) are re-serialised as compact JSON, exactly as the reference CLI
  serialises a ``--prompt_json`` file. The fixture prompts are already in that form, and compacting an
  already-compact string gives the same string back, so this is a no-op for them.
* *Negative* prompts are encoded verbatim. The reference passes ``--negative_prompt`` and both default
  negatives (which use ``", "`` / ``": "`` separators) straight to the pipeline; compacting them would change
  the token ids. Callers must therefore never run negatives through :func:`caption_to_text`.
* :func:`encode_text` itself never rewrites its input.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .errors import surrogate_problem

if TYPE_CHECKING:
    from PIL import Image
    from transformers import BatchFeature

__all__ = [
    "DEFAULT_NEGATIVE_PROMPT",
    "DEFAULT_NEGATIVE_PROMPT_IMAGE",
    "IMAGE_PROMPT_PREFIX",
    "MAX_TEXT_TOKENS",
    "PROMPT_TEMPLATE",
    "RUNTIME_KEYS",
    "PromptEmbeds",
    "build_text_inputs",
    "caption_to_text",
    "crop_start",
    "encode_text",
]

# --- data: these strings must stay byte-identical to the reference (the fixtures check them) -------------

PROMPT_TEMPLATE: str = (
    "<|im_start|>system\n"
    "Given a user input that may include a text prompt alone, a text prompt with an image reference, "
    'or a text prompt with a video reference or a video reference alone, generate an "Enhanced prompt" '
    "that provides detailed visual descriptions suitable for video generation. Evaluate the level of detail "
    "in the user's input: if it is simple, enrich it by adding specifics about colors, shapes, sizes, "
    "textures, lighting, motion dynamics, camera movement, temporal progression, and spatial relationships "
    "to create vivid, concrete, and temporally coherent scenes to create vivid and concrete scenes. "
    "Please generate only the enhanced description for the prompt below and avoid including any additional "
    "commentary or evaluations:<|im_end|>\n"
    "<|im_start|>user\n"
    "{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
"""Chat template; ``{}`` is the caption slot (the only brace pair in the string)."""

IMAGE_PROMPT_PREFIX: str = "<|vision_start|><|image_pad|><|vision_end|>"
"""Prepended to the caption (inside the template) when an image conditions the prompt (TI2V)."""

DEFAULT_NEGATIVE_PROMPT: str = (
    '{"universal_negative": {'
    '"visual_quality": ["low quality", "worst quality", "blurry", "pixelated", "jpeg artifacts", '
    '"low resolution", "unstable color", "color flicker", "underexposed", "overexposed", '
    '"invisible subject", "subject hidden in darkness"], '
    '"artistic_style": ["painting", "illustration", "drawing", "cartoon", "3d render", "cgi", "sketch", '
    '"digital art"], '
    '"composition_and_content": ["text", "watermark", "signature", "logo", "subtitles", "pillarboxed", '
    '"side bars", "portrait image in landscape frame"], '
    '"temporal_and_motion_stability": ["flickering", "jittery", "motion blur", "temporal inconsistency", '
    '"warping", "morphing", "incoherent motion", "unnatural movement", "static object with sudden jump", '
    '"frame-to-frame inconsistency"], '
    '"material_and_structure": ["plastic-like glass", "unrealistic texture", "deformed bottle", '
    '"liquid freezing improperly", "distorted reflections"]}}'
)
"""Video default negative (the pipeline default for t2v, ti2v and i2v)."""

DEFAULT_NEGATIVE_PROMPT_IMAGE: str = (
    '{"universal_negative": {'
    '"visual_quality": ["low quality", "worst quality", "blurry", "pixelated", "jpeg artifacts", '
    '"low resolution", "underexposed", "overexposed", "invisible subject", "subject hidden in darkness"], '
    '"artistic_style": ["painting", "illustration", "drawing", "cartoon", "3d render", "cgi", "sketch", '
    '"digital art"], '
    '"composition_and_content": ["text", "watermark", "signature", "logo", "pillarboxed", "side bars", '
    '"portrait image in landscape frame"], '
    '"material_and_structure": ["plastic-like glass", "unrealistic texture", "deformed bottle", '
    '"distorted reflections"]}}'
)
"""Still-image default negative: what the reference CLI substitutes for t2i (no temporal block)."""

MAX_TEXT_TOKENS: int = 37698
"""Processor truncation length used by the reference."""

RUNTIME_KEYS: frozenset[str] = frozenset(
    {"duration", "fps", "height", "width", "num_frames", "resolution", "ratio"}
)
"""Top-level keys of a prompt.json sample that are run settings, not caption text."""

_TEMPLATE_HEAD, _TEMPLATE_TAIL = PROMPT_TEMPLATE.split("{}")
log = logging.getLogger(__name__)


# --- caption -> string ------------------------------------------------------------------------------------


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _parse_json_prompt(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        where = repr(exc.doc[exc.pos]) if exc.pos < len(exc.doc) else "end of text"
        raise ValueError(
            f"prompt is not valid JSON at line {exc.lineno} column {exc.colno} "
            f"(char {exc.pos}, {where}): {exc.msg}"
        ) from None


def caption_to_text(prompt: str | dict | list) -> str:
    """Turn a user caption into the exact string the reference CLI would feed the encoder.

    A dict is a prompt.json sample: its ``caption`` value is used when present, otherwise the sample minus the
    runtime keys (:data:`RUNTIME_KEYS`). A list uses its first element. Dicts/lists are serialised compactly
    (``ensure_ascii=False``, no spaces); a non-container ``caption`` value is used as ``str(value)``. A string
    whose first non-blank character is ``{`` or ``[`` is parsed and treated the same way (so pasting a
    prompt.json works and pretty-printed JSON gets compacted); any other string is prose and passes through
    unchanged. Only positive prompts should go through here; negatives are encoded verbatim.
    """
    if isinstance(prompt, str):
        problem = surrogate_problem(prompt, "the prompt")
        if problem:
            raise ValueError(problem)
        if not prompt.lstrip().startswith(("{", "[")):
            return prompt
        prompt = _parse_json_prompt(prompt)

    if isinstance(prompt, list):
        if not prompt:
            raise ValueError("structured prompt is an empty list; expected a caption object")
        prompt = prompt[0]
    if not isinstance(prompt, dict):
        raise ValueError(
            f"structured prompt must be a JSON object or a list of objects, got {type(prompt).__name__}"
        )

    if "caption" in prompt:
        caption = prompt["caption"]
    else:
        caption = {key: value for key, value in prompt.items() if key not in RUNTIME_KEYS}
    if isinstance(caption, (dict, list)):
        caption = _compact(caption)
    problem = surrogate_problem(caption, "the prompt's caption")  # JSON escapes ("\\ud83d") make them too
    if problem:
        raise ValueError(problem)
    if not isinstance(caption, str):
        # str(None) would encode the word "None"; a number or bool is no caption either.
        raise ValueError(f"the prompt's 'caption' must be text or a JSON object, got {'null' if caption is None else type(caption).__name__}")
    return caption


# --- encoding ---------------------------------------------------------------------------------------------


@dataclass
class PromptEmbeds:
    """One encoded prompt (batch 1), ready for the DiT and cheap to cache."""

    embeds: torch.Tensor  # (1, L, text_dim) in the encoder's dtype
    mask: torch.Tensor  # (1, L) int64, all ones after trimming
    input_ids: torch.Tensor  # (1, N) processor ids before cropping (tests/debug)

    @property
    def length(self) -> int:
        return int(self.embeds.shape[1])

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> PromptEmbeds:
        """Copy to another device; ``dtype`` applies to ``embeds`` only."""
        return PromptEmbeds(
            embeds=self.embeds.to(device=device, dtype=dtype),
            mask=self.mask.to(device=device),
            input_ids=self.input_ids.to(device=device),
        )


_crop_cache: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_crop_lock = threading.Lock()


def crop_start(processor: Any) -> int:
    """Number of tokens of the template text before the caption slot, tokenised on its own.

    The encoder output for these tokens is dropped. Cached per processor object (weakly, so a released
    processor does not stay alive through the cache).
    """
    with _crop_lock:
        cached = _crop_cache.get(processor)
    if cached is not None:
        return cached
    ids = processor(text=_TEMPLATE_HEAD, images=None, videos=None, return_tensors="pt")["input_ids"]
    value = int(ids.shape[1])
    with _crop_lock:
        _crop_cache[processor] = value
    return value


def _check_image_size(processor: Any, image: Image.Image) -> None:
    # With do_resize=False the processor cannot fix the size itself; a size that is not a multiple of
    # patch*merge fails deep inside the processor with an unhelpful reshape error.
    image_processor = getattr(processor, "image_processor", None)
    patch = getattr(image_processor, "patch_size", None)
    merge = getattr(image_processor, "merge_size", None)
    if not patch or not merge:
        return
    factor = int(patch) * int(merge)
    width, height = image.size
    if width % factor or height % factor:
        raise ValueError(
            f"conditioning image is {width}x{height}, which is not a multiple of {factor}; "
            "pass it through lingbot_core.image.vision_image() first"
        )


def build_text_inputs(processor: Any, text: str, image: Image.Image | None = None) -> BatchFeature:
    """Template ``text`` (plus the image placeholder when an image is given) and run the processor.

    Mirrors the reference call: no resizing by the processor (the image must already be the vision-tower
    picture from :func:`lingbot_core.image.vision_image`), longest padding, truncation at
    :data:`MAX_TEXT_TOKENS`.
    """
    caption = IMAGE_PROMPT_PREFIX + text if image is not None else text
    templated = _TEMPLATE_HEAD + caption + _TEMPLATE_TAIL
    if image is not None:
        _check_image_size(processor, image)
    inputs = processor(
        text=[templated],
        images=[image] if image is not None else None,
        videos=None,
        do_resize=False,
        truncation=True,
        max_length=MAX_TEXT_TOKENS,
        padding="longest",
        return_tensors="pt",
    )
    if inputs["input_ids"].shape[-1] >= MAX_TEXT_TOKENS:
        # The reference truncates silently at this length; we do the same (parity) but say so.
        log.warning("the prompt is %d characters and was cut at %d tokens (the reference's limit); the rest of "
                    "the caption is ignored", len(text), MAX_TEXT_TOKENS)
    return inputs


def encode_text(
    text_encoder: Any,
    processor: Any,
    text: str,
    *,
    image: Image.Image | None = None,
    device: torch.device,
    state: Any = None,
) -> PromptEmbeds:
    """Encode one prompt into DiT conditioning: final-normed hidden states of the caption tokens.

    ``text`` is encoded verbatim (apply :func:`caption_to_text` to positives beforehand). Uses the inner
    ``Qwen3VLModel`` (``text_encoder.model``) so no ``lm_head`` is involved and the encoder is left untouched.
    ``state``: the encoder's ``weights.state.ModelState`` (an image is refused when it says the encoder
    was loaded without a vision tower).
    """
    if image is not None:
        from .checkpoints.text_encoder_file import require_vision

        require_vision(state)
    inputs = build_text_inputs(processor, text, image)
    input_ids = inputs["input_ids"]
    if input_ids.shape[0] != 1:
        raise ValueError(f"expected a single prompt, processor returned batch {input_ids.shape[0]}")
    start = crop_start(processor)
    inputs = inputs.to(device)
    with torch.no_grad():
        hidden = text_encoder.model(**inputs).last_hidden_state
    mask = inputs["attention_mask"]
    hidden = hidden[:, start:]
    mask = mask[:, start:]
    # Batch 1: drop right padding so the DiT sees exactly the valid tokens.
    valid = int(mask[0].sum().item())
    return PromptEmbeds(
        embeds=hidden[:, :valid],
        mask=mask[:, :valid].to(torch.int64),
        input_ids=input_ids,
    )
