"""An OpenAI-compatible chat endpoint (vLLM, SGLang, Ollama, LM Studio, ...) as a rewriter backend.

Plain ``http.client`` (no new dependency): one POST to ``<endpoint>/chat/completions`` per stage,
retries with backoff on connection errors, timeouts, 429 and 5xx, and errors that name the endpoint
and the HTTP status. Redirects are refused (a listed endpoint must not bounce the request to an
address nobody allowed). The API key comes from the environment only (:data:`API_KEY_ENV`), never
from a workflow, and never appears in a message: whatever an endpoint echoes back is redacted
(:func:`redact`). Which endpoints a host may call is decided by the caller (:func:`endpoint_allowed`
against the operator's list); an endpoint's path is decoded and must have no dot segments, so the
path compared is the path requested. The environment's proxy settings are not used: the request goes to the
listed address itself.

Each attempt has one deadline for everything (connect, send, the whole reply: an endpoint that
sends a byte every few seconds cannot hold a call longer), :data:`TIMEOUT_ENV` seconds (default
120), set by the operator. The request runs in a helper thread while the caller's thread checks
for a cancel every :data:`POLL_S` seconds; a cancel or the deadline shuts the socket down at once.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import re
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from ..interrupt import check_interrupt
from .core import Sampling, TokenCallback

API_KEY_ENV = "LINGBOT_REWRITE_API_KEY"
ENDPOINTS_ENV = "LINGBOT_REWRITE_ENDPOINTS"
TIMEOUT_ENV = "LINGBOT_REWRITE_TIMEOUT"
DEFAULT_TIMEOUT = 120.0
MAX_TIMEOUT = 3600.0
MAX_REPLY_BYTES = 4 << 20
MAX_ERROR_BYTES = 8192  # of an error body, read (and redacted) before 300 characters of it are shown
MAX_ENDPOINT_CHARS = 2048
POLL_S = 0.2  # how often a waiting request looks for a cancel
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class EndpointError(RuntimeError):
    """The endpoint could not give a reply (after the retries); the message names it and the status."""


def shown(text: str, limit: int = 120) -> str:
    """`text` quoted for a message, cut to `limit` characters (a 10 MB address is not echoed whole)."""
    quoted = repr(text)
    return quoted if len(quoted) <= limit else quoted[:limit] + f"... ({len(text)} characters)"


def _clean_path(path: str, url: str) -> str:
    """The path decoded once, without a trailing slash; ValueError for a path that could mean two
    things to two servers (dot segments, empty segments, a second encoding, backslashes, ';')."""
    try:
        decoded = urllib.parse.unquote(path, errors="strict")
    except UnicodeDecodeError:
        raise ValueError(f"the rewrite endpoint {shown(url)} has a path that is not UTF-8 once decoded") from None
    segments = decoded.rstrip("/").split("/")[1:]
    if ("%" in decoded or "\\" in decoded or ";" in decoded or any(ord(c) < 32 or ord(c) == 127 for c in decoded)
            or any(s in ("", ".", "..") for s in segments)):
        raise ValueError(f"the rewrite endpoint {shown(url)} has an ambiguous path ('.' or '..' segments, '//', "
                         "an encoded '%', '\\' or ';'); give the plain base address, e.g. http://127.0.0.1:8000/v1")
    return "/" + "/".join(segments) if segments else ""


def _parts(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, decoded path) of an endpoint address; ValueError says what is wrong."""
    if not isinstance(url, str):
        raise ValueError(f"the rewrite endpoint must be text, got {type(url).__name__}")
    text = url.strip()
    if len(text) > MAX_ENDPOINT_CHARS:
        raise ValueError(f"the rewrite endpoint is {len(text)} characters long; an address has at most "
                         f"{MAX_ENDPOINT_CHARS}: {shown(text)}")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in text):
        raise ValueError(f"the rewrite endpoint must not contain spaces or control characters, got {shown(text)}")
    try:
        parsed = urllib.parse.urlsplit(text)
        host, port = parsed.hostname, parsed.port
    except ValueError:  # Python's own "Port out of range", "Invalid IPv6 URL", ...
        raise ValueError(f"the rewrite endpoint {shown(text)} is not a valid address: check the host and the port "
                         "(a whole number from 1 to 65535), e.g. http://127.0.0.1:8000/v1") from None
    scheme = parsed.scheme.lower()
    if scheme not in ("http", "https") or not host:
        raise ValueError(f"the rewrite endpoint must be an http:// or https:// address, got {shown(text)}")
    if parsed.username is not None or parsed.password is not None:
        raise ValueError("the rewrite endpoint must not carry a user name or password; put the API key in "
                         f"the {API_KEY_ENV} environment variable")
    if parsed.query or parsed.fragment or "?" in text or "#" in text:
        raise ValueError(f"the rewrite endpoint is a base address (e.g. http://127.0.0.1:8000/v1), got {shown(text)}")
    if port == 0:
        raise ValueError(f"the rewrite endpoint {shown(text)} names port 0; give the port the server listens on")
    return scheme, host.lower(), port or (443 if scheme == "https" else 80), _clean_path(parsed.path, text)


