"""Prompt rewriter: the JSON scanner, the caption check, the OpenAI-compatible backend against a
loopback server (parsing, repair, retries, errors, redirects, keys), the cache, and the local
backend on the tiny checkpoint (plumbing only: its weights are random)."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from rewrite_fakes import FakeChatServer, ScriptedHead, reply, valid_caption

from lingbot_core import rewrite as rw
from lingbot_core.caption_schema import CAMERA_FIELDS, caption_problems
from lingbot_core.handle import PipelineHandle
from lingbot_core.interrupt import interrupt_checker
from lingbot_core.placement import door, plan
from lingbot_core.placement.door import configure_offload, release
from lingbot_core.placement.modes import MODE_ORDER

MODES = list(MODE_ORDER)  # every registered offload mode
OPTS = {"group": {"use_stream": False}}
GREEDY = rw.Sampling()


# -- scanner and schema ------------------------------------------------------------------------------

def test_scanner_closes_on_the_first_object_whatever_the_pieces():
    text = 'Sure! {"a": "x}{\\"y", "b": {"c": [1, "}"]}} and then {"second": 1}'
    for size in (1, 2, 5, len(text)):
        scanner = rw.ObjectScanner()
        closed_at = next(i for i in range(0, len(text), size) if scanner.feed(text[i:i + size]))
        assert json.loads(scanner.object_text()) == {"a": 'x}{"y', "b": {"c": [1, "}"]}}
        assert closed_at <= text.index("and then")
    open_scanner = rw.ObjectScanner()
    assert not open_scanner.feed('{"a": "}') and open_scanner.object_text() is None


def test_extract_object_reads_fenced_json_and_says_why_not():
    value, why = rw.extract_object('```json\n{"k": [1, 2]}\n```\nHope this helps.')
    assert value == {"k": [1, 2]} and why is None
    assert "no JSON object" in rw.extract_object("no braces here")[1]
    assert "never closes" in rw.extract_object('{"k": [1, 2')[1]
    assert "does not parse" in rw.extract_object("{'single': 'quotes'}")[1]


def test_caption_check_accepts_a_valid_caption_and_names_each_problem():
    assert caption_problems(valid_caption(5.0), 5.0) == []
    assert caption_problems(valid_caption(0, video=False), None) == []
    bad = valid_caption(5.0)
    bad["caption"]["camera_info"]["lighting"] = "Disco"
    del bad["caption"]["comprehensive_description"]["camera_movement_description"]
    bad["caption"]["prominent_elements"][0]["actions"][0]["timestamp"] = "0-2.5"
    problems = caption_problems(bad, 5.0)
    assert len(problems) == 3
    assert any("camera_info.lighting" in p and CAMERA_FIELDS["lighting"][0] in p for p in problems)
    assert any("camera_movement_description" in p for p in problems)
    assert any("'0-2.5'" in p for p in problems)
    short = valid_caption(4.0)
    assert any("must end exactly at the duration" in p for p in caption_problems(short, 5.0))
    late = valid_caption(6.0)
    assert any("after the 5s duration" in p for p in caption_problems(late, 5.0))


def test_the_caption_node_builds_what_the_check_accepts():
    from lingbot_nodes.caption import EXAMPLE_ELEMENTS, LingBotCaption

    out = LingBotCaption.execute("A canal at dawn.", "Static.", *[v[0] for v in CAMERA_FIELDS.values()],
                                 EXAMPLE_ELEMENTS, 5.0, 24)
    assert caption_problems(json.loads(out.args[0]), 5.0) == []


# -- the OpenAI-compatible backend -------------------------------------------------------------------

def _backend(server, **kw):
    kw.setdefault("retries", 2)
    kw.setdefault("backoff", 0.01)
    kw.setdefault("timeout", 5)
    return rw.OpenAIBackend(server.url, "base-model", kw.pop("map_model", "json-lora"), **kw)


REQUEST = rw.RewriteRequest("a red paper boat on a canal at dawn", "t2v", 5.0)


def test_two_stages_per_stage_models_and_chatter_around_the_json(monkeypatch):
    monkeypatch.setenv(rw.API_KEY_ENV, "sk-test")
    document = valid_caption(5.0)
    with FakeChatServer([reply("A red paper boat drifts..."),
                         reply("Here it is:\n```json\n" + json.dumps(document) + "\n```\nDone.")]) as server:
        result = rw.rewrite(REQUEST, _backend(server), cache=None)
    assert json.loads(result.caption) == document and result.expanded == "A red paper boat drifts..."
    assert not result.repaired
    first, second = server.requests
    assert first["path"] == second["path"] == "/v1/chat/completions"
    assert (first["body"]["model"], second["body"]["model"]) == ("base-model", "json-lora")
    assert first["headers"]["Authorization"] == "Bearer sk-test"
    assert first["body"]["temperature"] == 0 and first["body"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert "A red paper boat drifts" in second["body"]["messages"][1]["content"]


@pytest.mark.parametrize("broken", ['{"caption": {"comprehensive_description": ', "I cannot do JSON, sorry."])
def test_broken_json_gets_one_repair_pass(broken):
    with FakeChatServer([reply("detail"), reply(broken), reply(json.dumps(valid_caption(5.0)))]) as server:
        result = rw.rewrite(REQUEST, _backend(server), cache=None)
    assert result.repaired and json.loads(result.caption) == valid_caption(5.0)
    repair = server.requests[2]["body"]["messages"][1]["content"]
    assert broken.strip() in repair and ("never closes" in repair or "no JSON object" in repair)


def test_missing_fields_twice_is_a_clear_error_showing_what_was_produced():
    partial = valid_caption(5.0)
    del partial["caption"]["camera_info"]
    text = json.dumps(partial)
    with FakeChatServer([reply("detail"), reply(text), reply(text)]) as server:
        with pytest.raises(rw.RewriteError) as caught:
            rw.rewrite(REQUEST, _backend(server), cache=None)
    assert len(server.requests) == 3
    assert "'camera_info' is missing" in str(caught.value) and "paper boat" in str(caught.value)
    assert caught.value.produced == text and caught.value.problems
    # The problems reached the repair request.
    assert "'camera_info' is missing" in server.requests[2]["body"]["messages"][1]["content"]


def test_http_500_is_retried_then_named_with_the_endpoint():
    with FakeChatServer([("status", 500), reply("detail"), reply(json.dumps(valid_caption(5.0)))]) as server:
        assert rw.rewrite(REQUEST, _backend(server), cache=None).caption
    assert len(server.requests) == 3
    with FakeChatServer([("status", 500)] * 3) as server:
        with pytest.raises(rw.EndpointError) as caught:
            rw.rewrite(REQUEST, _backend(server), cache=None)
    assert len(server.requests) == 3
    assert server.url + "/chat/completions" in str(caught.value) and "HTTP 500" in str(caught.value)


def test_a_client_error_is_not_retried():
    with FakeChatServer([("status", 404)]) as server:
        with pytest.raises(rw.EndpointError, match="HTTP 404"):
            rw.rewrite(REQUEST, _backend(server), cache=None)
    assert len(server.requests) == 1


def test_a_slow_endpoint_times_out_and_says_so():
    with FakeChatServer([("sleep", 1.0, reply("late"))] * 2) as server:
        with pytest.raises(rw.EndpointError, match=r"after 2 attempt\(s\): no complete reply within 0.3 s"):
            rw.rewrite(REQUEST, _backend(server, timeout=0.3, retries=1), cache=None)
    # (not the server's count: the 0.3 s include connecting and sending, so on a busy machine an attempt
    # may end before the server has read it)


def test_an_attempt_whose_socket_times_out_first_reads_as_the_time_limit(monkeypatch):
    """The request's socket has the same limit as the attempt: on a busy machine its timeout can end the attempt
    a moment before the attempt's own clock does. The user reads the same cause either way (not 'connection
    failed (timed out)')."""
    from lingbot_core.rewrite import openai_backend

    def socket_timed_out(attempt, *args):
        attempt.outcome = TimeoutError("timed out")
        attempt.done.set()

    monkeypatch.setattr(openai_backend, "_send", socket_timed_out)
    with FakeChatServer([reply("unused")]) as server:
        with pytest.raises(rw.EndpointError, match=r"after 2 attempt\(s\): no complete reply within 0.3 s"):
            rw.rewrite(REQUEST, _backend(server, timeout=0.3, retries=1), cache=None)


