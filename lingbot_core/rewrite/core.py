"""Prose in, a schema-valid caption out: expand, map, validate, one repair pass, or a clear error."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..caption_schema import caption_problems
from ..errors import surrogate_problem
from ..interrupt import check_interrupt
from . import instructions
from .scan import extract_object

log = logging.getLogger("lingbot_core.rewrite")

STAGES = ("expand", "map", "repair")
"""The rewriter's calls, in order; ``repair`` runs only when the mapped caption has problems."""

JSON_STAGES = frozenset({"map", "repair"})
"""Stages whose reply is one JSON object: generation stops as soon as it closes."""

TokenCallback = Callable[[str, int, int], None]
"""``(stage, tokens so far, token limit)``, called as a backend produces text (progress, cancel)."""


class RewriteError(ValueError):
    """The model did not produce a valid caption, even after the repair pass; the message shows what
    it produced and what is wrong with it."""

    def __init__(self, message: str, produced: str = "", problems: list[str] | None = None):
        super().__init__(message)
        self.produced = produced
        self.problems = list(problems or [])


@dataclass(frozen=True)
class Sampling:
    """Greedy by default (temperature 0): the same input gives the same caption. ``temperature`` > 0
    samples, seeded by ``seed`` (a backend that cannot seed says so in its docs)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


GREEDY = Sampling()


class Backend(Protocol):
    """A text generator the rewriter drives (`LocalBackend`, `OpenAIBackend`)."""

    name: str

    def identity(self) -> tuple:
        """What makes its output differ (endpoint, model names, checkpoint): part of the cache key."""

    def complete(self, stage: str, system: str, user: str, *, image: Any | None, sampling: Sampling,
                 stop_at_object: bool, on_token: TokenCallback | None) -> str:
        """The model's reply to one (system, user) exchange, thinking off."""


@dataclass(frozen=True)
class RewriteRequest:
    prompt: str
    task: str = "t2v"
    duration: float = 5.0
    image: Any | None = None  # TI2V: the first frame (anything lingbot_core.image.load_image reads)

    def checked(self) -> RewriteRequest:
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ValueError("the rewriter needs a prompt: describe the clip in a sentence or two")
        surrogate = surrogate_problem(self.prompt, "the rewriter's prompt")
        if surrogate:  # a local tokenizer fails late on it with a raw TypeError
            raise ValueError(surrogate)
        if self.task not in instructions.TASKS:
            raise ValueError(f"task must be one of {', '.join(instructions.TASKS)}, got {self.task!r}")
        if self.task == "ti2v" and self.image is None:
            raise ValueError("task ti2v needs the first frame: connect an image")
        duration = float(self.duration)
        if self.task != "t2i" and not 0 < duration <= 60:
            raise ValueError(f"duration must be between 0 and 60 seconds for video, got {duration:g}")
        return self


@dataclass
class RewriteResult:
    caption: str  # compact JSON: {"caption": {...}, "duration": ...}, for Text Encode
    expanded: str  # the stage-1 paragraph
    document: dict = field(repr=False)
    repaired: bool = False
    cached: bool = False


def duration_for(frames: int, fps: float) -> float:
    """Seconds of a clip of ``frames`` frames at ``fps`` (one decimal), as captions count them."""
    if frames < 1 or fps <= 0:
        raise ValueError(f"frames must be >= 1 and fps > 0, got {frames} frames at {fps} fps")
    return round((frames - 1) / fps, 1) if frames > 1 else 0.0


def _image_digest(image: Any) -> str:
    if image is None:
        return ""
    from ..image import load_image

    picture = load_image(image)
    digest = hashlib.sha256(f"{picture.size}{picture.mode}".encode())
    digest.update(picture.tobytes())
    return digest.hexdigest()


class ResultCache:
    """The newest results, keyed by prompt, image pixels, duration, task, backend, model and sampling
    (all greedy settings are one: a seed changes nothing at temperature 0)."""

    def __init__(self, size: int = 32):
        self.size = size
        self._items: OrderedDict[str, RewriteResult] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0

    @staticmethod
    def key(request: RewriteRequest, backend: Backend, sampling: Sampling) -> str:
        parts = [instructions.VERSION, request.prompt, request.task, f"{float(request.duration):g}",
                 _image_digest(request.image), backend.name, repr(backend.identity()),
                 "greedy" if sampling.greedy else repr(sampling)]  # greedy: the seed (and top_p) change nothing
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def get(self, key: str) -> RewriteResult | None:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
                self.hits += 1
            return found

    def put(self, key: str, result: RewriteResult) -> None:
        with self._lock:
            self._items[key] = result
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.hits = 0


CACHE = ResultCache()


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _judge(reply: str, duration: float | None) -> tuple[dict | None, list[str]]:
    value, reason = extract_object(reply)
    if reason is not None:
        return None, [reason]
    problems = caption_problems(value, duration)
    if isinstance(value, dict) and "caption" not in value:
        value = {"caption": value, "duration": duration}  # a bare caption object: wrap it
    return value, problems


def rewrite(request: RewriteRequest, backend: Backend, *, sampling: Sampling = GREEDY,
            cache: ResultCache | None = CACHE, on_token: TokenCallback | None = None) -> RewriteResult:
    """Rewrite prose into a caption that passes :func:`lingbot_core.caption_schema.caption_problems`.

    Stage 1 expands the request (for TI2V the model sees the first frame); stage 2 maps the paragraph
    onto the schema. A caption with problems gets one repair pass (the model is shown the list); if
    that fails too, :class:`RewriteError` shows what was produced. Results are cached (``cache=None``:
    no cache).
    """
    request = request.checked()
    duration = 0.0 if request.task == "t2i" else float(request.duration)
    key = ResultCache.key(request, backend, sampling) if cache is not None else None
    if key is not None:
        found = cache.get(key)
        if found is not None:
            log.info("rewrite: cached caption for this prompt")
            return RewriteResult(found.caption, found.expanded, found.document, found.repaired, cached=True)
    image = request.image
    check_interrupt()
    system, user = instructions.expand_messages(request.prompt.strip(), request.task, duration)
    expanded = backend.complete("expand", system, user, image=image, sampling=sampling, stop_at_object=False,
                                on_token=on_token).strip()
    if not expanded:
        raise RewriteError(f"the {backend.name} rewriter returned an empty expansion for this prompt")
    check_interrupt()
    system, user = instructions.map_messages(expanded, request.task, duration)
    produced = backend.complete("map", system, user, image=image, sampling=sampling, stop_at_object=True,
                                on_token=on_token)
    document, problems = _judge(produced, duration or None)
    repaired = False
    if problems:
        log.info("rewrite: the caption has %d problem(s); one repair pass", len(problems))
        check_interrupt()
        system, user = instructions.repair_messages(expanded, request.task, duration, produced.strip(), problems)
        produced = backend.complete("repair", system, user, image=image, sampling=sampling, stop_at_object=True,
                                    on_token=on_token)
        document, problems = _judge(produced, duration or None)
        repaired = True
    if problems:
        shown = produced.strip()
        shown = shown if len(shown) <= 2000 else shown[:2000] + " ..."
        raise RewriteError(
            f"the {backend.name} rewriter did not produce a valid caption after one repair pass. Problems: "
            + "; ".join(problems[:12]) + (f" (and {len(problems) - 12} more)" if len(problems) > 12 else "")
            + f". It produced: {shown or '(nothing)'}", produced, problems)
    result = RewriteResult(_compact(document), expanded, document, repaired)
    if key is not None:
        cache.put(key, result)
    return result
