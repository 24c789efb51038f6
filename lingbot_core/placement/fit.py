"""Will a run fit this machine? `auto`'s choice, and one line that says what a run needs and what to change.

Checked before heavy work: when `auto` chooses (the Offload node, or the first stage), and when an
explicit mode is set with a planned size (the Offload node's plan inputs, `python -m lingbot_core`).
Everything comes from `estimate` (the same numbers `auto` decides with); nothing here measures.

Policy, and why:
- Host RAM that does not fit ends in the kernel's OOM killer (no error, no cleanup), so `auto`
  never picks such a mode: it moves the DiTs to `offload_to="disk"` when that fits, else refuses
  with the line (`DoesNotFit`, a `ValueError`: bad input, exit code 2).
- VRAM that does not fit ends in a catchable CUDA out-of-memory error (and `auto` falls back one
  mode), and the estimate is an estimate, so a VRAM shortfall is a loud warning, not a refusal.
- `group` as `auto` installs it on CUDA keeps a pinned copy of every grouped tensor; where those do not
  fit the host, `auto` moves on (`sequential`, or `offload_to="disk"`) rather than pin group by group as
  they travel (diffusers' `low_cpu_mem_usage`): its published cost, +290 % for block-level offload
  (diffusers PR #11106), is above `sequential`'s (+45-63 %; docs/benchmarks.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from . import estimate
from .estimate import RESERVE_BYTES, Geometry, GiB, ModelSizes, host_bytes
from .modes import MODE_CLASSES, MODE_ORDER

log = logging.getLogger("lingbot_core.offload")

REFINE_SIZES = ((1088, 1920), (736, 1280), (544, 960))
"""Refiner output sizes (height, width) offered as advice, largest first (the reference's default first)."""
BASE_SIZES = ((736, 1280), (480, 832), (368, 640), (320, 576))
"""Base sizes (height, width) offered as advice, largest first; the last is what an 8 GB card fits."""
FRAME_COUNTS = (121, 81, 49)


class DoesNotFit(ValueError):
    """The run cannot fit this machine's host RAM under any mode; the message says what to change."""


@dataclass(frozen=True)
class Fit:
    """What a run under (`mode`, `offload_to`) needs, against what the machine has (None: unknown)."""

    mode: str
    offload_to: str
    geometry: Geometry
    vram_needed: int
    vram_free: int | None
    host_needed: int
    host_free: int | None
    advice: tuple[str, ...] = ()
    ffn_chunk: int | None = None  # the FFN/MoE chunk the estimate counted (an "auto" chunk resolved)

    @property
    def vram_ok(self) -> bool:
        return self.vram_free is None or self.vram_needed + RESERVE_BYTES <= self.vram_free

    @property
    def host_ok(self) -> bool:
        return self.host_free is None or self.host_needed <= self.host_free

    @property
    def ok(self) -> bool:
        return self.vram_ok and self.host_ok

    def line(self) -> str:
        """One line: what the run needs, what the machine has, and what to change."""
        what = _describe(self.geometry)
        parts = []
        if not self.vram_ok:
            parts.append(f"needs ~{_gib(self.vram_needed + RESERVE_BYTES)} GiB VRAM for {what} under "
                         f"'{self.mode}'; you have {_gib(self.vram_free)} free")
        if not self.host_ok:
            parts.append(f"needs ~{_gib(self.host_needed)} GiB host RAM under '{self.mode}' with "
                         f"offload_to '{self.offload_to}'; you have {_gib(self.host_free)} available")
        if not parts:
            parts.append(f"fits: ~{_gib(self.vram_needed + RESERVE_BYTES)} GiB VRAM and ~{_gib(self.host_needed)} "
                         f"GiB host RAM for {what} under '{self.mode}' (offload_to '{self.offload_to}')"
                         + (f" with the FFN/MoE over {self.ffn_chunk}-token chunks" if self.ffn_chunk else ""))
            return parts[0]
        line = "; ".join(parts)
        if self.advice:
            line += ": " + ", or ".join(self.advice)
        return line


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GiB:.1f}"


