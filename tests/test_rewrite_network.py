"""The rewriter's endpoint client against hostile servers (issue 34 items 4, 7, 11; issue 37 items 3, 4):
secrets never echoed, paths that cannot climb out of the allowlist, one deadline per attempt, a cancel
seen within a poll, deep or huge replies and bad addresses refused with our own one-line messages.

Every server here is a bounded loopback server (tests/rewrite_fakes.HostileServer) whose slow
behaviours end on their own after a few seconds, so a regression fails an assertion instead of
hanging the suite."""

from __future__ import annotations

import threading

import pytest
from rewrite_fakes import FakeChatServer, HostileServer, reply, valid_caption

from lingbot_core import rewrite as rw
from lingbot_core.interrupt import interrupt_checker
from lingbot_core.rewrite import openai_backend as ob

KEY = "sk-live-4f9a0c2e7b1d4e8f9a6c3b2d1e0f7a8b"
REQUEST = rw.RewriteRequest("a red paper boat on a canal at dawn", "t2v", 5.0)


class Cancelled(Exception):
    pass


def _backend(url: str, **kw) -> rw.OpenAIBackend:
    kw.setdefault("timeout", 5.0)
    kw.setdefault("retries", 0)
    kw.setdefault("backoff", 0.01)
    return rw.OpenAIBackend(url, "base", "json", **kw)


def _finishes_within(seconds: float, call) -> BaseException | None:
    """Run `call` on a thread; the exception it raised, or fail when it is still running after `seconds`
    (the servers stop on their own later, so the thread ends either way)."""
    outcome: list = []

    def run():
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still waiting after {seconds} s"
    return outcome[0]


# -- item 4: the operator's key -----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["echo-400", "echo-500", "echo-200-text", "echo-200-json", "echo-400-json",
                                  "echo-400-cut"])
def test_an_endpoint_that_echoes_the_request_headers_never_gets_the_key_into_a_message(monkeypatch, caplog, mode):
    monkeypatch.setenv(rw.API_KEY_ENV, KEY)
    with HostileServer(mode) as server:
        with pytest.raises(rw.EndpointError) as caught:
            rw.rewrite(REQUEST, _backend(server.url), cache=None)
    assert server.seen_key == f"Bearer {KEY}"  # the key was sent, and the server echoed it back
    text = str(caught.value) + caplog.text
    for cut in range(6, len(KEY) + 1):
        assert KEY[-cut:] not in text and KEY[:cut] not in text, text
    if mode in ("echo-400", "echo-500", "echo-200-text"):  # elsewhere the excerpt ends before the header
        assert "[redacted]" in text


def test_a_key_echoed_inside_the_models_answer_goes_no_further(monkeypatch):
    """200 with a chat reply whose text is the request's headers: the rewriter shows what the model
    produced when it cannot make a caption of it, so the key must be gone from the text itself."""
    monkeypatch.setenv(rw.API_KEY_ENV, KEY)
    with HostileServer("echo-content") as server:
        with pytest.raises(rw.RewriteError) as caught:
            rw.rewrite(REQUEST, _backend(server.url), cache=None)
    assert server.seen_key == f"Bearer {KEY}"
    text = str(caught.value) + caught.value.produced
    assert "Bearer [redacted]" in text and not any(KEY[i:i + 6] in text for i in range(len(KEY) - 5))


def test_redaction_covers_spellings_field_values_and_a_cut_key():
    for echoed in (KEY, KEY.upper(), f'"authorization": "Token {KEY}"', ob.base64.b64encode(KEY.encode()).decode(),
                   f"x-api-key={KEY[:20]}", "Authorization: Basic abcdefgh", "cookie: session=abcdef12345"):
        out = ob.redact(f"headers: {echoed} end", [KEY])
        assert KEY[:8] not in out and "abcdef" not in out and "[redacted]" in out, out
    assert ob.redact("...tail " + KEY[:9], [KEY]) == "...tail [redacted]"  # the body was cut inside the key
    assert ob.redact("nothing secret here", [KEY]) == "nothing secret here"


