"""One video on several processes, on torch.distributed: CFG parallel x Ulysses sequence parallel.

`ParallelLayout` says which rank does what and holds the process groups; `enable_sequence_parallel`
makes a DiT share its sequence over the layout's ulysses group; `ParallelGuidance` runs the two CFG
branches on the two cfg rows. `launch` has the loopback helpers tests and benches spawn with.
"""

from .cfg import ParallelGuidance
from .layout import CFG_DEGREES, ParallelLayout, parse_degrees
from .ulysses import disable_sequence_parallel, enable_sequence_parallel

__all__ = ["CFG_DEGREES", "ParallelGuidance", "ParallelLayout", "disable_sequence_parallel",
           "enable_sequence_parallel", "parse_degrees"]
