"""The checkpoint's own text encoder as the rewriter: Qwen3-VL writes the caption, no extra download.

The text encoder is a complete ``Qwen3VLForConditionalGeneration`` whose LM head is tied to the
token embeddings (the loaders re-tie it when a file leaves ``lm_head.weight`` out), so it can
generate. It is entered through the stage door like an encode, so every offload mode, interrupt
and release applies. Decoding is transformers' ``generate`` (KV cache on); what is ours is a
stopping criterion that checks for a cancel, reports progress and stops as soon as the first JSON
object closes, and a head that follows the hidden states' device (under ``group`` offload the tied
weight is parked with the language model's first group once that group's forward is over).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from ..interrupt import check_interrupt
from ..placement.door import note_generation, stage
from ..prompt import IMAGE_PROMPT_PREFIX
from .core import GREEDY, Sampling, TokenCallback
from .scan import ObjectScanner

DEFAULT_MAX_NEW_TOKENS = {"expand": 1024, "map": 2048, "repair": 2048, "negative": 512}
PROMPT_ALLOWANCE = 2048
"""Tokens the instructions, the request and (TI2V) the first frame take in a call's prompt, at most
(Qwen's tokenizer; the memory estimate plans for it)."""
IMAGE_MAX_SIDE = 640
"""The first frame is shown to the rewriter at most this many pixels on its longer side."""


class CannotWrite(ValueError):
    """The handle's text encoder is known to write nothing usable (the built-in random-weight tiny model)."""


def check_writes_text(handle: Any) -> None:
    """Refuse, before the first token, the built-in tiny checkpoint: its text encoder has random weights, so a
    rewrite would run to every stage's token limit (minutes on a CPU) and then fail on what it wrote."""
    from ..tiny import is_tiny_checkpoint

    folder = handle.folder
    if folder is not None and is_tiny_checkpoint(folder):
        raise CannotWrite(
            "the built-in tiny checkpoint has random weights: its text encoder cannot write a caption. Pick a real "
            "LingBot-Video checkpoint in the Loader, or give LingBot Rewrite an endpoint; on the tiny model, type "
            "the caption into LingBot Text Encode instead.")


Stop = Literal["object", "eos", "limit"]
"""Why a generation ended: the JSON object closed, the model's end token, or `max_new_tokens`."""


@dataclass
class Generation:
    text: str
    tokens: int
    stopped: Stop


def chat_text(system: str, user: str, with_image: bool) -> str:
    """One exchange in Qwen's chat layout (what Qwen3-VL's chat template writes for a system and a user
    message, the image placeholder first), the assistant turn open. Qwen3-VL Instruct has no thinking
    block, so opening the turn directly is "thinking off"."""
    content = (IMAGE_PROMPT_PREFIX if with_image else "") + user
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{content}<|im_end|>\n"
            "<|im_start|>assistant\n")


class _Watch:
    """transformers stopping criterion: cancel, progress, and the end of the first JSON object."""

    def __init__(self, tokenizer: Any, prompt_length: int, limit: int, stop_at_object: bool, stage_name: str,
                 on_token: TokenCallback | None):
        self.tokenizer, self.prompt_length, self.limit = tokenizer, prompt_length, limit
        self.scanner = ObjectScanner() if stop_at_object else None
        self.stage_name, self.on_token = stage_name, on_token
        self.tokens = 0

    def __call__(self, input_ids: torch.Tensor, scores: Any, **_: Any) -> torch.Tensor:
        check_interrupt()
        self.tokens = int(input_ids.shape[-1]) - self.prompt_length
        done = False
        if self.scanner is not None and self.tokens > 0:
            piece = self.tokenizer.decode(input_ids[0, -1:], skip_special_tokens=True)
            done = self.scanner.feed(piece)
        if self.on_token is not None:
            self.on_token(self.stage_name, self.tokens, self.limit)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class _FollowingHead(torch.nn.Module):
    """Calls the tied LM head, bringing its weight to the hidden states' device when an offload mode
    left it elsewhere (one copy per generation, dropped when it ends)."""

    def __init__(self, head: torch.nn.Module):
        super().__init__()
        self.head = head
        self._copy: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.head.weight
        if weight.device.type == "meta" or weight.device == hidden.device:
            return self.head(hidden)  # in place, or an accelerate hook brings it
        if self._copy is None or self._copy.device != hidden.device:
            self._copy = weight.detach().to(hidden.device, hidden.dtype)
        bias = getattr(self.head, "bias", None)
        return torch.nn.functional.linear(hidden, self._copy, None if bias is None else bias.to(hidden.device))


@contextmanager
def _following_head(encoder: torch.nn.Module) -> Iterator[None]:
    original = encoder.lm_head
    encoder.lm_head = _FollowingHead(original)
    try:
        yield
    finally:
        encoder.lm_head = original


def _picture(image: Any, encoder: Any, processor: Any):
    from ..image import load_image, smart_resize, vision_patch_size

    picture = load_image(image)
    scale = min(1.0, IMAGE_MAX_SIDE / max(picture.size))
    factor = vision_patch_size(encoder, processor) * 2
    height, width = smart_resize(max(factor, round(picture.height * scale)), max(factor, round(picture.width * scale)),
                                 factor=factor)
    return picture.resize((width, height))


def _seed_here(seed: int, device: torch.device) -> None:
    """Seed the CPU's generator and `device`'s own, nothing else (`torch.manual_seed` reseeds every GPU of
    the process); the caller's `fork_rng` gives both their state back afterwards."""
    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


