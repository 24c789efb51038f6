"""LingBot Rewrite: prose in, the structured caption LingBot-Video was trained on out.

The model is the checkpoint's own text encoder (connect a pipe) or an OpenAI-compatible endpoint.
Inside ComfyUI a workflow may only name an endpoint the person running the server listed in
``LINGBOT_REWRITE_ENDPOINTS`` (comma-separated; empty: none), and the API key comes from
``LINGBOT_REWRITE_API_KEY`` only, so a shared server cannot be made to call other addresses or
leak a key. Headless, the person running the command is the operator: any endpoint given works.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import runtime
from .notices import on_node
from .types import CATEGORY, Choice, Pipe
from .v3 import io

TASKS = ("t2v", "ti2v", "t2i")


def check_endpoint(endpoint: str) -> str:
    """The normalised endpoint, refused inside ComfyUI unless the operator listed it."""
    from lingbot_core import rewrite as rw

    normalized = rw.normalize_endpoint(endpoint)
    if runtime.in_comfy():
        allowed = rw.allowed_endpoints()
        if not rw.endpoint_allowed(normalized, allowed):
            # the list is the operator's: it goes to the server log, never to whoever queued the workflow
            import logging

            logging.getLogger("lingbot_nodes").warning(
                "lingbot: refused rewrite endpoint %s; %s allows: %s", normalized, rw.ENDPOINTS_ENV,
                ", ".join(allowed) or "(nothing: it is unset or empty)")
            raise ValueError(
                f"the rewrite endpoint {normalized} is not allowed on this server. The person running ComfyUI "
                f"allows endpoints in the {rw.ENDPOINTS_ENV} environment variable (comma-separated base "
                "addresses such as http://127.0.0.1:8000/v1). Or leave endpoint empty and connect a pipe to "
                "rewrite with the checkpoint's own text encoder.")
    return normalized


MAX_NEW_TOKENS = 2048  # the node's default token limit of the caption stages


def local_limits(max_new_tokens: int) -> dict[str, int]:
    """The node's token limits for the local backend (the expand stage keeps its default)."""
    return {"map": int(max_new_tokens), "repair": int(max_new_tokens)}


def planned_rewrite_tokens(prompt: Any, pipe_source: Any) -> int:
    """The longest context a local rewrite of ``prompt`` (ComfyUI's API-format graph) holds on the
    pipe that node ``pipe_source`` outputs (through LoRA or other pipe nodes), for the memory
    estimate; 0 when no Rewrite on that pipe uses the text encoder (an endpoint given)."""
    from lingbot_core.rewrite.local_backend import context_tokens

    if not isinstance(prompt, dict) or pipe_source is None:
        return 0
    source, longest = str(pipe_source), 0
    for node in prompt.values():
        if not isinstance(node, dict) or node.get("class_type") != "LingBotRewrite":
            continue
        inputs = node.get("inputs") or {}
        endpoint = inputs.get("endpoint", "")
        if isinstance(endpoint, str) and endpoint.strip():
            continue  # an OpenAI-compatible server writes it
        link, seen = inputs.get("pipe"), 0
        while isinstance(link, list) and link and str(link[0]) != source and seen <= len(prompt):
            upstream = prompt.get(str(link[0]))
            link = (upstream.get("inputs") or {}).get("pipe") if isinstance(upstream, dict) else None
            seen += 1
        if isinstance(link, list) and link and str(link[0]) == source:
            limit = inputs.get("max_new_tokens", MAX_NEW_TOKENS)
            limit = limit if isinstance(limit, int) and not isinstance(limit, bool) else MAX_NEW_TOKENS
            longest = max(longest, context_tokens(local_limits(limit)))
    return longest


PROGRESS_UPDATES = 50  # at most about this many progress updates per generation stage