def test_a_key_no_header_can_carry_is_refused_without_showing_it(monkeypatch):
    monkeypatch.setenv(rw.API_KEY_ENV, "sk-abc\ndef-ghi")
    with pytest.raises(rw.EndpointError, match="printable ASCII") as caught:
        _backend("http://127.0.0.1:9/v1")._post(b"{}")
    assert "abc" not in str(caught.value)


# -- item 7: the allowlist's path rule -----------------------------------------------------------------

@pytest.mark.parametrize("tail", ["/v1/../admin", "/v1/%2e%2e/admin", "/v1/%2E%2e/admin", "/v1/./chat", "/v1//x",
                                  "/v1/%252e%252e/admin", "/v1/..%2fadmin", "/v1/%2e%2e%2fadmin", "/v1/..;/admin",
                                  "/v1/%5c..%5cadmin", "/v1/x/..", "/v1/%2e"])
def test_dot_segments_cannot_climb_out_of_an_allowed_path(tail):
    allowed = ["http://127.0.0.1:8000/v1"]
    url = "http://127.0.0.1:8000" + tail
    assert not rw.endpoint_allowed(url, allowed)
    with pytest.raises(ValueError, match="ambiguous path"):
        rw.normalize_endpoint(url)


def test_a_percent_encoded_plain_path_is_the_same_path():
    assert rw.normalize_endpoint("http://127.0.0.1:8000/%76%31/") == "http://127.0.0.1:8000/v1"
    assert rw.endpoint_allowed("http://127.0.0.1:8000/v%31/chat/completions", ["http://127.0.0.1:8000/v1"])
    assert rw.normalize_endpoint("http://127.0.0.1:8000/a%20b") == "http://127.0.0.1:8000/a%20b"


# -- item 11: slowloris, cancel, deep replies, bad addresses --------------------------------------------

def test_an_endpoint_sending_a_byte_at_a_time_meets_the_deadline():
    """The server drips one byte every 0.2 s (for up to 20 s): each read succeeds, so only a deadline for
    the whole attempt ends the call."""
    for mode in ("drip-body", "drip-headers"):
        with HostileServer(mode) as server:
            caught = _finishes_within(6, lambda: rw.rewrite(REQUEST, _backend(server.url, timeout=1.0), cache=None))
        assert isinstance(caught, rw.EndpointError) and "no complete reply within 1 s" in str(caught), caught


def test_a_cancel_stops_a_waiting_request_and_a_backoff_at_once():
    """A server that answers after 20 s, a timeout of 60 s: the cancel raised by the checker 0.3 s in ends
    the call within the poll interval (it waited for the socket's timeout before); the same during the
    pause between two attempts."""
    for mode, kw in (("silent", {}), ("status-503", {"retries": 2, "backoff": 30.0})):
        flag = threading.Event()

        def check(flag=flag):
            if flag.is_set():
                raise Cancelled

        def call(check=check, kw=kw):
            with interrupt_checker(check):
                rw.rewrite(REQUEST, _backend(server.url, timeout=60.0, **kw), cache=None)

        with HostileServer(mode) as server:
            threading.Timer(0.3, flag.set).start()
            caught = _finishes_within(4, call)
        assert isinstance(caught, Cancelled), caught


def test_the_deadline_comes_from_the_operator(monkeypatch):
    monkeypatch.setenv(ob.TIMEOUT_ENV, "2.5")
    assert rw.OpenAIBackend("http://127.0.0.1:9/v1", "m").timeout == 2.5
    monkeypatch.delenv(ob.TIMEOUT_ENV)
    assert rw.OpenAIBackend("http://127.0.0.1:9/v1", "m").timeout == ob.DEFAULT_TIMEOUT
    for bad in ("soon", "0", "-1", "nan", "1e9"):
        monkeypatch.setenv(ob.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=ob.TIMEOUT_ENV):
            rw.OpenAIBackend("http://127.0.0.1:9/v1", "m")


@pytest.mark.parametrize("mode", ["nested-reply", "nested-choices", "nested-content"])
def test_a_deeply_nested_reply_is_a_clear_error(mode):
    with HostileServer(mode) as server:
        with pytest.raises((rw.EndpointError, rw.RewriteError)) as caught:
            rw.rewrite(REQUEST, _backend(server.url), cache=None)
    assert len(str(caught.value)) < 3000 and "Recursion" not in str(caught.value)