def test_a_redirect_is_refused():
    with FakeChatServer([("redirect", "http://10.0.0.1/v1/chat/completions")]) as server:
        with pytest.raises(rw.EndpointError, match="redirect"):
            rw.rewrite(REQUEST, _backend(server), cache=None)
    assert len(server.requests) == 1


def test_a_reply_that_is_not_chat_json_is_named():
    with FakeChatServer([("raw", b"<html>"), ]) as server:
        with pytest.raises(rw.EndpointError, match="did not answer with JSON"):
            rw.rewrite(REQUEST, _backend(server), cache=None)
    with FakeChatServer([{"error": "no model"}]) as server:
        with pytest.raises(rw.EndpointError, match=r"choices\[0\]"):
            rw.rewrite(REQUEST, _backend(server), cache=None)


def test_the_cache_answers_the_same_request_and_keys_on_what_changes_the_caption():
    cache = rw.ResultCache(size=4)
    script = [reply("detail"), reply(json.dumps(valid_caption(5.0)))]
    with FakeChatServer(script * 3) as server:
        first = rw.rewrite(REQUEST, _backend(server), cache=cache)
        again = rw.rewrite(REQUEST, _backend(server), cache=cache)
        assert again.cached and again.caption == first.caption and len(server.requests) == 2
        rw.rewrite(REQUEST, _backend(server, map_model="other-lora"), cache=cache)  # another model: asked again
        assert len(server.requests) == 4
        image = torch.zeros(1, 32, 32, 3)
        ti2v = rw.RewriteRequest(REQUEST.prompt, "ti2v", 5.0, image)
        rw.rewrite(ti2v, _backend(server), cache=cache)
        assert len(server.requests) == 6
        assert server.requests[4]["body"]["messages"][1]["content"][0]["type"] == "image_url"
        # Same pixels: cached; other pixels: a new key.
        assert rw.rewrite(rw.RewriteRequest(REQUEST.prompt, "ti2v", 5.0, image.clone()), _backend(server),
                          cache=cache).cached
        other = rw.ResultCache.key(rw.RewriteRequest(REQUEST.prompt, "ti2v", 5.0, image + 0.5), _backend(server),
                                   rw.Sampling())
        assert other != rw.ResultCache.key(ti2v, _backend(server), rw.Sampling())


