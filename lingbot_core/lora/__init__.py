"""LoRA for the LingBot-Video DiTs, one module per job:

- `files.py`: reading a file and recognising its key formats (peft, diffusers, kohya, ComfyUI,
  DiffSynth, full `.diff` deltas, 3-D expert factors), grouped by target;
- `matching.py`: resolving a file's targets on a DiT's parameters, with the checks that refuse a
  LoRA made for another model before any work;
- `merging.py`: merging into float weights, exactly reversible (pristine copies on the model's state);
- `runtime.py`: deltas added at run time on quantized (fp8/GGUF) layers;
- `stack.py`: the stack a pipe view carries (`with_lora`), applied by the stage door.
"""

from __future__ import annotations

from .files import LoraError, LoraFile, load_lora_file
from .matching import DIT_COMPONENTS, TARGETS, MatchReport, Patch, dit_layout, match
from .merging import merge, pristine_copies, restore
from .stack import LoraItem, LoraStack, lora_stack, plan, with_lora

__all__ = ["DIT_COMPONENTS", "TARGETS", "LoraError", "LoraFile", "LoraItem", "LoraStack", "MatchReport", "Patch",
           "dit_layout", "load_lora_file", "lora_stack", "match", "merge", "plan", "pristine_copies", "restore",
           "with_lora"]
