"""Test helpers for the rewriter: a loopback OpenAI-compatible server with canned replies, a valid
caption for a duration, and a head that makes a tiny random model write a given text."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from lingbot_core.caption_schema import CAMERA_DEFAULTS, IMAGE_CAMERA_DEFAULTS, timestamp


def valid_caption(duration: float = 5.0, video: bool = True) -> dict[str, Any]:
    element: dict[str, Any] = {"name": "paper boat", "description": "A small red paper boat."}
    if video:
        element["actions"] = [{"timestamp": timestamp(0, duration / 2), "action": "drifts forward"},
                              {"timestamp": timestamp(duration / 2, duration), "action": "turns to the bridge"}]
    scene = "A canal at dawn with mist over the water."
    description: Any = scene  # a still image's description is one string (the model's image shape)
    if video:
        description = {"scene_content_description": scene, "camera_movement_description": "The camera tracks right."}
    caption = {"comprehensive_description": description,
               "camera_info": dict(CAMERA_DEFAULTS if video else IMAGE_CAMERA_DEFAULTS),
               "world_knowledge": [], "prominent_elements": [element]}
    return {"caption": caption, "duration": duration if video else None}


POLL_S = 0.02  # how often a fake server's loop looks for a shutdown

def reply(content: str, tokens: int = 7) -> dict:
    return {"choices": [{"message": {"role": "assistant", "content": content}}],
            "usage": {"completion_tokens": tokens}}


class FakeChatServer:
    """http.server on 127.0.0.1, port 0, in a thread. ``script`` is a list of steps, one per request:
    a dict (sent as JSON), ``("status", code)``, ``("sleep", seconds, dict)``, ``("raw", bytes)`` or
    ``("redirect", url)``. Requests are recorded (path, headers, body)."""

    def __init__(self, script: list):
        self.script = list(script)
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                server.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                step = server.script.pop(0) if server.script else ("status", 500)
                if isinstance(step, tuple) and step[0] == "sleep":
                    time.sleep(step[1])
                    step = step[2]
                if isinstance(step, tuple) and step[0] == "status":
                    self.send_response(step[1])
                    self.send_header("Content-Type", "text/plain")
                    self.end_headers()
                    self.wfile.write(b"server trouble")
                    return
                if isinstance(step, tuple) and step[0] == "redirect":
                    self.send_response(307)
                    self.send_header("Location", step[1])
                    self.end_headers()
                    return
                data = step[1] if isinstance(step, tuple) and step[0] == "raw" else json.dumps(step).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        # shutdown() returns once the serving loop polls again: every 0.5 s by default, a
        # second of waiting for a test with two servers
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": POLL_S}, daemon=True)

    def __enter__(self) -> FakeChatServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class ScriptedHead:
    """Makes the text encoder's LM head pick the tokens of given texts, one text per generate call
    (a new call is seen as a forward with more than one input token: the prefill)."""

    def __init__(self, encoder: torch.nn.Module, tokenizer: Any, texts: list[str]):
        self.ids = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
                    for t in texts]
        self.call, self.position = -1, 0
        self.prefills = 0

        def pre(_module, _args, kwargs):
            ids = kwargs.get("input_ids")
            if ids is not None and ids.shape[-1] > 1:
                self.call, self.position = self.call + 1, 0
                self.prefills += 1

        def post(_module, _args, output):
            script = self.ids[min(self.call, len(self.ids) - 1)]
            token = script[min(self.position, len(script) - 1)]
            self.position += 1
            forced = torch.full_like(output, -1e4)
            forced[..., token] = 1e4
            return forced

        self.handles = [encoder.model.register_forward_pre_hook(pre, with_kwargs=True),
                        encoder.lm_head.register_forward_hook(post)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def short_caption(duration: float = 5.0) -> dict[str, Any]:
    """A valid video caption with the fewest words (fewer tokens for a scripted tiny model to write)."""
    caption = {"comprehensive_description": {"scene_content_description": "A boat.",
                                             "camera_movement_description": "Static."},
               "camera_info": dict(CAMERA_DEFAULTS), "world_knowledge": [],
               "prominent_elements": [{"name": "boat", "description": "Red.",
                                       "actions": [{"timestamp": timestamp(0, duration), "action": "Drifts."}]}]}
    return {"caption": caption, "duration": duration}


class ScriptedRewriter:
    """Makes every `local` rewrite write ``texts[stage]`` (expand, map, repair, negative) on the tiny
    random-weight text encoder: generation still runs through the stage door, token by token; only
    the head's choice is forced (:class:`ScriptedHead`). ``stages`` records each call."""

    def __init__(self, texts: dict[str, str]):
        self.texts = texts
        self.stages: list[str] = []

    def install(self, monkeypatch: Any) -> ScriptedRewriter:
        from lingbot_core.rewrite.local_backend import LocalBackend

        original = LocalBackend.complete
        rewriter = self

        def complete(backend, stage, system, user, **kw):
            handle = backend.handle
            head = ScriptedHead(handle.component("text_encoder"), handle.component("processor").tokenizer,
                                [rewriter.texts[stage]])
            try:
                return original(backend, stage, system, user, **kw)
            finally:
                head.remove()
                rewriter.stages.append(stage)

        monkeypatch.setattr(LocalBackend, "complete", complete)
        # The scripted head makes the random-weight tiny model write: let it past the refusal of that model.
        from lingbot_core.rewrite import local_backend

        monkeypatch.setattr(local_backend, "check_writes_text", lambda handle: None)
        return self


