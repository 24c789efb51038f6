"""The headless engine: validate, schedule, cache and run a prompt of ComfyUI node classes (V3 or V1).

Semantics follow ComfyUI (0.3.x) so that what passes here behaves the same inside ComfyUI:
execution is pulled from output nodes, only their ancestors run, results are cached by
signature between runs and reused without running, lazy inputs are evaluated only when
``check_lazy_status`` asks for them, and no order between independent branches is promised.
``seed_order`` makes that last point testable: it picks among ready nodes at random.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .cache import CacheEntry, SignatureBuilder, fresh_token, to_hashable
from .context import InterruptCheck, NodeContext, ProgressCallback, node_context
from .errors import (
    NodeExecutionError,
    RunInterrupted,
    ValidationIssue,
    WorkflowError,
    WorkflowValidationError,
    brief,
    is_interrupt,
)
from .graph import ApiPrompt, Registry, check_structure, class_infos, id_text, normalize_api, reading_guard
from .nodeinfo import NodeClassInfo, is_link, unwrap_constant
from .validate import hidden_value, validate_node

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What one run did and produced.

    ``executed``: node ids whose function ran, in execution order. ``cached``: needed nodes whose
    results came from the cache instead (ComfyUI's ``execution_cached``). ``outputs``: the output
    tuple of every node that has one after the run. ``ui``: the ``"ui"`` dicts of output nodes,
    cached ones included, as ComfyUI's history holds them.
    """

    executed: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)
    outputs: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    ui: dict[str, Any] = field(default_factory=dict)
    targets: list[str] = field(default_factory=list)

    def output(self, node_id: str, index: int = 0) -> Any:
        """One output value of a node, with a clear error when the node produced none."""
        node_id = str(node_id)
        if node_id not in self.outputs:
            raise KeyError(f"node {node_id} has no outputs in this run")
        return self.outputs[node_id][index]


@dataclass
class _Plan:
    """A validated prompt: normalised inputs, class declarations, targets and needed nodes."""

    prompt: dict[str, dict[str, Any]]
    infos: dict[str, NodeClassInfo]
    targets: list[str]
    needed: list[str]  # in prompt order
    extra_pnginfo: dict[str, Any] | None = None  # {"workflow": <UI json>} for files saved by the editor

    def info(self, node_id: str) -> NodeClassInfo:
        return self.infos[self.prompt[node_id]["class_type"]]


class _Pending(Exception):
    """Internal: the node asked for more lazy inputs and goes back to the queue."""