def normalize_endpoint(url: str) -> str:
    """``scheme://host:port/path`` without a trailing slash or a ``/chat/completions`` tail."""
    scheme, host, port, path = _parts(url)
    if path.endswith("/chat/completions"):
        path = path[: -len("/chat/completions")]
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}:{port}{urllib.parse.quote(path, safe='/')}"


def allowed_endpoints(environ: dict[str, str] | None = None) -> list[str]:
    """The operator's list from :data:`ENDPOINTS_ENV` (comma-separated base addresses; empty: none)."""
    raw = (environ if environ is not None else os.environ).get(ENDPOINTS_ENV, "")
    return [normalize_endpoint(e) for e in raw.split(",") if e.strip()]


def endpoint_allowed(url: str, allowed: list[str]) -> bool:
    """Is ``url`` one of ``allowed`` (same scheme, host and port; its path at or under the listed one)?
    Paths are compared decoded, and one with dot segments (``..``, ``%2e%2e``) is never allowed."""
    try:
        wanted = normalize_endpoint(url)
    except ValueError:
        return False
    for entry in allowed:
        entry = normalize_endpoint(entry)
        if wanted == entry or wanted.startswith(entry + "/"):
            return True
    return False


def timeout_from_env(environ: dict[str, str] | None = None) -> float:
    """The operator's deadline per attempt (:data:`TIMEOUT_ENV`, seconds; default 120)."""
    raw = (environ if environ is not None else os.environ).get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_TIMEOUT:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds above 0 and at most {MAX_TIMEOUT:g}, "
                         f"got {shown(raw, 40)}")
    return value


_SECRET_FIELD = re.compile(r"(?i)((?:proxy-)?authorization|x-api-key|api[-_]?key|access[-_]?token|cookie|set-cookie)"
                           r"(\\?[\"']?\s*[:=]\s*\\?[\"']?)([^\"'\\\r\n,;}]*)")
_BEARER = re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]+")
REDACTED = "[redacted]"


def _forms(secret: str) -> list[str]:
    """How an echo may spell a secret: as is, JSON-escaped, percent-encoded, in base64."""
    forms = {secret, json.dumps(secret)[1:-1], urllib.parse.quote(secret, safe=""),
             base64.b64encode(secret.encode()).decode()}
    return sorted((f for f in forms if len(f) >= 4), key=len, reverse=True)


def hide_secrets(text: str, secrets: list[str], *, cut: bool = False) -> str:
    """`text` with every spelling of each of `secrets` (`_forms`) replaced by ``[redacted]``; `cut`: also
    a secret's beginning (4 characters or more) at the very end (the text was cut inside it)."""
    for secret in secrets:
        for form in _forms(secret):
            text = re.sub(re.escape(form), REDACTED, text, flags=re.IGNORECASE)
            if cut:
                tail = text[-len(form):].lower()
                for size in range(len(form) - 1, 3, -1):
                    if tail.endswith(form[:size].lower()):
                        text = text[: len(text) - size] + REDACTED
                        break
    return text


def redact(text: str, secrets: list[str]) -> str:
    """An error text made safe to show: `hide_secrets` (a cut tail included), any value after an
    authorization / API key / cookie field name and any ``Bearer`` / ``Basic`` token blanked."""
    text = hide_secrets(text, secrets, cut=True)
    text = _SECRET_FIELD.sub(lambda m: m.group(1) + m.group(2) + (REDACTED if m.group(3).strip() else ""), text)
    return _BEARER.sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)