def _describe(g: Geometry) -> str:
    base = f"{g.width}x{g.height}x{g.num_frames}"
    return f"{base} refined at {g.refine[1]}x{g.refine[0]}" if g.refine else base


def _peak(mode: str, sizes: ModelSizes, g: Geometry, vram: int | None) -> int:
    """The estimate under `mode`, with an `"auto"` FFN chunk resolved against `vram` (what the run uses)."""
    return estimate.estimate_peak(mode, sizes, estimate.resolve_chunk(mode, sizes, g, vram))


def _fits(sizes: ModelSizes, g: Geometry, mode: str, offload_to: str, vram: int | None, host: int | None) -> bool:
    vram_ok = vram is None or _peak(mode, sizes, g, vram) + RESERVE_BYTES <= vram
    host_ok = host is None or estimate.host_bytes(mode, sizes, offload_to) <= host
    return vram_ok and host_ok


def _best_mode(sizes: ModelSizes, g: Geometry, offload_to: str, vram: int | None, host: int | None) -> str | None:
    return next((m for m in MODE_ORDER if _fits(sizes, g, m, offload_to, vram, host)), None)


def _advice(sizes: ModelSizes, g: Geometry, mode: str, offload_to: str, vram: int | None,
            host: int | None, limit: int = 3) -> tuple[str, ...]:
    """Changes that make the run fit, each computed with the estimate, cheapest to the user first:
    another mode or `offload_to`, then single changes to the request, then the smallest combination."""
    out: list[str] = []
    homes = (offload_to, "disk") if offload_to == "ram" else (offload_to,)

    def offer(text: str, changed: Geometry, only: str | None = None) -> bool:
        found = next(((m, t) for t in ((only,) if only else homes)
                      if (m := _best_mode(sizes, changed, t, vram, host)) is not None), None)
        if found is None:
            return False
        best, where_to = found
        if len(out) < limit:
            need = _gib(_peak(best, sizes, changed, vram) + RESERVE_BYTES)
            where = f"'{best}'" + (f" + offload_to '{where_to}'" if where_to != offload_to else "")
            out.append(f"{text} under {where} (~{need} GiB VRAM)" if text else
                       f"use {where} (~{need} GiB VRAM, ~{_gib(estimate.host_bytes(best, sizes, where_to))} GiB RAM)")
        return True

    if _best_mode(sizes, g, offload_to, vram, host) not in (None, mode):
        offer("", g, offload_to)
    elif offload_to == "ram":
        offer("", g, "disk")
    changes: list[tuple[str, Geometry]] = []  # each applied on top of the previous ones
    if not g.vae_tiling:
        changes.append(("Decode tiling", replace(g, vae_tiling=True)))
    if g.refine:
        smaller = next((s for s in REFINE_SIZES if s[0] * s[1] < g.refine[0] * g.refine[1]), None)
        if smaller:
            changes.append((f"refine at {smaller[1]}x{smaller[0]}", replace(g, refine=smaller)))
        changes.append(("skip the refiner", replace(g, refine=None)))
    base = next((s for s in BASE_SIZES if s[0] * s[1] < g.height * g.width), None)
    if base:
        changes.append((f"{base[1]}x{base[0]}", replace(g, height=base[0], width=base[1])))
    frames = next((f for f in FRAME_COUNTS if f < g.num_frames), None)
    if frames:
        changes.append((f"{frames} frames", replace(g, num_frames=frames)))
    alone = [offer(label, changed) for label, changed in changes]
    combined, labels = g, []
    if not any(alone) and len(out) < limit:
        for label, changed in changes:
            diff = {f: getattr(changed, f) for f in ("height", "width", "num_frames", "refine", "vae_tiling")
                    if getattr(changed, f) != getattr(g, f)}
            combined, labels = replace(combined, **diff), [*labels, label]
            if offer(" + ".join(labels), combined):
                break
    if not out:
        host_short = host is not None and estimate.host_bytes(MODE_ORDER[-1], sizes, "disk") > host
        out.append("more RAM, or a smaller weight format (python -m lingbot_core.quantize SRC DST --to gguf-q4_0)"
                   if host_short else "nothing at the sizes tried fits this GPU (the smallest: "
                   f"{_describe(combined if changes else g)}): a smaller size, fewer frames, or a larger GPU")
    return tuple(out)


