"""The Qwen3-VL processor (tokenizer + image processor) from wherever the user has it.

Three places, tried in this order by `load_processor`:
1. a processor folder (a checkpoint's `processor/`, a copy of it, or the checkpoint folder itself):
   `Qwen3VLProcessor.from_pretrained`, exactly as the folder route loads it;
2. a Qwen tokenizer folder alone (ComfyUI's `comfy/text_encoders/qwen25_tokenizer`: `vocab.json`,
   `merges.txt`, `tokenizer_config.json`; or a `tokenizer/` folder with `tokenizer.json`): its
   tokenizer, plus the Qwen3-VL image/video processor settings and added tokens shipped as package
   data (`configs/qwen3-vl.processor.json`). Qwen2.5 and Qwen3-VL share the BPE vocabulary; the
   added tokens (ids 151643...) are checked, or appended in id order when the folder lacks them.
   This route has not been compared with the real Qwen3-VL processor (none is reachable where it
   was written): it logs that once per process, with the way to use the checkpoint's processor.

`check_token_ids` holds a processor to the text encoder's config (image/video/vision token ids);
`check_folder` does so for a processor given apart from its checkpoint when the handle opens (the
tokenizer alone is built), so a tokenizer from another model family is refused before any weights load.
Nothing here runs code from a folder: `trust_remote_code` is off and only JSON/text files are read.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

log = logging.getLogger("lingbot_core.checkpoints.processor_files")

CONFIG_FILE = Path(__file__).resolve().parent.parent / "configs" / "qwen3-vl.processor.json"
PROCESSOR_MARKERS = ("processor_config.json", "preprocessor_config.json")
UNVERIFIED = ("the Qwen3-VL processor was built from the tokenizer folder {folder} plus lingbot-nodes' Qwen3-VL "
              "settings; this route has not been compared with the real Qwen3-VL processor. For certainty, "
              "download the checkpoint's processor folder (a few MB): hf download robbyant/lingbot-video-dense-1.3b "
              "--include \"processor/*\" --local-dir <folder>, and choose that folder as the processor")
# text encoder config key -> the token it names
TOKEN_KEYS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
              "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
_warned: set[str] = set()
_warn_lock = threading.Lock()


def shipped_settings() -> dict[str, Any]:
    return json.loads(CONFIG_FILE.read_text(encoding="utf-8"))


def processor_kind(folder: Path) -> str:
    """"processor" (a full processor folder), "tokenizer" (a tokenizer folder alone) or ""."""
    if any((folder / m).is_file() for m in PROCESSOR_MARKERS):
        return "processor"
    if (folder / "tokenizer.json").is_file() or ((folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()):
        return "tokenizer"
    return ""


def resolve_processor_folder(path: str | Path) -> tuple[Path, str]:
    """The folder to read and its kind; a checkpoint folder means its `processor/` (or `tokenizer/`)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"processor folder {folder} does not exist (give a checkpoint's processor/ folder, or "
                              "a Qwen tokenizer folder with vocab.json and merges.txt)")
    for candidate in (folder, folder / "processor", folder / "tokenizer"):
        kind = processor_kind(candidate) if candidate.is_dir() else ""
        if kind:
            return candidate, kind
    raise CheckpointError(f"{folder} holds no processor: expected processor_config.json or preprocessor_config.json "
                          "(a checkpoint's processor/ folder), or vocab.json + merges.txt / tokenizer.json (a Qwen "
                          "tokenizer folder)")


def _from_processor_folder(folder: Path) -> Any:
    from transformers import Qwen3VLProcessor

    try:
        return Qwen3VLProcessor.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as err:  # transformers' and tokenizers' own errors (tokenizers raises bare Exception)
        raise CheckpointError(f"processor: {folder} cannot be loaded ({type(err).__name__}: {str(err)[:300]}). The "
                              "tokenizer/processor files are corrupt; re-download them.") from err