@dataclass
class _Attempt:
    """One request in flight on its helper thread: its connection (for shutting it down) and outcome."""

    connection: Any = None
    outcome: Any = None
    abandoned: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    def abandon(self) -> None:
        """Shut the socket down so the helper thread's read or write ends now (never waits for it)."""
        self.abandoned = True
        sock = getattr(self.connection, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _send(attempt: _Attempt, scheme: str, host: str, port: int, path: str, data: bytes, headers: dict[str, str],
          timeout: float) -> None:
    connection = None
    try:
        kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        connection = attempt.connection = kind(host, port, timeout=timeout)
        connection.connect()
        if attempt.abandoned:  # cancelled or past the deadline while connecting: send nothing
            return
        connection.request("POST", path, body=data, headers=headers)
        reply = connection.getresponse()
        limit = MAX_REPLY_BYTES + 1 if 200 <= reply.status < 300 else MAX_ERROR_BYTES
        attempt.outcome = (reply.status, reply.reason, reply.read(limit))
    except BaseException as exc:  # handed to the caller's thread
        attempt.outcome = exc
    finally:
        if connection is not None:
            connection.close()
        attempt.done.set()


class _Deadline(Exception):
    pass


def _wait(seconds: float) -> None:
    """Sleep, looking for a cancel every POLL_S seconds."""
    end = time.monotonic() + seconds
    while True:
        check_interrupt()
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(POLL_S, left))


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
    timeout: float = field(default_factory=timeout_from_env)  # seconds per attempt, everything included
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

    def _exchange(self, data: bytes, headers: dict[str, str]) -> tuple[int, str, bytes]:
        """One attempt: (status, reason, body), within `timeout` seconds in all, a cancel seen within
        POLL_S. Raises _Deadline, OSError (no connection, reset, TLS) or the cancel."""
        scheme, host, port, path = _parts(self.endpoint)
        attempt = _Attempt()
        worker = threading.Thread(target=_send, name="lingbot-rewrite-request", daemon=True,
                                  args=(attempt, scheme, host, port,
                                        urllib.parse.quote(path, safe="/") + "/chat/completions", data, headers,
                                        self.timeout))
        deadline = time.monotonic() + self.timeout
        worker.start()
        try:
            while not attempt.done.wait(max(0.0, min(POLL_S, deadline - time.monotonic()))):
                check_interrupt()
                if time.monotonic() >= deadline:
                    raise _Deadline
        finally:
            if not attempt.done.is_set():
                attempt.abandon()
        outcome = attempt.outcome
        if isinstance(outcome, TimeoutError):  # the socket's own limit (the same seconds) ran out first
            raise _Deadline
        if isinstance(outcome, (OSError, http.client.HTTPException)):
            raise OSError(str(outcome) or type(outcome).__name__)
        if isinstance(outcome, BaseException):  # nothing else is expected; its text may quote a header
            key = os.environ.get(API_KEY_ENV, "").strip()
            raise EndpointError(f"the request to the rewrite endpoint {self.endpoint} failed: " + shown(
                redact(f"{type(outcome).__name__}: {outcome}", [key] if key else []), 300))
        return outcome

    def _post(self, data: bytes) -> dict:
        url = self.endpoint + "/chat/completions"
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        key = os.environ.get(API_KEY_ENV, "").strip()
        secrets = [key] if key else []
        if key:
            if not key.isascii() or not key.isprintable():
                raise EndpointError(f"the {API_KEY_ENV} environment variable holds characters an HTTP header cannot "
                                    "carry (only printable ASCII); check how it was set")
            headers["Authorization"] = f"Bearer {key}"
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                _wait(self.backoff * 2 ** (attempt - 1))
            check_interrupt()
            try:
                status, reason, raw = self._exchange(data, headers)
            except _Deadline:
                last = f"no complete reply within {self.timeout:g} s (the limit per attempt, {TIMEOUT_ENV})"
                continue
            except OSError as exc:
                last = redact(f"connection failed ({str(exc)[:300]})", secrets)
                continue
            if not 200 <= status < 300:
                detail = redact(raw.decode("utf-8", "replace"), secrets).strip()
                detail = " ".join(detail.split())
                detail = detail if len(detail) <= 300 else detail[:300] + " ..."
                last = f"HTTP {status} {redact(str(reason)[:100], secrets)}" + (f": {detail}" if detail else "")
                if 300 <= status < 400:
                    last += " (a redirect: refused, give the address it points to if the operator allows it)"
                if status in RETRY_STATUS:
                    continue
                raise EndpointError(f"the rewrite endpoint {url} answered {last}")
            if len(raw) > MAX_REPLY_BYTES:
                raise EndpointError(f"the rewrite endpoint {url} sent more than {MAX_REPLY_BYTES >> 20} MiB")
            try:
                return json.loads(raw)
            except RecursionError:
                raise EndpointError(f"the rewrite endpoint {url} answered with JSON nested too deeply") from None
            except ValueError:
                text = redact(raw[:2000].decode("utf-8", "replace"), secrets)
                raise EndpointError(f"the rewrite endpoint {url} did not answer with JSON: {shown(text, 200)}") from None
        raise EndpointError(f"the rewrite endpoint {url} failed after {self.retries + 1} attempt(s): {last}")

    def complete(self, stage: str, system: str, user: str, *, image: Any | None, sampling: Sampling,
                 stop_at_object: bool, on_token: TokenCallback | None) -> str:
        reply = self._post(self._body(stage, system, user, image, sampling))
        try:
            message = reply["choices"][0]["message"]
            text = message.get("content") or ""
        except (KeyError, IndexError, TypeError, AttributeError):
            key = os.environ.get(API_KEY_ENV, "").strip()
            try:
                seen = json.dumps(reply)[:2000]
            except (RecursionError, ValueError):
                seen = f"(a {type(reply).__name__} nested too deeply to show)"
            raise EndpointError(f"the rewrite endpoint {self.endpoint}/chat/completions answered without "
                                f"choices[0].message: {shown(redact(seen, [key] if key else []), 200)}") from None
        if not isinstance(text, str):
            raise EndpointError(f"the rewrite endpoint {self.endpoint} sent a non-text message content")
        key = os.environ.get(API_KEY_ENV, "").strip()
        if key:  # an endpoint that writes the request's headers into its answer: the key goes no further
            text = hide_secrets(text, [key])
        usage = reply.get("usage") if isinstance(reply, dict) else None
        tokens = usage.get("completion_tokens", 0) if isinstance(usage, dict) else 0
        tokens = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else 0
        if on_token is not None:
            on_token(stage, max(0, min(int(tokens), self.max_tokens)), self.max_tokens)
        return text
