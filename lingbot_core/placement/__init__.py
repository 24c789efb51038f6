"""What lives where while stages run. Import each name from the module that defines it:

- `settings.py`: `OffloadSettings`, the checks on what a view asks (a leaf).
- `modes/`: one class per offload mode (install / acquire / settle / uninstall / estimate) and the
  registry of their names, order and options.
- `door.py`: `stage()`, `configure_offload`, evict, release, the OOM fallback, per-view state.
- `state.py`: the placement object the shared components own; `tensors.py`: tensor homes, held bytes.
- `estimate.py`: the memory arithmetic; `fit.py`: `auto`'s choice and the fit check; `report.py`:
  the memory report; `calibration.py`: measured peaks held against the estimate; `recipes.py`: which
  settings fit a GPU and host; `plan.py`: a handle's run decided before it starts (the FFN chunk,
  CFG batching, the identity MagCache's calibration is keyed by).

Every hook a mode attaches goes through `lingbot_core.hooks`.
"""
