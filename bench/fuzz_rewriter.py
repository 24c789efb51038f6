"""Fuzz the rewriter's endpoint client: hostile answers from a loopback server, each rewrite held to its limits.

    python -m bench.fuzz_rewriter [--cases 400] [--seed 0] [--timeout 1.0] [--json OUT]

A bounded threading HTTP server on 127.0.0.1 answers each request as the case says: a status (200,
3xx, 4xx, 5xx, nonsense), a body built from pieces (a valid chat reply, a valid caption, random JSON,
truncated or non-UTF-8 bytes, deep nesting, the request's own headers echoed back, megabytes of
text, a wrong Content-Length), and sometimes a slow delivery (one byte every 0.2 s, or silence). The
client (`lingbot_core.rewrite.rewrite` on an `OpenAIBackend`, an API key set, `--timeout` seconds per
attempt) may also be cancelled at a random moment. Each case ends in one outcome:

- ``caption``: a result, and it passes the caption check;
- ``refused``: our error (`EndpointError`, `RewriteError`, or the cancel when the case cancelled);
- ``crash``: any other exception;
- ``hang``: no return within the case's bound (attempts x timeout + backoff + 2 s, or 1.5 s after
  a cancel);
- ``silent``: returned wrong without a word: a result that fails the caption check, a message or a
  result that holds the API key (or 8+ characters of it), or a message longer than 4,000 characters.

Prints a JSON summary (counts, slowest case, the first few bad cases). Keep --cases x the slow
share (about 1 in 6 cases waits up to --timeout) within the time you have: 400 cases take about a
minute.
"""

from __future__ import annotations

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from bench._common import fuzz_parser, fuzz_report, fuzz_tally

KEY = "sk-fuzz-8d1c4b7e2a9f4c3d8e7b6a5f4c3d2e1f"


class Cancelled(Exception):
    pass


def _caption(duration: float = 5.0) -> dict[str, Any]:
    from lingbot_core.caption_schema import CAMERA_DEFAULTS, timestamp

    return {"caption": {"comprehensive_description": {"scene_content_description": "A canal at dawn.",
                                                      "camera_movement_description": "Static."},
                        "camera_info": dict(CAMERA_DEFAULTS), "world_knowledge": [],
                        "prominent_elements": [{"name": "boat", "description": "Red.", "actions": [
                            {"timestamp": timestamp(0, duration), "action": "Drifts."}]}]},
            "duration": duration}


def _chat(content: Any, usage: Any = None) -> dict:
    reply: dict[str, Any] = {"choices": [{"message": {"role": "assistant", "content": content}}]}
    if usage is not None:
        reply["usage"] = usage
    return reply


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(9 if depth < 4 else 5)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False, 0, -1, 2**63, 1e308, -0.0, 0.5])
    if pick == 2:
        return rng.choice(["", "x" * rng.randrange(50), "\u0000", "\ud800", "{", "}", "\"", "é", "🙂"])
    if pick == 3:
        return rng.randrange(-10**6, 10**6)
    if pick == 4:
        return "".join(rng.choice("{}[]\":,ab1 \\") for _ in range(rng.randrange(40)))
    if pick in (5, 6):
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["choices", "message", "content", "usage", "x", "error"]): _random_json(rng, depth + 1)
            for _ in range(rng.randrange(4))}


def make_case(rng: random.Random) -> dict[str, Any]:
    """One case: how the server answers (each request), whether and when the client cancels."""
    caption = json.dumps(_caption())
    bodies = [
        lambda: json.dumps(_chat(caption)),
        lambda: json.dumps(_chat("Sure! ```json\n" + caption + "\n``` hope it helps")),
        lambda: json.dumps(_chat(caption[: rng.randrange(len(caption))])),
        lambda: json.dumps(_chat(_random_json(rng), usage=_random_json(rng))),
        lambda: json.dumps(_random_json(rng)),
        lambda: json.dumps(_chat('{"a": ' * rng.choice([50, 900, 5000]) + "1" + "}" * 5000)),
        lambda: "[" * rng.choice([500, 5000, 200_000]),
        lambda: '{"choices": ' + "[" * rng.choice([900, 3000]) + "]" * 3000 + "}",
        lambda: "ECHO",  # the request's headers, as text
        lambda: "ECHO-JSON",  # the request's headers, in a JSON error object
        lambda: "ECHO-CONTENT",  # a chat reply whose text is the request's headers
        lambda: "x" * rng.choice([10, 300, 5 << 20]),
        lambda: "\xff\xfe" + "".join(chr(rng.randrange(0x20, 0x7f)) for _ in range(50)),
        lambda: json.dumps(_chat(caption))[: rng.randrange(1, 200)],
        lambda: "",
    ]
    status = rng.choice([200] * 8 + [301, 307, 400, 401, 404, 408, 429, 500, 503, 599, 999])
    delivery = rng.choice(["whole"] * 10 + ["drip", "silent", "short-length", "long-length"])
    cancel = rng.random() < 0.15
    return {"status": status, "body": rng.choice(bodies)(), "delivery": delivery,
            "cancel_after": rng.uniform(0.0, 0.6) if cancel else None, "retries": rng.choice([0, 0, 1])}