def check(sizes: ModelSizes, geometry: Geometry, mode: str, offload_to: str = "ram", *,
          vram_free: int | None, host_free: int | None, pinned: bool | None = True) -> Fit:
    """The fit of one explicit mode (not `auto`) with its advice when it does not fit. An `"auto"` FFN
    chunk is resolved against `vram_free` (`Fit.ffn_chunk`: the chunk the estimate counted). `pinned`:
    how the mode keeps its host copies (`estimate.host_bytes`: True pinned copies, None pinned as they
    travel, False pageable; `group` without a stream pins nothing)."""
    resolved = estimate.resolve_chunk(mode, sizes, geometry, vram_free)
    fit = Fit(mode, offload_to, geometry, estimate.estimate_peak(mode, sizes, resolved), vram_free,
              estimate.host_bytes(mode, sizes, offload_to, pinned=pinned), host_free,
              ffn_chunk=resolved.ffn_chunk if isinstance(resolved.ffn_chunk, int) else None)
    if fit.ok:
        return fit
    return replace(fit, advice=_advice(sizes, geometry, mode, offload_to, vram_free, host_free))


def choose(sizes: ModelSizes, geometry: Geometry, vram_free: int | None, host_free: int | None,
           offload_to: str = "ram") -> Fit:
    """`auto`: the fastest mode that fits; with `offload_to='ram'` and no mode's host RAM fitting, the
    same under 'disk'. Raises `DoesNotFit` when the host RAM fits nowhere. When only VRAM falls
    short, the smallest mode (its `Fit` says what to change: the caller warns)."""
    tos = (offload_to, "disk") if offload_to == "ram" else (offload_to,)
    for to in tos:
        best = _best_mode(sizes, geometry, to, vram_free, host_free)
        if best is not None:
            return check(sizes, geometry, best, to, vram_free=vram_free, host_free=host_free)
    # VRAM fits nowhere: the smallest VRAM need among the offloading modes whose host RAM fits
    candidates = [(_peak(m, sizes, geometry, vram_free), i, -MODE_ORDER.index(m), m, to)
                  for i, to in enumerate(tos) for m in MODE_ORDER
                  if not MODE_CLASSES[m].keeps_resident and _fits(sizes, geometry, m, to, None, host_free)]
    if candidates:  # ties: the requested home first, then the smaller mode
        *_, mode, to = min(candidates)
        return check(sizes, geometry, mode, to, vram_free=vram_free, host_free=host_free)
    last = check(sizes, geometry, MODE_ORDER[-1], "disk", vram_free=vram_free, host_free=host_free)
    raise DoesNotFit(f"this run cannot fit: {last.line()}")


@dataclass
class AutoChoice:
    mode: str
    estimates: dict[str, int]
    budget: int
    reason: str
    host: dict[str, int] = field(default_factory=dict)  # host RAM the weights need per mode
    host_budget: int | None = None
    offload_to: str | None = None  # where the DiTs' offloaded weights live (None: as requested)
    fits: bool = True  # False: nothing is expected to fit the accelerator; the reason says what to change
    ffn_chunk: int | None = None  # tokens per FFN/MoE pass the estimate counted (None: unchunked)


