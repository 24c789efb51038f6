"""Auto negative: the default negative prompt pruned of what the request actually wants, delete-only.

The default negative lists things to avoid ("cartoon", "illustration", "motion blur", ...); a request
for a cartoon is fought by its own negative. The model is asked which listed items the request
wants; the code removes exactly those that are in the list (an item the model invents is ignored,
nothing is ever added or reworded). When nothing is removed, or the reply cannot be read, the
default comes back unchanged, byte for byte.
"""

from __future__ import annotations

import json
import logging

from ..prompt import DEFAULT_NEGATIVE_PROMPT
from .core import GREEDY, Backend, Sampling
from .scan import extract_object

log = logging.getLogger("lingbot_core.rewrite")

_SYSTEM = ("You compare a generation request with a list of things the generator is told to avoid. Find the "
           "items the request itself asks for (for example 'cartoon' when the request is for a cartoon, "
           "'motion blur' when it asks for motion blur); items that merely do not apply stay. Reply with one "
           "JSON object, {\"remove\": [...]}, copying those items exactly from the list; an empty list when "
           "nothing conflicts.")


def prune_negative(request: str, backend: Backend, *, negative: str = DEFAULT_NEGATIVE_PROMPT,
                   sampling: Sampling = GREEDY) -> tuple[str, list[str]]:
    """(the negative to use, the items removed). ``negative`` is a JSON object of category -> list of
    items (the shape of the defaults)."""
    document = json.loads(negative)
    groups = next(iter(document.values())) if len(document) == 1 and isinstance(
        next(iter(document.values())), dict) else document
    items = [item for values in groups.values() if isinstance(values, list) for item in values]
    listing = "\n".join(f"- {item}" for item in items)
    reply = backend.complete("negative", _SYSTEM, f"Request: {request}\n\nAvoid list:\n{listing}\n\nJSON:",
                             image=None, sampling=sampling, stop_at_object=True, on_token=None)
    value, reason = extract_object(reply)
    wanted = value.get("remove") if isinstance(value, dict) else None
    if reason is not None or not isinstance(wanted, list):
        log.warning("auto negative: the reply could not be read (%s); the default negative is used",
                    reason or "no 'remove' list")
        return negative, []
    remove = {item for item in wanted if isinstance(item, str) and item in items}
    if not remove:
        return negative, []
    for key, values in groups.items():
        if isinstance(values, list):
            groups[key] = [item for item in values if item not in remove]
    return json.dumps(document, ensure_ascii=False), [item for item in items if item in remove]