def test_the_cache_key_changes_with_prompt_duration_task_backend_and_model():
    from types import SimpleNamespace

    def key(request=REQUEST, backend=None, sampling=GREEDY):
        return rw.ResultCache.key(request, backend or rw.OpenAIBackend("http://127.0.0.1:9/v1", "base", "json"),
                                  sampling)

    same = key(rw.RewriteRequest(REQUEST.prompt, "t2v", 5.0))
    assert same == key()
    local = SimpleNamespace(folder="/models/a", view_states=())
    others = [key(rw.RewriteRequest(REQUEST.prompt + ".", "t2v", 5.0)),  # prompt
              key(rw.RewriteRequest(REQUEST.prompt, "t2v", 4.5)),  # duration
              key(rw.RewriteRequest(REQUEST.prompt, "t2i", 5.0)),  # task
              key(backend=rw.OpenAIBackend("http://127.0.0.1:9/v1", "other", "json")),  # expand model
              key(backend=rw.OpenAIBackend("http://127.0.0.1:8/v1", "base", "json")),  # endpoint
              key(backend=rw.LocalBackend(local)),  # backend
              key(backend=rw.LocalBackend(SimpleNamespace(folder="/models/b", view_states=()))),  # checkpoint
              key(backend=rw.LocalBackend(local, max_new_tokens=64)),  # token limit
              key(sampling=rw.Sampling(temperature=0.7, seed=1)), key(sampling=rw.Sampling(temperature=0.7, seed=2))]
    assert len({same, *others}) == len(others) + 1