class HostileServer:
    """A loopback chat endpoint that misbehaves one way (``mode``), on a bounded threading server: at most
    `MAX_HANDLERS` requests at once, and every slow behaviour ends by itself within `LONGEST` seconds
    (or when the server closes), so a client that fails to give up fails a test instead of hanging it.

    Modes: ``echo-400`` / ``echo-500`` / ``echo-200-text`` (the request's headers as text, with that
    status), ``echo-200-json`` / ``echo-400-json`` (as a JSON object), ``echo-400-cut`` (the echo after
    padding that puts the key at byte 290, so a 300-byte excerpt would cut it), ``echo-content`` (a chat reply
    whose text is the headers); ``drip-body`` / ``drip-headers`` (one
    byte every 0.2 s), ``silent`` (no answer), ``status-503``; ``nested-reply`` (200 KB of ``[``),
    ``nested-choices`` (a reply nested 900 deep), ``nested-content`` (a chat reply whose text nests
    5,000 deep); ``content:<text>`` a chat reply with that text."""

    MAX_HANDLERS = 8
    LONGEST = 20.0

    def __init__(self, mode: str):
        self.mode = mode
        self.seen_key: str | None = None
        self.requests = 0
        self.closing = threading.Event()
        slots = threading.BoundedSemaphore(self.MAX_HANDLERS)
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):  # noqa: N802 - http.server's name
                if not slots.acquire(timeout=1):
                    self.send_error(503)
                    return
                try:
                    length = min(int(self.headers.get("Content-Length", 0)), 16 << 20)
                    self.rfile.read(length)
                    server.requests += 1
                    server.seen_key = self.headers.get("Authorization")
                    server.answer(self)
                except (BrokenPipeError, ConnectionResetError, OSError):
                    pass
                finally:
                    slots.release()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        # shutdown() returns once the serving loop polls again: every 0.5 s by default, a
        # second of waiting for a test with two servers
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": POLL_S}, daemon=True)

    def _send(self, handler, status: int, body: bytes, kind: str = "application/json") -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", kind)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def _drip(self, handler, data: bytes) -> None:
        end = time.monotonic() + self.LONGEST
        for byte in data:
            if self.closing.wait(0.2) or time.monotonic() > end:
                return
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()

    def answer(self, handler) -> None:
        mode = self.mode
        headers = dict(handler.headers)
        echo = "\n".join(f"{k}: {v}" for k, v in headers.items())
        if mode in ("echo-400", "echo-500", "echo-200-text"):
            self._send(handler, int(mode.split("-")[1]) if mode != "echo-200-text" else 200,
                       f"bad request; you sent:\n{echo}".encode(), "text/plain")
        elif mode == "echo-content":
            self._send(handler, 200, json.dumps(reply(f"Your request:\n{echo}")).encode())
        elif mode == "echo-400-cut":
            at = echo.find("Bearer ") + len("Bearer ")  # the key's first byte lands at byte 290 of the body
            self._send(handler, 400, ("x" * max(0, 290 - at) + echo).encode(), "text/plain")
        elif mode in ("echo-200-json", "echo-400-json"):
            self._send(handler, int(mode.split("-")[1]), json.dumps({"error": {"message": "rejected",
                                                                               "request_headers": headers}}).encode())
        elif mode == "drip-body":
            handler.send_response(200)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", "1000")
            handler.end_headers()
            handler.wfile.flush()
            self._drip(handler, b" " * 1000)
        elif mode == "drip-headers":
            self._drip(handler, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Padding: " + b"a" * 1000)
        elif mode == "silent":
            self.closing.wait(self.LONGEST)
        elif mode == "status-503":
            self._send(handler, 503, b"busy", "text/plain")
        elif mode == "nested-reply":
            self._send(handler, 200, b"[" * 200_000)
        elif mode == "nested-choices":
            self._send(handler, 200, b'{"x": ' + b"[" * 900 + b"]" * 900 + b"}")
        elif mode == "nested-content":
            self._send(handler, 200, json.dumps(reply('{"a": ' * 5000 + "1" + "}" * 5000)).encode())
        elif mode.startswith("content:"):
            self._send(handler, 200, json.dumps(reply(mode[len("content:"):])).encode())
        else:
            raise ValueError(f"unknown mode {mode!r}")

    def __enter__(self) -> HostileServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()
