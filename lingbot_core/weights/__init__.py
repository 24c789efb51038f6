"""How the DiTs' tensors are stored and loaded.

- `resolve`: one `ComponentSource` per component (files, format, headers read once per open), from a
  checkpoint folder (a single DiT file of any community naming: `checkpoints.dit_file`).
- `formats`: the registry of weight formats (safetensors incl. pre-quantized fp8, GGUF): a new format
  is its source module plus one row. `sources`: the DiT weights sources the loader reads from;
  `safetensors_header` / `gguf_file`: the bounded header readers.
- `loader.load_dit`: tensor by tensor from a resolved source (safetensors read with plain reads, GGUF)
  into a meta-built model; no float32 detour, the reference's fp32-kept modules in float32.
- `fp8`: float8_e4m3 weights with per-output-row float32 scales (quantized on load or pre-quantized).
- `gguf_codec`: GGUF block formats decoded in torch on the execution device.
- `modules`: `QuantizedLinear` / `QuantizedExperts`, which hold the packed bytes and decode per layer
  (per routed expert) at forward time.
- `scan`: NaN/inf checks on packed weights that read only the fields that can decode to NaN/inf.
- `estimate`: the bytes a DiT will take once loaded, from file headers.
- `disk`: disk-backed offload, a DiT's weights streamed from its files unit by unit.
- `converted`: the converted-weights cache disk offload streams converted tensors from.
- `state`: `ModelState`, the owner of a loaded model's LoRA copies and runtime deltas.

Submodules are imported where used, so importing this package costs nothing.
"""