def test_bad_requests_are_refused_before_any_call():
    with pytest.raises(ValueError, match="needs a prompt"):
        rw.RewriteRequest("  ").checked()
    with pytest.raises(ValueError, match="ti2v needs the first frame"):
        rw.RewriteRequest("x", "ti2v").checked()
    with pytest.raises(ValueError, match="task must be one of"):
        rw.RewriteRequest("x", "i2i").checked()
    with pytest.raises(ValueError, match="user name or password"):
        rw.OpenAIBackend("http://me:pw@127.0.0.1:1/v1", "m")
    with pytest.raises(ValueError, match="http"):
        rw.OpenAIBackend("file:///etc/passwd", "m")
    assert rw.duration_for(121, 24) == 5.0


def test_endpoint_allowlist_matching():
    allowed = rw.allowed_endpoints({rw.ENDPOINTS_ENV: " http://127.0.0.1:8000/v1 , https://llm.example.org "})
    assert allowed == ["http://127.0.0.1:8000/v1", "https://llm.example.org:443"]
    assert rw.endpoint_allowed("http://127.0.0.1:8000/v1/", allowed)
    assert rw.endpoint_allowed("http://127.0.0.1:8000/v1/chat/completions", allowed)
    assert rw.endpoint_allowed("https://LLM.example.org/v1", allowed)
    for refused in ("http://127.0.0.1:8001/v1", "http://127.0.0.1:8000/v10", "http://llm.example.org/v1",
                    "https://llm.example.org.evil.com/v1", "http://169.254.169.254/latest"):
        assert not rw.endpoint_allowed(refused, allowed), refused
    assert rw.allowed_endpoints({}) == []


# -- the local backend on the tiny checkpoint ----------------------------------------------------------

@pytest.fixture
def dense(fixtures_root):
    return PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")


@pytest.mark.parametrize("mode", MODES)
def test_local_generation_runs_under_every_offload_mode(dense, mode):
    handle = configure_offload(dense, mode, **OPTS.get(mode, {}))
    seen = []
    result = rw.generate_text(handle, "system", "user", max_new_tokens=6,
                              on_token=lambda stage, n, limit: seen.append((stage, n, limit)))
    assert result.tokens == 6 and result.stopped == "limit"
    assert seen[-1] == ("expand", 6, 6)
    again = rw.generate_text(handle, "system", "user", max_new_tokens=6)
    assert again.text == result.text  # greedy: the same tokens
    assert not any(p.device.type == "meta" and mode != "sequential" for p in
                   handle.shared.loaded["text_encoder"].parameters())


def test_local_generation_stops_when_the_first_object_closes(dense):
    encoder, tokenizer = dense.component("text_encoder"), dense.component("processor").tokenizer
    head = ScriptedHead(encoder, tokenizer, ['{"a": "}{", "b": {"c": 1}} trailing words that never come'])
    try:
        result = rw.generate_text(dense, "s", "u", max_new_tokens=60, stop_at_object=True)
        assert result.stopped == "object" and json.loads(result.text) == {"a": "}{", "b": {"c": 1}}
        plain = rw.generate_text(dense, "s", "u", max_new_tokens=60, stop_at_object=False)
        assert plain.stopped == "eos" and plain.text.endswith("never come") and plain.tokens > result.tokens
    finally:
        head.remove()


def test_local_rewrite_end_to_end_with_cache_and_release(dense):
    encoder, tokenizer = dense.component("text_encoder"), dense.component("processor").tokenizer
    still = valid_caption(0, video=False)  # the shortest valid caption: fewer tokens to force
    head = ScriptedHead(encoder, tokenizer, ["A red paper boat on a canal.", json.dumps(still)])
    cache = rw.ResultCache()
    request = rw.RewriteRequest(REQUEST.prompt, "t2i")
    try:
        backend = rw.LocalBackend(dense)
        result = rw.rewrite(request, backend, cache=cache)
        assert json.loads(result.caption) == still and result.expanded.startswith("A red paper boat")
        assert head.prefills == 2
        assert rw.rewrite(request, rw.LocalBackend(dense), cache=cache).cached and head.prefills == 2
        # Another token limit is another key; at 40 tokens the caption is cut off: the limit holds.
        limited = rw.LocalBackend(dense, max_new_tokens=40)
        with pytest.raises(rw.RewriteError, match="never closes"):
            rw.rewrite(request, limited, cache=cache)
        assert limited.last.tokens == 40 and limited.last.stopped == "limit" and head.prefills == 5
    finally:
        head.remove()
    ref = weakref.ref(dense.shared.loaded["text_encoder"])
    del encoder, head, backend, limited
    assert "text_encoder" in release(dense, ["text_encoder"])
    gc.collect()
    assert ref() is None
    assert rw.generate_text(dense, "s", "u", max_new_tokens=2).tokens == 2  # reloads on demand


