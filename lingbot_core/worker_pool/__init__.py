"""Runners that drive the stages on several processes, above `stages` and `handle`.

`run.parallel_denoise` runs one denoise on every rank of a layout; `pool` is LingBot Parallel's
persistent worker processes, with the calling process as rank 0: what they need as plain data is
`spec`, what rank 0 sends them `messages`, a worker's loop `worker`. The groundwork they stand on
(layouts, CFG and Ulysses parallel, FSDP, failure reporting, launch helpers) is `distributed/`, a lower
layer that the stages themselves use.
"""