class Engine:
    """Runs prompts against a registry of node classes and keeps the cache between runs."""

    def __init__(self, registry: Registry) -> None:
        self.registry: Registry = registry
        self._store: dict[Hashable, CacheEntry] = {}
        self._objects: dict[tuple[str, str], Any] = {}

    # -- public -------------------------------------------------------------------------------------

    def validate(self, prompt: ApiPrompt | Mapping[str, Any], *, outputs: Iterable[str] | None = None) -> list[str]:
        """Check everything that can be checked without running; return the target node ids."""
        return self._plan(prompt, outputs).targets

    def run(
        self,
        prompt: ApiPrompt | Mapping[str, Any],
        *,
        outputs: Iterable[str] | None = None,
        seed_order: int | None = None,
        progress: ProgressCallback | None = None,
        interrupt_check: InterruptCheck | None = None,
    ) -> RunResult:
        """Validate the prompt, then run what the targets need that is not cached.

        ``outputs`` narrows the targets (default: every ``OUTPUT_NODE``). ``seed_order`` shuffles
        the choice among ready nodes. ``progress(node_id, value, total)`` receives what nodes
        report through :func:`report_progress`; ``interrupt_check()`` is polled before every node
        and at every progress report.
        """
        plan = self._plan(prompt, outputs)
        keys = self._signatures(plan)
        self._drop_unused(plan, keys)
        return _Run(self, plan, keys, seed_order, progress, interrupt_check).execute()

    # -- planning -----------------------------------------------------------------------------------

    def _plan(self, prompt: ApiPrompt | Mapping[str, Any], outputs: Iterable[str] | None) -> _Plan:
        source = prompt.source if isinstance(prompt, ApiPrompt) else "<dict>"
        with reading_guard(source):
            return self._plan_checked(prompt, outputs)

    def _plan_checked(self, prompt: ApiPrompt | Mapping[str, Any], outputs: Iterable[str] | None) -> _Plan:
        extra = None
        if isinstance(prompt, ApiPrompt):
            source, nodes = prompt.source, normalize_api(prompt.nodes, prompt.source)
            extra = {"workflow": prompt.ui} if prompt.ui is not None else None
        else:
            if not isinstance(prompt, Mapping):
                raise WorkflowError(f"a prompt must be a dict of nodes, got {type(prompt).__name__}")
            source, nodes = None, normalize_api(prompt)
        infos, issues = class_infos(nodes, self.registry)
        issues += check_structure(nodes, self.registry, infos)
        if issues:
            raise WorkflowValidationError(issues, source=source)

        if outputs is None:
            targets = [nid for nid, node in nodes.items() if infos[node["class_type"]].output_node]
            if not targets:
                raise WorkflowValidationError(
                    [ValidationIssue(None, None, None, "the workflow has no output nodes (OUTPUT_NODE); "
                                     "name the nodes to run with outputs=")], source=source)
        else:
            targets = [id_text(t) or brief(t, 40) for t in outputs]
            missing = [ValidationIssue(t, None, None, "requested as an output but no such node exists")
                       for t in targets if t not in nodes]
            if missing:
                raise WorkflowValidationError(missing, source=source)
            targets = list(dict.fromkeys(targets))

        needed_set = _ancestors(nodes, targets)
        needed = [nid for nid in nodes if nid in needed_set]
        issues += _cycle_issues(nodes, needed)
        for nid in needed:
            node = nodes[nid]
            info = infos[node["class_type"]]
            received = {name: infos[nodes[str(v[0])]["class_type"]].return_types[v[1]]
                        for name, v in node["inputs"].items() if is_link(v)}
            issues += validate_node(nid, node, info, nodes, received)
        if issues:
            raise WorkflowValidationError(issues, source=source)
        return _Plan(nodes, infos, targets, needed, extra)

    def _signatures(self, plan: _Plan) -> dict[str, Hashable]:
        """IS_CHANGED for every node of the prompt (as ComfyUI does), then all signatures."""
        is_changed = {nid: self._is_changed(plan, nid) for nid in plan.prompt}
        builder = SignatureBuilder(plan.prompt, plan.infos, is_changed)
        return {nid: builder.signature(nid) for nid in plan.prompt}

    def _is_changed(self, plan: _Plan, node_id: str) -> Any:
        info = plan.info(node_id)
        if info.fingerprint is None:
            return False
        kwargs: dict[str, Any] = {}
        for name, value in plan.prompt[node_id]["inputs"].items():
            if is_link(value):
                kwargs[name] = None  # only constants are known before running
            elif info.declared(name) is not None and info.declared(name).category != "hidden":
                kwargs[name] = unwrap_constant(value)
        as_kwargs, as_attrs = info.hidden_kwargs(_hidden_by_kind(info, node_id, plan))
        kwargs.update(as_kwargs)
        fn = info.bound(info.cls, as_attrs).fingerprint_inputs if info.v3 else info.fingerprint
        try:
            value = fn(**kwargs)
        except Exception as exc:  # ComfyUI turns this into NaN: always re-run, with a warning
            log.warning("IS_CHANGED of node %s (%s) raised %s: %s; the node will always re-run",
                        node_id, info.class_type, type(exc).__name__, exc)
            return fresh_token()
        return to_hashable(value)  # NaN, anywhere inside, becomes a never-matching token

    def _drop_unused(self, plan: _Plan, keys: Mapping[str, Hashable]) -> None:
        """Keep only results the new prompt can use, as ComfyUI's classic cache does."""
        live = set(keys.values())
        self._store = {k: v for k, v in self._store.items() if k in live}
        self._objects = {
            (nid, ct): obj for (nid, ct), obj in self._objects.items()
            if nid in plan.prompt and plan.prompt[nid]["class_type"] == ct
        }