def test_the_built_in_tiny_model_is_refused_before_the_first_token(monkeypatch):
    """The shipped rewrite workflows on the built-in tiny checkpoint: one clear line at once, not minutes of
    random tokens and then a failed caption."""
    from lingbot_core.tiny import ensure_tiny_checkpoint

    built_in = PipelineHandle.open(ensure_tiny_checkpoint("dense"), device="cpu")
    monkeypatch.setattr(rw.local_backend, "generate_text",
                        lambda *a, **k: pytest.fail("generated on the tiny model"))
    with pytest.raises(rw.CannotWrite, match="tiny checkpoint has random weights.*type the caption"):
        rw.rewrite(REQUEST, rw.LocalBackend(built_in), cache=None)
    assert "text_encoder" not in built_in.shared.loaded  # refused before the text encoder loaded


def test_random_weights_fail_with_the_clear_error(dense):
    # Random weights write no caption: whichever way it fails, it is the rewriter's clear error.
    with pytest.raises(rw.RewriteError, match="empty expansion|did not produce a valid caption after one repair"):
        rw.rewrite(REQUEST, rw.LocalBackend(dense, max_new_tokens=8), cache=None)


def test_sampling_is_seeded_and_leaves_the_global_generator_alone(dense):
    def sample(seed: int, temperature: float = 1.0) -> str:
        return rw.generate_text(dense, "s", "u", max_new_tokens=6,
                                sampling=rw.Sampling(temperature=temperature, seed=seed)).text

    state = torch.random.get_rng_state()
    first = sample(1)
    assert torch.equal(torch.random.get_rng_state(), state)  # the run's own generator, forked
    assert sample(1) == first and sample(2) != first
    assert sample(1, 0.0) == sample(2, 0.0)  # greedy: the seed does not matter


@pytest.mark.parametrize("mode", ["none", "group"])
def test_cancel_mid_generation_leaves_the_handle_usable(dense, mode):
    dense = configure_offload(dense, mode, **OPTS.get(mode, {}))
    expected = rw.generate_text(dense, "s", "u", max_new_tokens=5).text
    calls = []

    def cancel_after_three_tokens():
        calls.append(1)
        if len(calls) > 12:
            raise KeyboardInterrupt("cancelled")

    with pytest.raises(KeyboardInterrupt):
        with interrupt_checker(cancel_after_three_tokens):
            rw.generate_text(dense, "s", "u", max_new_tokens=50)
    assert len(calls) < 50
    assert type(dense.component("text_encoder").lm_head).__name__ != "_FollowingHead"
    assert door.resident_components(dense) <= door.allowed_resident(dense)  # back to the mode's clean state
    assert rw.generate_text(dense, "s", "u", max_new_tokens=5).text == expected


# -- headless: lingbot-run --rewrite ---------------------------------------------------------------------

