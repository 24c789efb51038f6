"""How the DiTs' tensors are stored and loaded.

- `loader.load_dit`: tensor by tensor from memory-mapped safetensors or GGUF into a meta-built model;
  no float32 detour, the reference's fp32-kept modules in float32.
- `fp8`: float8_e4m3 weights with per-output-row float32 scales (quantized on load or pre-quantized).
- `gguf_codec`: GGUF block formats decoded in torch on the execution device.
- `modules`: `QuantizedLinear` / `QuantizedExperts`, which hold the packed bytes and decode per layer
  (per routed expert) at forward time.
- `scan`: NaN/inf checks on packed weights that read only the fields that can decode to NaN/inf.
- `estimate`: the bytes a DiT will take once loaded, from file headers.

Submodules are imported where used, so importing this package costs nothing.
"""