def _ensure_added_tokens(tokenizer: Any, settings: dict[str, Any], folder: Path) -> None:
    """The Qwen3-VL tokens the template and processor use, present; a folder with none of the added
    tokens gets them all in id order (only when its vocabulary ends where they start, so the ids come
    out right)."""
    from tokenizers import AddedToken

    wanted = settings["added_tokens"]
    vocab = tokenizer.get_vocab()
    missing = [t for t in wanted if t["required"] and t["content"] not in vocab]
    if not missing:
        return
    if any(t["content"] in vocab for t in wanted) or len(tokenizer) != settings["first_added_id"]:
        raise CheckpointError(f"processor: the tokenizer in {folder} lacks {missing[0]['content']} (and "
                              f"{len(missing) - 1} more of the Qwen3-VL tokens it needs); it is not a Qwen tokenizer. Use the "
                              "checkpoint's processor/ folder.")
    for token in wanted:
        tokenizer.add_tokens([AddedToken(token["content"], special=token["special"], normalized=False)],
                             special_tokens=token["special"])


def _qwen_tokenizer(folder: Path, settings: dict[str, Any]) -> Any:
    """The tokenizer of a Qwen tokenizer folder, with the Qwen3-VL added tokens present."""
    from transformers import Qwen2Tokenizer

    try:
        tokenizer = Qwen2Tokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as err:  # as above
        raise CheckpointError(f"processor: the tokenizer in {folder} cannot be loaded ({type(err).__name__}: "
                              f"{str(err)[:300]}).") from err
    _ensure_added_tokens(tokenizer, settings, folder)
    return tokenizer


def _from_tokenizer_folder(folder: Path) -> Any:
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    settings = shipped_settings()
    tokenizer = _qwen_tokenizer(folder, settings)
    image = {k: v for k, v in settings["image_processor"].items() if k != "image_processor_type"}
    video = {k: v for k, v in settings["video_processor"].items() if k != "video_processor_type"}
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**image), tokenizer=tokenizer,
                                 video_processor=Qwen3VLVideoProcessor(**video))
    key = str(folder)
    with _warn_lock:
        first = key not in _warned
        _warned.add(key)
    if first:
        log.warning(UNVERIFIED.format(folder=folder))
    return processor


def load_processor(path: str | Path) -> Any:
    """A Qwen3VLProcessor from a processor folder, a checkpoint folder, or a Qwen tokenizer folder."""
    folder, kind = resolve_processor_folder(path)
    return _from_processor_folder(folder) if kind == "processor" else _from_tokenizer_folder(folder)


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer `load_processor` would build from `path` (added Qwen3-VL tokens included), without
    the image and video processors: what the open-time id check reads (tens of milliseconds on the tiny
    model, under a second on Qwen's 151k vocabulary)."""
    folder, kind = resolve_processor_folder(path)
    if kind == "tokenizer":
        return _qwen_tokenizer(folder, shipped_settings())
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as err:  # as in _from_processor_folder
        raise CheckpointError(f"processor: the tokenizer in {folder} cannot be loaded ({type(err).__name__}: "
                              f"{str(err)[:300]}). The tokenizer/processor files are corrupt; re-download "
                              "them.") from err


def check_folder(path: str | Path, text_encoder_config: dict[str, Any]) -> None:
    """A processor given apart from its checkpoint, held to the text encoder when the handle opens
    (before any weights load): its tokenizer must carry the Qwen3-VL tokens with the text encoder's ids."""
    folder, _kind = resolve_processor_folder(path)
    check_token_ids(load_tokenizer(folder), text_encoder_config, str(folder))


def check_token_ids(processor: Any, text_encoder_config: dict[str, Any], where: str) -> None:
    """The processor's (or tokenizer's) vision/video token ids must be the ones the text encoder was
    trained with."""
    tokenizer = getattr(processor, "tokenizer", processor)
    for key, token in TOKEN_KEYS.items():
        want = text_encoder_config.get(key)
        if want is None:
            continue
        got = tokenizer.convert_tokens_to_ids(token)
        if got is None or got == getattr(tokenizer, "unk_token_id", None):
            raise CheckpointError(f"processor: {where} has no {token} token, which the text encoder expects as id "
                                  f"{want}; the tokenizer belongs to another model. Use the checkpoint's processor/ "
                                  "folder.")
        if got != want:
            raise CheckpointError(f"processor: {where} gives {token} the id {got}, but the text encoder expects "
                                  f"{want}; the tokenizer belongs to another model. Use the checkpoint's processor/ "
                                  "folder.")