def test_lingbot_run_rewrite_inserts_the_node_and_prints_the_caption(tmp_path, capsys, monkeypatch):
    from lingbot_nodes.cli import main

    monkeypatch.delenv(rw.ENDPOINTS_ENV, raising=False)  # headless: the command line is the operator
    document = valid_caption(0.5)
    with FakeChatServer([reply("A red paper boat drifts."), reply(json.dumps(document))]) as server:
        code = main(["t2v", "--output", str(tmp_path), "-q", "--rewrite", "a red paper boat on a canal at dawn",
                     "--rewrite-endpoint", server.url, "--rewrite-model", "base", "--rewrite-map-model", "json"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert json.dumps(document, ensure_ascii=False, separators=(",", ":")) in err  # the caption it used
    assert server.requests[0]["body"]["messages"][1]["content"].startswith("Request: a red paper boat")
    assert list(tmp_path.rglob("*.mp4"))


def test_rewrite_insertion_wires_pipe_task_duration_and_the_first_frame():
    from lingbot_core.workflow import load_workflow
    from lingbot_nodes import NODE_CLASS_MAPPINGS
    from lingbot_nodes.cli import insert_rewrite, resolve_workflow

    prompt = insert_rewrite(load_workflow(resolve_workflow("ti2v"), NODE_CLASS_MAPPINGS), "a teapot steams")
    encode = next(n for n in prompt.nodes.values() if n["class_type"] == "LingBotTextEncode")
    rewrite = prompt.nodes[encode["inputs"]["prompt"][0]]
    assert rewrite["class_type"] == "LingBotRewrite" and rewrite["inputs"]["task"] == "ti2v"
    assert rewrite["inputs"]["pipe"] == encode["inputs"]["pipe"]
    image_encode = prompt.nodes[encode["inputs"]["image_cond"][0]]
    assert rewrite["inputs"]["image"] == image_encode["inputs"]["image"]
    frames = next(n for n in prompt.nodes.values() if n["class_type"] == "LingBotDenoise")["inputs"]["frames"]
    assert rewrite["inputs"]["duration"] == max(0.5, rw.duration_for(frames, 24))


def test_rewrite_given_to_a_shipped_rewrite_workflow_fills_its_rewrite_node():
    from lingbot_core.workflow import load_workflow
    from lingbot_nodes import NODE_CLASS_MAPPINGS
    from lingbot_nodes.cli import insert_rewrite, resolve_workflow

    prompt = load_workflow(resolve_workflow("t2v-rewrite"), NODE_CLASS_MAPPINGS)
    before = set(prompt.nodes)
    prompt = insert_rewrite(prompt, "a teapot steams", endpoint="http://127.0.0.1:9/v1", duration=3.0)
    assert set(prompt.nodes) == before  # no second Rewrite node
    encode = next(n for n in prompt.nodes.values() if n["class_type"] == "LingBotTextEncode")
    rewrite = prompt.nodes[encode["inputs"]["prompt"][0]]
    assert rewrite["class_type"] == "LingBotRewrite" and rewrite["inputs"]["prompt"] == "a teapot steams"
    assert rewrite["inputs"]["endpoint"] == "http://127.0.0.1:9/v1" and rewrite["inputs"]["duration"] == 3.0
    assert rewrite["inputs"]["expand_model"] == ""  # not given: as saved


# -- auto negative ------------------------------------------------------------------------------------------

def test_auto_negative_only_deletes_listed_items():
    from lingbot_core.prompt import DEFAULT_NEGATIVE_PROMPT

    answer = reply(json.dumps({"remove": ["cartoon", "illustration", "a new item", 3]}))
    with FakeChatServer([answer, reply("no json here"), reply('{"remove": []}')]) as server:
        pruned, removed = rw.prune_negative("a cartoon of a paper boat", _backend(server))
        assert removed == ["illustration", "cartoon"] and server.requests[0]["body"]["model"] == "base-model"
        before, after = json.loads(DEFAULT_NEGATIVE_PROMPT), json.loads(pruned)
        for key, values in before["universal_negative"].items():
            assert after["universal_negative"][key] == [v for v in values if v not in removed]
        assert "a new item" not in pruned
        # Unreadable or empty: the default, byte for byte.
        assert rw.prune_negative("x", _backend(server)) == (DEFAULT_NEGATIVE_PROMPT, [])
        assert rw.prune_negative("x", _backend(server)) == (DEFAULT_NEGATIVE_PROMPT, [])


# -- memory: the estimate, the fit check and the report count the generation ------------------------------

def test_the_estimate_counts_the_generation_at_the_text_encoders_shape(dense):
    """The KV cache per token the estimate uses is what a generation really holds, and every mode's
    peak grows with the Rewrite's max_new_tokens (tiny sizes: the rewrite is the peak phase)."""
    from lingbot_core.placement import estimate, fit
    from lingbot_core.rewrite.local_backend import context_tokens
    from lingbot_nodes.rewrite import local_limits

    sizes = plan.model_sizes(dense.shared)
    encoder, processor = dense.component("text_encoder"), dense.component("processor")
    with torch.no_grad():
        out = encoder.generate(**processor(text=["a red paper boat"], return_tensors="pt"), max_new_tokens=4,
                               min_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    held = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    assert held == cache.get_seq_length() * sizes.text_kv_bytes_per_token > 0
    assert sizes.text_vocab == encoder.config.text_config.vocab_size

    tiny = estimate.Geometry(64, 64, 9)
    plain = {m: estimate.estimate_peak(m, sizes, tiny) for m in MODES}
    tokens = [context_tokens(local_limits(n)) for n in (64, 512, 2048)]
    peaks = [{m: estimate.estimate_peak(m, sizes, estimate.Geometry(64, 64, 9, rewrite_tokens=t)) for m in MODES}
             for t in tokens]
    for mode in MODES:
        figures = [plain[mode]] + [p[mode] for p in peaks]
        assert figures == sorted(set(figures)), (mode, figures)  # strictly growing
    grown = estimate.activation_bytes(sizes, estimate.Geometry(64, 64, 9, rewrite_tokens=tokens[2]))["rewrite"] - \
        estimate.activation_bytes(sizes, estimate.Geometry(64, 64, 9, rewrite_tokens=tokens[1]))["rewrite"]
    assert grown == (tokens[2] - tokens[1]) * (sizes.text_kv_bytes_per_token + estimate.TEXT_ACT_BYTES_PER_TOKEN)
    # the fit check sees it: a budget that fits the run without the rewrite does not fit it with one
    budget = plain["model"] + estimate.RESERVE_BYTES
    assert fit.check(sizes, tiny, "model", vram_free=budget, host_free=None).ok
    assert not fit.check(sizes, estimate.Geometry(64, 64, 9, rewrite_tokens=tokens[2]), "model", vram_free=budget,
                         host_free=None).ok


def test_offload_plans_for_a_local_rewrite_on_its_pipe():
    """The Offload node finds a Rewrite without an endpoint on its pipe in the graph it runs in, and
    plans its generation (auto's options carry it; the explicit modes' fit check gets it)."""
    from lingbot_core.rewrite.local_backend import context_tokens
    from lingbot_core.workflow import Engine, apply_overrides, load_workflow
    from lingbot_nodes import NODE_CLASS_MAPPINGS
    from lingbot_nodes.cli import resolve_workflow
    from lingbot_nodes.rewrite import local_limits, planned_rewrite_tokens

    prompt = load_workflow(resolve_workflow("t2v-rewrite"), NODE_CLASS_MAPPINGS)
    nodes = prompt.to_dict()
    offload = next(n for n, node in nodes.items() if node["class_type"] == "LingBotOffload")
    rewrite = next(n for n, node in nodes.items() if node["class_type"] == "LingBotRewrite")
    assert planned_rewrite_tokens(nodes, offload) == context_tokens(local_limits(2048))
    nodes[rewrite]["inputs"]["max_new_tokens"] = 256
    assert planned_rewrite_tokens(nodes, offload) == context_tokens(local_limits(256))
    nodes[rewrite]["inputs"]["endpoint"] = "http://127.0.0.1:8000/v1"
    assert planned_rewrite_tokens(nodes, offload) == 0  # a server writes it
    plain = load_workflow(resolve_workflow("t2v"), NODE_CLASS_MAPPINGS).to_dict()
    assert planned_rewrite_tokens(plain, next(n for n, v in plain.items() if v["class_type"] == "LingBotOffload")) == 0

    auto = apply_overrides(prompt, [f"{offload}.mode=auto"], NODE_CLASS_MAPPINGS)
    view = Engine(NODE_CLASS_MAPPINGS).run(auto, outputs=[offload]).output(offload)
    assert view.offload.option("rewrite_tokens") == context_tokens(local_limits(2048))


def test_the_memory_report_counts_the_last_generation(dense):
    from lingbot_core.placement.door import memory_report, release

    assert "generation" not in str(memory_report(dense))
    made = rw.generate_text(dense, "system", "user", max_new_tokens=3)
    report = memory_report(dense)
    tokens, parts = report.generation
    assert made.tokens == 3 and tokens > made.tokens  # the context: the prompt's tokens and the new ones
    assert parts["kv_cache"] == tokens * plan.model_sizes(dense.shared).text_kv_bytes_per_token
    assert f"text_encoder generation (last rewrite): {tokens} tokens" in str(report)
    release(dense, ["text_encoder"])  # recorded when it ran: the report keeps it once the encoder is gone
    assert memory_report(dense).generation == (tokens, parts)
