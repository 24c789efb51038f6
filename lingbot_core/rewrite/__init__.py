"""Prompt rewriter: prose (plus the first frame for TI2V) in, the structured caption LingBot-Video was
trained on out, by a model in two stages (expand the request, map it onto the schema).

Two backends: :class:`LocalBackend` runs the checkpoint's own Qwen3-VL text encoder through the
stage door; :class:`OpenAIBackend` calls an OpenAI-compatible chat endpoint (the node and the CLI
pick it when an endpoint is given). Which
endpoints a host may call is the host's decision (:func:`endpoint_allowed` against
:func:`allowed_endpoints`); API keys come from the environment only.
"""

from __future__ import annotations

from .core import (
                   CACHE,
                   JSON_STAGES,
                   STAGES,
                   Backend,
                   ResultCache,
                   RewriteError,
                   RewriteRequest,
                   RewriteResult,
                   Sampling,
                   duration_for,
                   rewrite,
)
from .instructions import TASKS
from .local_backend import CannotWrite, LocalBackend, check_writes_text, generate_text
from .negative import prune_negative
from .openai_backend import (
                   API_KEY_ENV,
                   ENDPOINTS_ENV,
                   EndpointError,
                   OpenAIBackend,
                   allowed_endpoints,
                   endpoint_allowed,
                   normalize_endpoint,
)
from .scan import ObjectScanner, extract_object

__all__ = ["API_KEY_ENV", "CACHE", "ENDPOINTS_ENV", "JSON_STAGES", "STAGES", "TASKS", "Backend",
           "CannotWrite", "check_writes_text",
           "EndpointError", "LocalBackend", "ObjectScanner", "OpenAIBackend", "ResultCache", "RewriteError",
           "RewriteRequest", "RewriteResult", "Sampling", "allowed_endpoints", "duration_for", "endpoint_allowed",
           "extract_object", "generate_text", "normalize_endpoint", "prune_negative", "rewrite"]