def choose_mode(sizes: ModelSizes, geometry: Geometry, budget_bytes: int, *, after: str | None = None,
                host_budget: int | None = None, offload_to: str = "ram") -> AutoChoice:
    """The fastest mode whose estimate fits `budget_bytes` and whose host RAM need (`host_bytes`)
    fits `host_budget` when one is given (`choose`: with `offload_to='ram'` it moves to 'disk'
    rather than pick a mode whose host RAM does not fit, and raises `DoesNotFit` when no mode's
    host RAM fits). When nothing fits the accelerator: the smallest mode, `fits=False`.

    `after` skips modes up to and including it (the one-step fallback after an out-of-memory error).
    """
    if after is None:
        chosen = choose(sizes, geometry, budget_bytes, host_budget, offload_to)
        mode, to = chosen.mode, chosen.offload_to
        estimates = {m: _peak(m, sizes, geometry, budget_bytes) for m in MODE_ORDER}
        host = {m: host_bytes(m, sizes, to) for m in MODE_ORDER}
        if chosen.ok:
            reason = (f"'{mode}' is the fastest mode expected to fit: needs ~{estimates[mode] / GiB:.1f} GiB of "
                      f"{budget_bytes / GiB:.1f} GiB free")
            if host_budget is not None:
                reason += f" and ~{host[mode] / GiB:.1f} GiB of {host_budget / GiB:.1f} GiB host RAM"
            if to != offload_to:
                reason += (f" with offload_to '{to}' (under '{offload_to}' the weights need "
                           f"~{host_bytes(mode, sizes, offload_to) / GiB:.1f} GiB of host RAM)")
        else:
            reason = f"nothing is expected to fit: {chosen.line()}; using '{mode}'" + \
                     (f" with offload_to '{to}'" if to != offload_to else "")
        if chosen.ffn_chunk:
            reason += f", with the FFN/MoE over {chosen.ffn_chunk}-token chunks"
        return AutoChoice(mode, estimates, budget_bytes, reason, host, host_budget, to, chosen.ok, chosen.ffn_chunk)
    order = list(MODE_ORDER)
    order = order[order.index(after) + 1:] or [MODE_ORDER[-1]]
    estimates = {m: _peak(m, sizes, geometry, budget_bytes) for m in MODE_ORDER}
    host = {m: host_bytes(m, sizes, offload_to) for m in MODE_ORDER}
    for mode in order:
        if estimates[mode] + RESERVE_BYTES <= budget_bytes and (host_budget is None or host[mode] <= host_budget):
            reason = (f"after running out of memory under '{after}', '{mode}' is the fastest mode expected "
                      f"to fit: needs ~{estimates[mode] / GiB:.1f} GiB of {budget_bytes / GiB:.1f} GiB free")
            chunk = estimate.resolve_chunk(mode, sizes, geometry, budget_bytes).ffn_chunk
            return AutoChoice(mode, estimates, budget_bytes, reason, host, host_budget, offload_to,
                              ffn_chunk=chunk if isinstance(chunk, int) else None)
    mode = order[-1]
    reason = (f"after running out of memory under '{after}', nothing is expected to fit in "
              f"{budget_bytes / GiB:.1f} GiB; using '{mode}', the smallest")
    return AutoChoice(mode, estimates, budget_bytes, reason, host, host_budget, offload_to, False)


def choose_parallel(share: estimate.ParallelShare, layout: str, sizes: ModelSizes | None, geometry: Geometry | None,
                    budget: int | None) -> AutoChoice:
    """`auto` on several processes (`layout` as it describes itself): 'none', the one mode that runs there,
    with the per-GPU estimate of `share` against `budget` (None: unknown, taken as fitting; no `sizes`:
    components without a checkpoint, nothing to estimate)."""
    reason = (f"parallel {layout}: offloading does not run on several processes, so 'none'"
              + (" (the DiT blocks sharded by FSDP)" if share.fsdp else ""))
    if sizes is None or geometry is None:
        return AutoChoice("none", {}, int(budget or 0), reason)
    need = share.peak(sizes, geometry)
    fits = budget is None or need + RESERVE_BYTES <= budget
    reason += f": needs ~{need / GiB:.1f} GiB per GPU (rank 0)"
    if budget is not None:
        reason += f" of {budget / GiB:.1f} GiB free"
    if not fits:
        reason += "; more ulysses ranks divide the activations, --fsdp divides the DiT's weights"
    return AutoChoice("none", {"none": need}, int(budget or 0), reason, fits=fits)


def describe(choice: AutoChoice) -> str:
    table = ", ".join(f"{m} ~{b / GiB:.1f} GiB" for m, b in choice.estimates.items())
    if choice.host:
        table += "; host RAM: " + ", ".join(f"{m} ~{b / GiB:.1f} GiB" for m, b in choice.host.items())
    return f"auto offload: {choice.reason} (estimates: {table})"