class _Schedule:
    """The pending nodes and who blocks whom: a topological dissolve that can grow (lazy inputs)."""

    def __init__(self, plan: _Plan, is_cached: Callable[[str], bool]) -> None:
        self.plan = plan
        self.is_cached = is_cached
        self.pending: dict[str, None] = {}
        self.block_count: dict[str, int] = {}
        self.blocking: dict[str, dict[str, None]] = {}

    def add_node(self, node_id: str, include_lazy: bool = False) -> None:
        stack, links = [node_id], []
        while stack:
            current = stack.pop()
            if current in self.pending:
                continue
            self.pending[current] = None
            self.block_count[current] = 0
            self.blocking[current] = {}
            info = self.plan.info(current)
            for name, value in self.plan.prompt[current]["inputs"].items():
                if not is_link(value):
                    continue
                spec = info.declared(name)
                lazy = spec is not None and spec.lazy
                src = str(value[0])
                if (include_lazy or not lazy) and not self.is_cached(src):
                    stack.append(src)
                    links.append((src, current))
        for src, dst in links:
            self.add_strong_link(src, dst)

    def add_strong_link(self, src: str, dst: str) -> None:
        if self.is_cached(src):
            return
        self.add_node(src)
        if dst not in self.blocking[src]:
            self.blocking[src][dst] = None
            self.block_count[dst] += 1

    def ready(self) -> list[str]:
        return [nid for nid in self.pending if self.block_count[nid] == 0]

    def done(self, node_id: str) -> None:
        del self.pending[node_id]
        for blocked in self.blocking.pop(node_id):
            self.block_count[blocked] -= 1

    def pick(self, ready: list[str], rng: random.Random | None) -> str:
        if rng is not None:
            return rng.choice(ready)

        # ComfyUI's preference: outputs first, then what feeds an output, then two hops away.
        def is_output(nid: str) -> bool:
            return self.plan.info(nid).output_node

        for nid in ready:
            if is_output(nid):
                return nid
        for nid in ready:
            if any(is_output(b) for b in self.blocking[nid]):
                return nid
        for nid in ready:
            if any(is_output(b2) for b in self.blocking[nid] for b2 in self.blocking.get(b, {})):
                return nid
        return ready[0]


