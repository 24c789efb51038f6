"""Running a workflow file with command-line style overrides (``NODE.INPUT=VALUE``).

The console command is a thin layer over :func:`run_workflow_file`; everything that can go wrong
with an override (syntax, an unknown or ambiguous node, an input the class does not declare) is
a :class:`WorkflowError` that says which part was wrong.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from .context import InterruptCheck, ProgressCallback
from .engine import Engine, RunResult
from .errors import WorkflowError
from .graph import ApiPrompt, Registry, load_workflow
from .nodeinfo import NodeClassInfo

# Valid for the default workflow and the other dense ones (a node titled "Denoise" with a `seed`
# input); tests/test_cli.py applies it to them.
OVERRIDE_EXAMPLE = "Denoise.seed=42"


def parse_override(text: str) -> tuple[str, str, Any, str]:
    """Split ``NODE.INPUT=VALUE`` into (node, input, parsed value, raw value text).

    VALUE is JSON when it parses (``42``, ``true``, ``"x"``, ``[1,2]``), else the text itself.
    NODE may contain dots (titles do); the input name is what follows the last dot.
    """
    target, sep, raw = text.partition("=")
    node, dot, input_name = target.rpartition(".")
    if not sep or not dot or not node.strip() or not input_name.strip():
        raise WorkflowError(f"bad override {text!r}: expected NODE.INPUT=VALUE, e.g. {OVERRIDE_EXAMPLE}")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, an over-long integer, or absurd nesting: the text
        value = raw
    return node.strip(), input_name.strip(), value, raw


def find_node(prompt: ApiPrompt, ref: str) -> str:
    """Resolve a node reference: an id, else a class type used once, else a unique ``_meta.title``."""
    if ref in prompt.nodes:
        return ref
    by_class = [nid for nid, n in prompt.nodes.items() if n.get("class_type") == ref]
    if len(by_class) == 1:
        return by_class[0]
    by_title = [nid for nid, n in prompt.nodes.items() if (n.get("_meta") or {}).get("title") == ref]
    if len(by_title) == 1:
        return by_title[0]
    if len(by_class) > 1 or len(by_title) > 1:
        ids = ", ".join(sorted(set(by_class + by_title)))
        raise WorkflowError(f"node '{ref}' is ambiguous: it matches nodes {ids}; use a node id")
    raise WorkflowError(f"no node '{ref}' in {prompt.source}; give a node id, a class type used once, or a title: "
                        f"{describe_nodes(prompt)}")


def describe_nodes(prompt: ApiPrompt) -> str:
    """Every node as ``id (class type 'title')``, the ways an override can name it."""
    parts = []
    for nid, node in prompt.nodes.items():
        title = (node.get("_meta") or {}).get("title")
        parts.append(f"{nid} ({node.get('class_type')}" + (f" '{title}')" if title else ")"))
    return ", ".join(parts)


def apply_overrides(prompt: ApiPrompt, overrides: Iterable[str], registry: Registry) -> ApiPrompt:
    """Return a copy of ``prompt`` with each override written into the node's inputs.

    Values are shaped by the input's declared type: a STRING input takes the raw text even when
    it looks like JSON (``text=123``), INT/FLOAT accept integral floats and ints, lists are
    wrapped as constants. An override may replace a link with a constant.
    """
    nodes = prompt.to_dict()
    result = ApiPrompt(nodes=nodes, source=prompt.source, format=prompt.format, ui=prompt.ui)
    for text in overrides:
        ref, input_name, value, raw = parse_override(text)
        node_id = find_node(result, ref)
        class_type = nodes[node_id]["class_type"]
        cls = registry.get(class_type)
        if cls is None:
            raise WorkflowError(f"override {text!r}: node {node_id} has unknown type '{class_type}'")
        info = NodeClassInfo(class_type, cls)
        spec = info.declared(input_name)
        if spec is None or spec.category == "hidden":
            names = ", ".join(s.name for s in info.visible_inputs()) or "none"
            raise WorkflowError(
                f"override {text!r}: node {node_id} ({class_type}) has no input '{input_name}' (inputs: {names})")
        nodes[node_id].setdefault("inputs", {})[input_name] = _shape(spec.type, value, raw)
    return result


def _shape(declared: Any, value: Any, raw: str) -> Any:
    if declared == "STRING" and not isinstance(value, str):
        return raw
    if declared == "FLOAT" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if declared == "INT" and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return {"__value__": value}
    return value


def run_workflow_file(
    path: str | os.PathLike[str],
    registry: Registry,
    *,
    overrides: Iterable[str] = (),
    engine: Engine | None = None,
    outputs: Iterable[str] | None = None,
    seed_order: int | None = None,
    progress: ProgressCallback | None = None,
    interrupt_check: InterruptCheck | None = None,
    display_names: Mapping[str, str] | None = None,
) -> RunResult:
    """Load a UI or API workflow file, apply overrides, and run it.

    Pass the same ``engine`` to successive calls to keep its cache (only changed nodes re-run).
    """
    prompt = load_workflow(path, registry, display_names=display_names)
    prompt = apply_overrides(prompt, overrides, registry)
    engine = engine if engine is not None else Engine(registry)
    output_ids = None if outputs is None else [find_node(prompt, str(o)) for o in outputs]
    return engine.run(prompt, outputs=output_ids, seed_order=seed_order, progress=progress,
                      interrupt_check=interrupt_check)
