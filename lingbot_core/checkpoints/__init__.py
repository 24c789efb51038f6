"""Opening a LingBot-Video checkpoint: a diffusers folder, single files standing in for its
components, or both. How the tensors inside are stored and read is `weights/`.

- `inspection`: what the checkpoint holds (`inspect_checkpoint` -> `CheckpointInfo`), every component
  resolved and checked before any weight loads; the single-file route of each role (`FILE_ROUTES`).
- `configs`: every config value a model's shape or the sampler depends on, bounded; no remote code.
- `loading`: each component loaded onto the CPU from what `inspection` resolved.
- `dit_file`, `vae_file`, `text_encoder_file`, `light_vae_file`: one component from a single file of any
  community naming (its header checked at open, its tensors renamed to ours at load).
- `single_files`, `processor_files`: the VAE, text encoder and processor given apart from a folder,
  and held to each other and to the DiT.

Submodules are imported where used, so importing this package costs nothing.
"""