class _Run:
    """One execution of a validated plan against the engine's cache."""

    def __init__(self, engine: Engine, plan: _Plan, keys: Mapping[str, Hashable], seed_order: int | None,
                 progress: ProgressCallback | None, interrupt_check: InterruptCheck | None) -> None:
        self.engine = engine
        self.plan = plan
        self.keys = keys
        self.rng = random.Random(seed_order) if seed_order is not None else None
        self.progress = progress
        self.interrupt_check = interrupt_check
        self.executed: list[str] = []
        self.schedule = _Schedule(plan, self._is_cached)

    def _is_cached(self, node_id: str) -> bool:
        return self.keys[node_id] in self.engine._store

    def execute(self) -> RunResult:
        # ComfyUI executes a prompt under torch.inference_mode(); so does the headless engine, so a node
        # that works here works there (inference tensors have no version counter, refuse autograd ...).
        import torch

        with torch.inference_mode():
            return self._execute()

    def _execute(self) -> RunResult:
        store = self.engine._store
        cached = [nid for nid in self.plan.needed if self._is_cached(nid)]
        for target in self.plan.targets:
            self.schedule.add_node(target)
        while self.schedule.pending:
            ready = self.schedule.ready()
            if not ready:  # validation rejects cycles; this guards against a broken schedule
                raise WorkflowError(f"no node can run; dependency cycle among {sorted(self.schedule.pending)}")
            node_id = self.schedule.pick(ready, self.rng)
            if self._is_cached(node_id):
                if node_id not in cached:
                    cached.append(node_id)  # an identical node already ran in this run
                self.schedule.done(node_id)
                continue
            try:
                self._execute_node(node_id)
            except _Pending:
                continue
            self.executed.append(node_id)
            self.schedule.done(node_id)

        result = RunResult(executed=list(self.executed), cached=cached, targets=list(self.plan.targets))
        for nid in self.plan.needed:
            entry = store.get(self.keys[nid])
            if entry is None:
                continue
            result.outputs[nid] = entry.outputs
            if entry.ui:
                result.ui[nid] = entry.ui
        return result

    # -- one node -----------------------------------------------------------------------------------------

    def _execute_node(self, node_id: str) -> None:
        info = self.plan.info(node_id)
        class_type = info.class_type
        self._poll_interrupt(node_id, class_type)
        ctx = NodeContext(node_id, class_type, self.progress, self.interrupt_check)
        key = (node_id, class_type)
        obj = self.engine._objects.get(key)
        if obj is None:
            obj = self._call(node_id, class_type, "creating the node object", info.new_object)
            self.engine._objects[key] = obj
        kwargs, missing = self._gather_inputs(node_id, info)
        as_kwargs, as_attrs = info.hidden_kwargs(_hidden_by_kind(info, node_id, self.plan))
        kwargs.update(as_kwargs)
        obj = info.bound(obj, as_attrs)

        lazy_check = info.lazy_checker(obj)
        if lazy_check is not None:
            with node_context(ctx):
                requested = self._call(node_id, class_type, "check_lazy_status", lazy_check, **kwargs)
            wanted = [n for n in (requested or []) if isinstance(n, str) and (n not in kwargs or n in missing)]
            if wanted:
                for name in dict.fromkeys(wanted):
                    value = self.plan.prompt[node_id]["inputs"].get(name)
                    if not is_link(value):
                        raise NodeExecutionError(
                            node_id, class_type,
                            f"check_lazy_status asked for input '{name}', which is not connected",
                            executed=self.executed)
                    self.schedule.add_strong_link(str(value[0]), node_id)
                raise _Pending

        function = info.function(obj)
        name = "execute" if info.v3 else info.cls.FUNCTION
        with node_context(ctx):
            result = self._call(node_id, class_type, name, function, **kwargs)
            if inspect.isawaitable(result):
                result = self._call(node_id, class_type, name, _await, result)
        outputs, ui = self._split_result(node_id, info, result)
        self.engine._store[self.keys[node_id]] = CacheEntry(outputs, ui)

    def _call(self, node_id: str, class_type: str, what: str, fn: Callable[..., Any], /, *args: Any,
              **kwargs: Any) -> Any:
        """Call node code; interrupts become RunInterrupted, anything else NodeExecutionError.

        Positional-only, so a node input may be called `what` or `fn`.
        """
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if is_interrupt(exc):
                raise RunInterrupted(node_id, class_type, executed=self.executed) from exc
            raise NodeExecutionError(
                node_id, class_type, f"{type(exc).__name__} in {what}: {exc}", executed=self.executed
            ) from exc

    def _poll_interrupt(self, node_id: str, class_type: str) -> None:
        if self.interrupt_check is None:
            return
        try:
            stop = self.interrupt_check()
        except Exception as exc:
            if not is_interrupt(exc):
                raise
            raise RunInterrupted(node_id, class_type, executed=self.executed) from exc
        if stop:
            raise RunInterrupted(node_id, class_type, executed=self.executed)

    def _gather_inputs(self, node_id: str, info: NodeClassInfo) -> tuple[dict[str, Any], set[str]]:
        """Keyword arguments for the node; linked inputs not computed (lazy) arrive as None."""
        kwargs: dict[str, Any] = {}
        missing: set[str] = set()
        store = self.engine._store
        for name, value in self.plan.prompt[node_id]["inputs"].items():
            spec = info.declared(name)
            if is_link(value):
                if spec is not None and spec.options.get("rawLink"):
                    kwargs[name] = list(value)
                    continue
                entry = store.get(self.keys[str(value[0])])
                if entry is None or value[1] >= len(entry.outputs):
                    kwargs[name] = None
                    missing.add(name)
                else:
                    kwargs[name] = entry.outputs[value[1]]
            elif spec is not None and spec.category != "hidden":
                kwargs[name] = unwrap_constant(value)
        return kwargs, missing

    def _split_result(self, node_id: str, info: NodeClassInfo, result: Any) -> tuple[tuple[Any, ...], Any]:
        """A node returns a tuple, or ``{"ui": ..., "result": tuple}``; check it fits RETURN_TYPES."""
        expected = len(info.return_types)
        try:
            values, ui, expand = info.split_result(result)
        except ValueError as exc:
            raise NodeExecutionError(node_id, info.class_type, str(exc), executed=self.executed) from exc
        if expand is not None:
            raise NodeExecutionError(node_id, info.class_type,
                                     "returned a graph expansion ('expand'), which the headless engine does not support",
                                     executed=self.executed)
        if not isinstance(values, (tuple, list)) or len(values) != expected:
            got = f"{len(values)} values" if isinstance(values, (tuple, list)) else repr(type(values).__name__)
            raise NodeExecutionError(node_id, info.class_type,
                                     f"returned {got}, but RETURN_TYPES declares {expected} output(s)",
                                     executed=self.executed)
        return tuple(values), ui