class Server:
    """The loopback server; `case` says how it answers. At most 16 handlers at once; slow deliveries end
    by themselves within 10 s or when the server closes."""

    def __init__(self) -> None:
        self.case: dict[str, Any] = {}
        self.closing = threading.Event()
        slots = threading.BoundedSemaphore(16)
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802
                if not slots.acquire(timeout=1):
                    return
                try:
                    self.rfile.read(min(int(self.headers.get("Content-Length", 0)), 16 << 20))
                    server.answer(self)
                except OSError:
                    pass
                finally:
                    slots.release()

        class Quiet(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):  # a client that gave up: expected here
                pass

        self.httpd = Quiet(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        case = self.case
        body = case["body"]
        headers = dict(handler.headers)
        if body == "ECHO":
            body = "you sent: " + "\n".join(f"{k}: {v}" for k, v in headers.items())
        elif body == "ECHO-CONTENT":
            body = json.dumps(_chat("Here is what you sent: " + json.dumps(headers)))
        elif body == "ECHO-JSON":
            body = json.dumps({"error": {"message": "denied", "headers": headers}})
        data = body.encode("utf-8", "surrogatepass")
        if case["delivery"] == "silent":
            self.closing.wait(10)
            return
        head = f"HTTP/1.1 {case['status']} Whatever\r\nContent-Type: application/json\r\n"
        length = len(data) + {"short-length": -5, "long-length": 50}.get(case["delivery"], 0)
        head += f"Content-Length: {max(0, length)}\r\nConnection: close\r\n"
        if case["status"] in (301, 307):
            head += "Location: http://10.255.255.1/v1/chat/completions\r\n"
        raw = (head + "\r\n").encode() + data
        if case["delivery"] == "drip":
            end = time.monotonic() + 10
            for i in range(len(raw)):
                if self.closing.wait(0.2) or time.monotonic() > end:
                    return
                handler.wfile.write(raw[i:i + 1])
                handler.wfile.flush()
            return
        handler.wfile.write(raw)

    def close(self) -> None:
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def run_case(server: Server, case: dict[str, Any], timeout: float) -> tuple[str, str]:
    """(outcome, detail) of one case (the module docstring lists the outcomes)."""
    from lingbot_core import rewrite as rw
    from lingbot_core.caption_schema import caption_problems
    from lingbot_core.interrupt import interrupt_checker

    server.case = case
    backend = rw.OpenAIBackend(server.url, "base", "json", timeout=timeout, retries=case["retries"], backoff=0.05)
    request = rw.RewriteRequest("a red paper boat on a canal at dawn", "t2v", 5.0)
    cancel_at = None if case["cancel_after"] is None else time.monotonic() + case["cancel_after"]
    outcome: list = []

    def check() -> None:
        if cancel_at is not None and time.monotonic() >= cancel_at:
            raise Cancelled

    def call() -> None:
        try:
            with interrupt_checker(check):
                outcome.append(rw.rewrite(request, backend, cache=None))
        except BaseException as exc:  # noqa: BLE001 - judged below
            outcome.append(exc)

    # three calls at most (expand, map, repair), each up to retries + 1 attempts
    bound = 3 * ((case["retries"] + 1) * (timeout + 0.3) + 0.1 * case["retries"]) + 2.0
    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    if cancel_at is not None:
        worker.join(max(0.0, cancel_at - time.monotonic()) + 1.5)
    else:
        worker.join(bound)
    if worker.is_alive():
        worker.join(30)  # let it end (the server's slow deliveries stop within 10 s) before the next case
        return "hang", f"still running after {'the cancel + 1.5 s' if cancel_at is not None else f'{bound:.1f} s'}"
    result = outcome[0]
    if isinstance(result, BaseException):
        text = str(result)
        if any(KEY[i:i + 8] in text for i in range(len(KEY) - 7)):
            return "silent", f"the API key in a message: {text[:200]!r}"
        if len(text) > 4000:
            return "silent", f"a {len(text)}-character message"
        if isinstance(result, (rw.EndpointError, rw.RewriteError)) or isinstance(result, Cancelled):
            return "refused", type(result).__name__
        return "crash", f"{type(result).__name__}: {text[:200]}"
    if any(KEY[i:i + 8] in result.caption + result.expanded for i in range(len(KEY) - 7)):
        return "silent", "the API key in the caption or the expanded text"
    problems = caption_problems(result.document, 5.0)
    if problems:
        return "silent", f"a caption with problems: {problems[:3]}"
    return "caption", ""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import os

    parser = fuzz_parser(__doc__, cases=400)
    parser.add_argument("--timeout", type=float, default=1.0, help="the client's deadline per attempt (seconds)")
    args = parser.parse_args(argv)
    from lingbot_core.rewrite import API_KEY_ENV

    os.environ[API_KEY_ENV] = KEY
    rng = random.Random(args.seed)
    server = Server()

    def case(_index: int) -> tuple[str, str, dict[str, Any]]:
        made = make_case(rng)
        shown = {k: (v[:120] + "..." if isinstance(v, str) and len(v) > 120 else v) for k, v in made.items()}
        return (*run_case(server, made, args.timeout), shown)

    try:
        tally = fuzz_tally(args.cases, case, ("caption", "refused"))
    finally:
        server.close()
    return fuzz_report({"cases": args.cases, "seed": args.seed, "timeout_s": args.timeout, **tally}, args.json)


if __name__ == "__main__":
    main()
