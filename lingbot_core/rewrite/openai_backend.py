"""An OpenAI-compatible chat endpoint (vLLM, SGLang, Ollama, LM Studio, ...) as a rewriter backend.

Plain ``urllib`` (no new dependency): one POST to ``<endpoint>/chat/completions`` per stage, with a
timeout, retries with backoff on connection errors, timeouts, 429 and 5xx, and errors that name the
endpoint and the HTTP status. Redirects are refused (a listed endpoint must not bounce the request
to an address nobody allowed). The API key comes from the environment only
(:data:`API_KEY_ENV`), never from a workflow. Which endpoints a host may call is decided by the
caller (:func:`endpoint_allowed` against the operator's list).
"""

from __future__ import annotations

import base64
import io
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from ..interrupt import check_interrupt
from .core import Sampling, TokenCallback

API_KEY_ENV = "LINGBOT_REWRITE_API_KEY"
ENDPOINTS_ENV = "LINGBOT_REWRITE_ENDPOINTS"
MAX_REPLY_BYTES = 4 << 20
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class EndpointError(RuntimeError):
    """The endpoint could not give a reply (after the retries); the message names it and the status."""


def _parts(url: str) -> tuple[str, str, int, str]:
    parsed = urllib.parse.urlsplit(url.strip())
    scheme = parsed.scheme.lower()
    if scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"the rewrite endpoint must be an http:// or https:// address, got {url!r}")
    if parsed.username or parsed.password:
        raise ValueError("the rewrite endpoint must not carry a user name or password; put the API key in "
                         f"the {API_KEY_ENV} environment variable")
    if parsed.query or parsed.fragment:
        raise ValueError(f"the rewrite endpoint is a base address (e.g. http://127.0.0.1:8000/v1), got {url!r}")
    port = parsed.port or (443 if scheme == "https" else 80)
    return scheme, parsed.hostname.lower(), port, parsed.path.rstrip("/")


def normalize_endpoint(url: str) -> str:
    """``scheme://host:port/path`` without a trailing slash or a ``/chat/completions`` tail."""
    scheme, host, port, path = _parts(url)
    if path.endswith("/chat/completions"):
        path = path[: -len("/chat/completions")]
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}:{port}{path}"


def allowed_endpoints(environ: dict[str, str] | None = None) -> list[str]:
    """The operator's list from :data:`ENDPOINTS_ENV` (comma-separated base addresses; empty: none)."""
    raw = (environ if environ is not None else os.environ).get(ENDPOINTS_ENV, "")
    return [normalize_endpoint(e) for e in raw.split(",") if e.strip()]


def endpoint_allowed(url: str, allowed: list[str]) -> bool:
    """Is ``url`` one of ``allowed`` (same scheme, host and port; its path at or under the listed one)?"""
    wanted = normalize_endpoint(url)
    for entry in allowed:
        entry = normalize_endpoint(entry)
        if wanted == entry or wanted.startswith(entry + "/"):
            return True
    return False


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D401 - urllib's signature
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} refused", headers, fp)


_OPENER = urllib.request.build_opener(_NoRedirect)


def _image_url(image: Any) -> str:
    from ..image import load_image

    picture = load_image(image)
    scale = min(1.0, 1024 / max(picture.size))
    if scale < 1.0:
        picture = picture.resize((max(1, round(picture.width * scale)), max(1, round(picture.height * scale))))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


@dataclass
class OpenAIBackend:
    """``expand_model`` answers stage 1 (and the auto negative), ``map_model`` stages 2 and repair (e.g. a LoRA adapter's name
    on a vLLM server that serves the official rewriter; empty: the same as ``expand_model``)."""

    endpoint: str
    expand_model: str
    map_model: str = ""
    timeout: float = 120.0
    retries: int = 2
    backoff: float = 1.0
    max_tokens: int = 4096
    name: str = "openai"

    def __post_init__(self) -> None:
        self.endpoint = normalize_endpoint(self.endpoint)
        if not self.expand_model.strip():
            raise ValueError("give the model name the endpoint serves (expand_model)")
        self.map_model = self.map_model.strip() or self.expand_model

    def identity(self) -> tuple:
        return (self.endpoint, self.expand_model, self.map_model, self.max_tokens)

    def model_for(self, stage: str) -> str:
        return self.expand_model if stage in ("expand", "negative") else self.map_model

    def _body(self, stage: str, system: str, user: str, image: Any | None, sampling: Sampling) -> bytes:
        content: Any = user
        if image is not None:
            content = [{"type": "image_url", "image_url": {"url": _image_url(image)}}, {"type": "text", "text": user}]
        body = {
            "model": self.model_for(stage),
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
            "temperature": max(0.0, sampling.temperature),
            "top_p": sampling.top_p,
            "stream": False,
            # vLLM / SGLang pass these to the chat template: Qwen3-family models answer without thinking
            "chat_template_kwargs": {"enable_thinking": False},
        }
        if not sampling.greedy:
            body["seed"] = sampling.seed
        return json.dumps(body).encode()

    def _post(self, data: bytes) -> dict:
        url = self.endpoint + "/chat/completions"
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        key = os.environ.get(API_KEY_ENV, "").strip()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            check_interrupt()
            request = urllib.request.Request(url, data=data, headers=headers, method="POST")
            try:
                with _OPENER.open(request, timeout=self.timeout) as reply:
                    raw = reply.read(MAX_REPLY_BYTES + 1)
            except urllib.error.HTTPError as exc:
                detail = exc.read(300).decode("utf-8", "replace").strip() if exc.fp is not None else ""
                last = f"HTTP {exc.code} {exc.reason}" + (f": {detail}" if detail else "")
                if exc.code in RETRY_STATUS:
                    continue
                raise EndpointError(f"the rewrite endpoint {url} answered {last}") from None
            except TimeoutError:
                last = f"no reply within {self.timeout:g} s"
                continue
            except urllib.error.URLError as exc:
                last = f"cannot connect ({exc.reason})"
                continue
            except (ConnectionError, OSError) as exc:
                last = f"connection failed ({exc})"
                continue
            if len(raw) > MAX_REPLY_BYTES:
                raise EndpointError(f"the rewrite endpoint {url} sent more than {MAX_REPLY_BYTES >> 20} MiB")
            try:
                return json.loads(raw)
            except ValueError:
                raise EndpointError(f"the rewrite endpoint {url} did not answer with JSON: "
                                    f"{raw[:200].decode('utf-8', 'replace')!r}") from None
        raise EndpointError(f"the rewrite endpoint {url} failed after {self.retries + 1} attempt(s): {last}")

    def complete(self, stage: str, system: str, user: str, *, image: Any | None, sampling: Sampling,
                 stop_at_object: bool, on_token: TokenCallback | None) -> str:
        reply = self._post(self._body(stage, system, user, image, sampling))
        try:
            message = reply["choices"][0]["message"]
            text = message.get("content") or ""
        except (KeyError, IndexError, TypeError, AttributeError):
            raise EndpointError(f"the rewrite endpoint {self.endpoint}/chat/completions answered without "
                                f"choices[0].message: {json.dumps(reply)[:200]}") from None
        if not isinstance(text, str):
            raise EndpointError(f"the rewrite endpoint {self.endpoint} sent a non-text message content")
        usage = reply.get("usage") if isinstance(reply, dict) else None
        tokens = usage.get("completion_tokens", 0) if isinstance(usage, dict) else 0
        if on_token is not None:
            on_token(stage, int(tokens or 0), self.max_tokens)
        return text