def _hidden_by_kind(info: NodeClassInfo, node_id: str, plan: _Plan) -> dict[str, Any]:
    """The hidden values the class asks for, keyed by kind (``UNIQUE_ID``, ``PROMPT``, ...)."""
    return {kind: hidden_value(kind, node_id, plan.prompt, plan.extra_pnginfo)
            for kind in info.hidden_values.values()}


def _await(awaitable: Any) -> Any:
    """Run an ``async def`` node function to completion (no overlap with other nodes)."""
    async def wrapper() -> Any:
        return await awaitable

    return asyncio.run(wrapper())


def _ancestors(prompt: Mapping[str, Mapping[str, Any]], targets: Iterable[str]) -> set[str]:
    """The targets and everything they link to, lazy inputs included (all of it is validated)."""
    seen: set[str] = set()
    stack = list(targets)
    while stack:
        nid = stack.pop()
        if nid in seen:
            continue
        seen.add(nid)
        stack += [str(v[0]) for v in prompt[nid]["inputs"].values() if is_link(v)]
    return seen


def _cycle_issues(prompt: Mapping[str, Mapping[str, Any]], node_ids: list[str]) -> list[ValidationIssue]:
    """One issue per dependency cycle found among ``node_ids``, naming the nodes in it."""

    def sources(nid: str) -> Iterator[str]:
        return iter([str(v[0]) for v in prompt[nid]["inputs"].values() if is_link(v)])

    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    issues: list[ValidationIssue] = []
    for root in node_ids:
        if root in state:
            continue
        state[root] = 1
        path = [root]
        stack = [sources(root)]
        while stack:
            src = next(stack[-1], None)
            if src is None:
                stack.pop()
                state[path.pop()] = 2
            elif state.get(src) == 1:
                cycle = path[path.index(src):] + [src]
                issues.append(ValidationIssue(src, prompt[src]["class_type"], None,
                                              f"dependency cycle: {' -> '.join(cycle)}"))
            elif src not in state:
                state[src] = 1
                path.append(src)
                stack.append(sources(src))
    return issues