def generate_text(handle: Any, system: str, user: str, *, image: Any | None = None, max_new_tokens: int = 1024,
                  sampling: Sampling = GREEDY, stop_at_object: bool = False, stage_name: str = "expand",
                  on_token: TokenCallback | None = None) -> Generation:
    """One chat reply from the handle's text encoder, entered through the stage door. On a view of several
    processes rank 0 writes it and the others receive the text (`distributed.stage.from_rank0`), so only
    rank 0 loads the text encoder, as for the prompt's encoding."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    from ..distributed import stage as parallel_stage

    def pack(g: Generation) -> dict[str, torch.Tensor | None]:
        return {"text": parallel_stage.text_tensor(g.text),
                "counts": torch.tensor([g.tokens, _STOPS.index(g.stopped)], dtype=torch.int64)}

    def unpack(got: dict[str, torch.Tensor | None]) -> Generation:
        tokens, stopped = (int(v) for v in got["counts"].tolist())
        return Generation(parallel_stage.tensor_text(got["text"]), tokens, _STOPS[stopped])

    return parallel_stage.from_rank0(
        handle, lambda: _generate(handle, system, user, image=image, max_new_tokens=max_new_tokens, sampling=sampling,
                                  stop_at_object=stop_at_object, stage_name=stage_name, on_token=on_token),
        pack, unpack, ("text", "counts"))


_STOPS: tuple[Stop, ...] = get_args(Stop)  # sent between processes by position


def _generate(handle: Any, system: str, user: str, *, image: Any | None, max_new_tokens: int, sampling: Sampling,
              stop_at_object: bool, stage_name: str, on_token: TokenCallback | None) -> Generation:
    if image is not None:
        from ..checkpoints.text_encoder_file import require_vision

    with stage(handle, "text_encoder", "processor", label="rewrite") as device:
        encoder, processor = handle.component("text_encoder"), handle.component("processor")
        if not hasattr(encoder, "lm_head") or not hasattr(encoder, "generate"):
            raise ValueError("this text encoder cannot write text (it has no LM head); use an endpoint")
        picture = None
        if image is not None:
            require_vision(handle.shared.states.get("text_encoder"))
            picture = _picture(image, encoder, processor)
        text = chat_text(system, user, picture is not None)
        inputs = processor(text=[text], images=[picture] if picture is not None else None, videos=None,
                           return_tensors="pt").to(device)
        tokenizer = processor.tokenizer
        end_ids = [i for i in (tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id)
                   if isinstance(i, int) and i >= 0]
        prompt_length = int(inputs["input_ids"].shape[-1])
        watch = _Watch(tokenizer, prompt_length, max_new_tokens, stop_at_object, stage_name, on_token)
        options: dict[str, Any] = dict(max_new_tokens=max_new_tokens, use_cache=True, do_sample=not sampling.greedy,
                                       eos_token_id=end_ids or None,
                                       pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                       else (end_ids[0] if end_ids else None))
        if sampling.greedy:
            options.update(temperature=None, top_p=None, top_k=None)
        else:
            options.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=None)
        from transformers import StoppingCriteriaList

        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), _following_head(encoder), torch.no_grad():
            _seed_here(sampling.seed, device)
            output = encoder.generate(**inputs, stopping_criteria=StoppingCriteriaList([watch]), **options)
        new = output[0, prompt_length:].to("cpu")
        note_generation(handle, encoder, prompt_length, int(new.shape[0]))  # the memory report counts it
    check_interrupt()
    tokens = int(new.shape[0])
    if watch.scanner is not None and watch.scanner.closed:
        stopped = "object"
    elif tokens and int(new[-1]) in end_ids:
        stopped = "eos"
    else:
        stopped = "limit"
    return Generation(tokenizer.decode(new, skip_special_tokens=True), tokens, stopped)


def stage_limits(max_new_tokens: Mapping[str, int] | int | None = None) -> dict[str, int]:
    """Per-stage new-token limits: :data:`DEFAULT_MAX_NEW_TOKENS` with ``max_new_tokens`` over it."""
    if isinstance(max_new_tokens, int):
        max_new_tokens = dict.fromkeys(DEFAULT_MAX_NEW_TOKENS, max_new_tokens)
    return {**DEFAULT_MAX_NEW_TOKENS, **(max_new_tokens or {})}


def context_tokens(max_new_tokens: Mapping[str, int] | int | None = None) -> int:
    """The longest context one rewrite call holds in the KV cache, for the memory estimate
    (`Geometry.rewrite_tokens`): the repair call, whose prompt carries the expansion and the first
    caption, plus its own new tokens."""
    limits = stage_limits(max_new_tokens)
    json_stage = max(limits["map"], limits["repair"])
    return PROMPT_ALLOWANCE + max(limits["expand"] + json_stage + limits["repair"], limits["negative"])


class LocalBackend:
    """The handle's own text encoder; ``max_new_tokens`` per stage (see :data:`DEFAULT_MAX_NEW_TOKENS`)."""

    name = "local"

    def __init__(self, handle: Any, max_new_tokens: dict[str, int] | int | None = None):
        self.handle = handle
        self.max_new_tokens = stage_limits(max_new_tokens)
        self.last: Generation | None = None

    def identity(self) -> tuple:
        folder = self.handle.folder
        where = str(folder) if folder is not None else f"in-memory:{id(self.handle.shared)}"
        states = tuple(repr(s) for s in self.handle.view_states)
        return (where, states, tuple(sorted(self.max_new_tokens.items())))

    def complete(self, stage: str, system: str, user: str, *, image: Any | None, sampling: Sampling,
                 stop_at_object: bool, on_token: TokenCallback | None) -> str:
        check_writes_text(self.handle)
        self.last = generate_text(self.handle, system, user, image=image, max_new_tokens=self.max_new_tokens[stage],
                                  sampling=sampling, stop_at_object=stop_at_object, stage_name=stage,
                                  on_token=on_token)
        return self.last.text