def token_progress(update: Callable[[int, int], None], most: int = PROGRESS_UPDATES) -> Callable[[str, int, int], None]:
    """The rewriter's per-token callback, passing on at most ~`most` updates per stage (its first
    token, every limit/`most` tokens, its last): a headless log gets a few lines per stage, not one
    line per generated token."""
    last: dict[str, int] = {}

    def on_token(stage: str, tokens: int, limit: int) -> None:
        every = max(1, limit // most)
        shown = last.get(stage)
        if shown is None or tokens >= limit or tokens // every != shown // every:
            last[stage] = tokens
            update(min(tokens, limit), limit)

    return on_token


def make_backend(pipe, endpoint: str, expand_model: str, map_model: str, max_new_tokens: int):
    from lingbot_core import rewrite as rw

    if endpoint.strip():
        return rw.OpenAIBackend(check_endpoint(endpoint), expand_model.strip(), map_model.strip(),
                                max_tokens=int(max_new_tokens))
    if pipe is None:
        raise ValueError("connect a pipe (the checkpoint's text encoder writes the caption) or give an endpoint")
    return rw.LocalBackend(pipe, max_new_tokens=local_limits(max_new_tokens))


class LingBotRewrite(io.ComfyNode):
    """Prose (and the first frame for TI2V) -> caption STRING for Text Encode, plus the expanded text."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LingBotRewrite",
            display_name="LingBot Rewrite",
            category=CATEGORY,
            description="Rewrites a plain prompt into the structured JSON caption LingBot-Video was trained on "
                        "(prose follows less well): first a detailed timed description, then the caption. Uses the "
                        "checkpoint's own text encoder (connect a pipe) or an OpenAI-compatible server (endpoint; "
                        "inside ComfyUI only those listed in LINGBOT_REWRITE_ENDPOINTS). Greedy: the same input "
                        "gives the same caption, and recent results are cached.",
            inputs=[
                io.String.Input("prompt", multiline=True, dynamic_prompts=False,
                                default="a red paper boat on a canal at dawn",
                                tooltip="What the clip or picture should show, in a sentence or two"),
                Choice("task", options=list(TASKS), default="t2v",
                       tooltip="t2v video, ti2v video from a first frame (connect image), t2i a still picture"),
                io.Float.Input("duration", default=5.0, min=0.5, max=60.0, step=0.5,
                               tooltip="Clip length in seconds (ignored for t2i); the caption's actions fill it"),
                Pipe.Input("pipe", optional=True, tooltip="From LingBot Loader or Offload: rewrite with its text "
                                                          "encoder (used when endpoint is empty)"),
                io.Image.Input("image", optional=True, tooltip="TI2V: the first frame the rewriter looks at"),
                io.String.Input("endpoint", default="", optional=True,
                                tooltip="Empty: the pipe's text encoder. Else an OpenAI-compatible base address "
                                        "(e.g. http://127.0.0.1:8000/v1); the API key comes from the server's "
                                        "LINGBOT_REWRITE_API_KEY environment variable"),
                io.String.Input("expand_model", default="", optional=True,
                                tooltip="Endpoint only: the model name for the expand stage"),
                io.String.Input("map_model", default="", optional=True,
                                tooltip="Endpoint only: the model for the JSON stage (e.g. a LoRA adapter's name); "
                                        "empty: expand_model"),
                io.Int.Input("max_new_tokens", default=MAX_NEW_TOKENS, min=64, max=8192, optional=True,
                             tooltip="Token limit of the caption stage"),
                io.Float.Input("temperature", default=0.0, min=0.0, max=2.0, step=0.05, optional=True,
                               tooltip="0: greedy (the same input gives the same caption); above 0 samples"),
                # "fixed" (not the frontend's "randomize"): at temperature 0 a new seed changes nothing but
                # would make every Run redo the rewrite and all after it; a saved workflow keeps its own value
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, optional=True, control_after_generate="fixed",
                             tooltip="Seed for sampling (temperature above 0; ignored at 0)"),
                io.Boolean.Input("auto_negative", default=False, optional=True,
                                 tooltip="Also prune the default negative prompt of what the request itself asks "
                                         "for (e.g. 'cartoon' for a cartoon); only deletes listed items"),
            ],
            outputs=[io.String.Output(display_name="caption", tooltip="The caption JSON, for LingBot Text Encode"),
                     io.String.Output(display_name="expanded", tooltip="The detailed description (stage 1)"),
                     io.String.Output(display_name="negative",
                                      tooltip="auto_negative on: the pruned default negative for Text Encode's "
                                              "negative_prompt; off: empty (Text Encode's default)")],
        )

    @classmethod
    def execute(cls, prompt, task="t2v", duration=5.0, pipe=None, image=None, endpoint="", expand_model="",
                map_model="", max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, seed=0, auto_negative=False):
        from lingbot_core import rewrite as rw

        request = rw.RewriteRequest(prompt, task, float(duration), image).checked()
        backend = make_backend(pipe, endpoint or "", expand_model or "", map_model or "", max_new_tokens)
        sampling = rw.Sampling(temperature=float(temperature), seed=int(seed))
        bar = runtime.Progress(int(max_new_tokens), "rewrite")
        on_token = token_progress(bar.update)

        try:
            with runtime.node_work(label="rewrite"):
                result = rw.rewrite(request, backend, sampling=sampling, on_token=on_token)
                negative, removed = "", []
                if auto_negative:
                    from lingbot_core.prompt import DEFAULT_NEGATIVE_PROMPT, DEFAULT_NEGATIVE_PROMPT_IMAGE

                    default = DEFAULT_NEGATIVE_PROMPT_IMAGE if task == "t2i" else DEFAULT_NEGATIVE_PROMPT
                    negative, removed = rw.prune_negative(prompt, backend, negative=default, sampling=sampling)
        finally:
            bar.close()
        shown = on_node("expanded: " + result.expanded, "caption: " + result.caption,
                        "(cached)" if result.cached else None,
                        ("negative: removed " + ", ".join(removed)) if removed else None)
        return io.NodeOutput(result.caption, result.expanded, negative, ui=shown)
