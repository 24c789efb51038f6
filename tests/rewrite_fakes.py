"""Test helpers for the rewriter: a loopback OpenAI-compatible server with canned replies, a valid
caption for a duration, and a head that makes a tiny random model write a given text."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from lingbot_core.caption_schema import CAMERA_DEFAULTS, timestamp


def valid_caption(duration: float = 5.0, video: bool = True) -> dict[str, Any]:
    element: dict[str, Any] = {"name": "paper boat", "description": "A small red paper boat."}
    if video:
        element["actions"] = [{"timestamp": timestamp(0, duration / 2), "action": "drifts forward"},
                              {"timestamp": timestamp(duration / 2, duration), "action": "turns to the bridge"}]
    description = {"scene_content_description": "A canal at dawn with mist over the water."}
    if video:
        description["camera_movement_description"] = "The camera tracks right."
    caption = {"comprehensive_description": description, "camera_info": dict(CAMERA_DEFAULTS),
               "world_knowledge": [], "prominent_elements": [element]}
    return {"caption": caption, "duration": duration if video else None}


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
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

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