@pytest.mark.parametrize("url,message", [
    ("http://127.0.0.1:99999/v1", "not a valid address"),
    ("http://127.0.0.1:port/v1", "not a valid address"),
    ("http://[::1/v1", "not a valid address"),
    ("http://127.0.0.1:0/v1", "port 0"),
    ("http://127.0.0.1:8000/v1 x", "spaces or control characters"),
    ("http://127.0.0.1:8000/v1\r\nHost: evil", "spaces or control characters"),
    ("http://127.0.0.1:8000/v1?" + "a" * 100, "base address"),
    ("http://127.0.0.1:8000/" + "v" * 10_000_000, "characters long"),
    ("gopher://" + "h" * 5000, "at most"),
])
def test_a_bad_address_gets_our_one_line_message(url, message):
    with pytest.raises(ValueError, match=message) as caught:
        rw.OpenAIBackend(url, "m")
    text = str(caught.value)
    assert len(text) < 400 and "\n" not in text, text
    for python_words in ("Port out of range", "could not be cast", "Invalid IPv6", "InvalidURL"):
        assert python_words not in text


def test_a_good_reply_still_passes_through_the_new_client():
    import json

    caption = json.dumps(valid_caption(5.0))
    with FakeChatServer([reply("A boat drifts."), reply(caption)]) as server:
        result = rw.rewrite(REQUEST, _backend(server.url), cache=None)
    assert result.document == valid_caption(5.0) and server.requests[0]["path"] == "/v1/chat/completions"
    with FakeChatServer([reply("A boat drifts."), reply(caption)]) as server:  # a path with an encoded space
        rw.rewrite(REQUEST, _backend(server.url.replace("/v1", "/v%201")), cache=None)
    assert server.requests[0]["path"] == "/v%201/chat/completions"


# -- issue 37 item 4: the seed at temperature 0 --------------------------------------------------------

def test_greedy_rewrites_share_a_cache_entry_whatever_the_seed():
    backend = rw.OpenAIBackend("http://127.0.0.1:9/v1", "base", "json")
    key = rw.ResultCache.key
    assert key(REQUEST, backend, rw.Sampling(0.0, seed=1)) == key(REQUEST, backend, rw.Sampling(0.0, seed=2))
    assert key(REQUEST, backend, rw.Sampling(0.0, top_p=0.5)) == key(REQUEST, backend, rw.Sampling())
    assert key(REQUEST, backend, rw.Sampling(0.7, seed=1)) != key(REQUEST, backend, rw.Sampling(0.7, seed=2))


def test_the_rewrite_seed_is_fixed_by_default_and_saved_workflows_load_as_before():
    from lingbot_core.workflow.nodeinfo import NodeClassInfo
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    seed = NodeClassInfo("LingBotRewrite", NODE_CLASS_MAPPINGS["LingBotRewrite"]).declared("seed")
    assert seed.options["control_after_generate"] == "fixed"  # the frontend's default for the control widget
    assert seed.has_control_widget  # still a control widget: saved widgets_values keep their positions
    denoise = NodeClassInfo("LingBotDenoise", NODE_CLASS_MAPPINGS["LingBotDenoise"]).declared("seed")
    assert denoise.options["control_after_generate"] is True  # a sampler's seed stays the frontend's default


def test_a_saved_rewrite_with_randomize_converts_as_before():
    import json

    from lingbot_core.workflow.convert import ui_to_api
    from lingbot_nodes import NODE_CLASS_MAPPINGS
    from workflows import build

    ui = json.loads(build.ui_path("lingbot_t2v_dense_rewrite").read_text())
    fixed = ui_to_api(ui, NODE_CLASS_MAPPINGS)
    for node in ui["nodes"]:
        if node["type"] == "LingBotRewrite":
            values = node["widgets_values"]
            values[values.index("fixed")] = "randomize"
    assert ui_to_api(ui, NODE_CLASS_MAPPINGS) == fixed
