"""A DiT from a single file: every community naming gives the DiT (and the frames) of the folder
holding the same weights; files of other model families are refused in one line."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lingbot_core import stages
from lingbot_core.checkpoints.dit_file import PREFIXES, dit_file_source
from lingbot_core.components import ComponentFiles
from lingbot_core.errors import CheckpointError
from lingbot_core.handle import PipelineHandle
from lingbot_core.placement import plan
from lingbot_core.quantize import quantize_checkpoint
from lingbot_core.weights.loader import load_dit
from tests.gguf_fakes import write_gguf

T = gguf.GGMLQuantizationType
STACK = re.compile(r"\.experts\.w[123]$")
GEN = dict(height=32, width=32, num_frames=5, steps=2, seed=0, refine_options=dict(height=32, width=32, steps=2))


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 16, 3, 8, 8, generator=g), torch.tensor([500.0]), torch.randn(1, 7, 32, generator=g)


def _out(model) -> torch.Tensor:
    with torch.no_grad():
        return model(*_inputs()).sample


def _renamed(sd: dict[str, torch.Tensor], prefix: str = "", per_expert: str | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under a community convention: a prefix, and expert stacks split per expert
    as `NAME.E` (per_expert "index") or `NAME.E.weight` ("weight")."""
    out = {}
    for key, value in sd.items():
        if per_expert and STACK.search(key):
            for e in range(value.shape[0]):
                out[f"{prefix}{key}.{e}" + (".weight" if per_expert == "weight" else "")] = value[e].clone()
        else:
            out[prefix + key] = value
    return out


@pytest.fixture(scope="module")
def tiny(fixtures_root) -> dict[str, Path]:
    return {v: fixtures_root / "models" / f"tiny-{v}" for v in ("dense", "moe")}


@pytest.fixture(scope="module")
def reference(tiny) -> dict[tuple[str, str], torch.Tensor]:
    return {(v, c): _out(load_dit(tiny[v], c)) for v in ("dense", "moe") for c in ("transformer", "refiner")
            if (tiny[v] / c).is_dir()}


CONVENTIONS = [("", None), *((p, None) for p in PREFIXES), ("", "index"), ("", "weight"),
               ("model.diffusion_model.", "weight")]


def test_a_per_expert_stack_is_read_once_straight_into_its_place(tiny, reference, tmp_path, monkeypatch):
    """The load peak of a per-expert file (bench/weights.py `bf16-file`): every expert is read straight into
    its slice of the stack (`FileSpan.read_into`), never into a buffer of its own that a `torch.stack`
    then copies (the stack held twice); every stored byte is read once. Converting on load goes through
    one expert at a time and gives the folder's model."""
    from lingbot_core.weights.disk import FileSpan

    sd = load_file(str(tiny["moe"] / "transformer" / "diffusion_pytorch_model.safetensors"))
    path = tmp_path / "lingbot_moe.safetensors"
    save_file(_renamed(sd, "model.diffusion_model.", "weight"), str(path))
    source = dit_file_source(path)
    buffered: list[int] = []
    placed: list[int] = []
    read, read_into = FileSpan.read, FileSpan.read_into
    monkeypatch.setattr(FileSpan, "read", lambda self, *a, **k: buffered.append(self.nbytes) or read(self, *a, **k))
    monkeypatch.setattr(FileSpan, "read_into", lambda self, out: placed.append(self.nbytes) or read_into(self, out))
    model = load_dit(source)
    experts = [v for k, v in sd.items() if STACK.search(k)]
    one_expert = max(v[0].numel() * v.element_size() for v in experts)
    assert sum(placed) == sum(v.numel() * v.element_size() for v in experts)
    assert sum(buffered) + sum(placed) == sum(v.numel() * v.element_size() for v in sd.values())
    assert torch.equal(_out(model), reference["moe", "transformer"])
    buffered.clear(), placed.clear()
    converted = load_dit(dit_file_source(path), dtype=torch.bfloat16)
    assert not placed and max(buffered) <= max(one_expert, *(v.numel() * v.element_size() for k, v in sd.items()
                                                               if not STACK.search(k)))
    assert torch.equal(_out(converted), _out(load_dit(tiny["moe"], dtype=torch.bfloat16)))


@pytest.mark.parametrize("prefix,per_expert", CONVENTIONS)
def test_every_safetensors_naming_loads_the_same_moe_dit(tiny, reference, tmp_path, prefix, per_expert):
    sd = load_file(str(tiny["moe"] / "transformer" / "diffusion_pytorch_model.safetensors"))
    path = tmp_path / "lingbot_moe.safetensors"
    save_file(_renamed(sd, prefix, per_expert), str(path))
    source = dit_file_source(path)
    assert source.config["num_experts"] == 4 and source.config["depth"] == 2
    assert torch.equal(_out(load_dit(source)), reference["moe", "transformer"])


def test_a_dense_file_with_a_prefix_is_dense(tiny, reference, tmp_path):
    sd = load_file(str(tiny["dense"] / "transformer" / "diffusion_pytorch_model.safetensors"))
    path = tmp_path / "dense.safetensors"
    save_file(_renamed(sd, "model.diffusion_model."), str(path))
    source = dit_file_source(path)
    assert source.config["num_experts"] == 0
    assert torch.equal(_out(load_dit(source)), reference["dense", "transformer"])


# -- GGUF -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory, tiny) -> Path:
    """The tiny MoE checkpoint with both DiTs as GGUF Q8_0, one tensor per expert (the folder route)."""
    return quantize_checkpoint(tiny["moe"], tmp_path_factory.mktemp("g") / "moe-q8", "gguf-q8_0", per_expert=True)


def _community_gguf(src: Path, dst: Path, arch: str = "lingbot") -> Path:
    """`src` rewritten as a ComfyUI-style file: `model.diffusion_model.` on every name, experts as
    `NAME.E.weight`, one Q8_0 matrix reshaped to rows of 256 values with its torch shape in
    `comfy.gguf.orig_shape.<name>`, and another `general.architecture`."""
    reader = gguf.GGUFReader(src)
    tensors = {t.name: (np.array(t.data), t.tensor_type) for t in reader.tensors}
    del reader
    stored, arrays = {}, {}
    for name, (data, qtype) in tensors.items():
        key = "model.diffusion_model." + (f"{name}.weight" if re.search(r"\.experts\.w[123]\.\d+$", name) else name)
        if name == "blocks.0.attn.to_q.weight":
            assert qtype == T.Q8_0 and data.shape == (32, 34)
            arrays[f"comfy.gguf.orig_shape.{key}"] = [32, 32]
            data = data.reshape(4, 8 * 34)  # Q8_0 blocks run along rows: the same bytes, 256 values a row
        stored[key] = (data, qtype)
    return write_gguf(dst, stored, arch=arch, arrays=arrays)


@pytest.fixture(scope="module")
def gguf_files(gguf_folder, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("files")
    return {c: _community_gguf(gguf_folder / c / "diffusion_pytorch_model.gguf", root / f"lingbot-{c}-Q8_0.gguf")
            for c in ("transformer", "refiner")}


def test_a_comfyui_style_gguf_is_the_dit_of_the_folder_holding_that_gguf(gguf_folder, gguf_files):
    source = dit_file_source(gguf_files["transformer"])
    assert source.format.name == "gguf"
    assert torch.equal(_out(load_dit(source)), _out(load_dit(gguf_folder)))


def test_files_override_the_folder_and_give_the_same_frames(gguf_folder, gguf_files):
    expected = stages.generate(PipelineHandle.open(gguf_folder, device="cpu"), "a boat", refine_output=True, **GEN)
    handle = PipelineHandle.open(gguf_folder, device="cpu", files=ComponentFiles(**gguf_files))
    assert handle.info.sources["transformer"].files == (gguf_files["transformer"],)
    got = stages.generate(handle, "a boat", refine_output=True, **GEN)
    assert torch.equal(got.frames, expected.frames)


def test_without_a_folder_every_component_is_needed(gguf_files):
    with pytest.raises(CheckpointError, match=r"missing: vae, text_encoder, processor"):
        PipelineHandle.open(None, files=ComponentFiles(transformer=gguf_files["transformer"]))


def test_fp8_on_load_of_a_gguf_file_is_refused_at_open(gguf_folder, gguf_files):
    with pytest.raises(CheckpointError, match=r"already quantized \(GGUF\)"):
        PipelineHandle.open(gguf_folder, device="cpu", weights="fp8_e4m3",
                            files=ComponentFiles(transformer=gguf_files["transformer"]))


# -- what is not a LingBot-Video DiT ------------------------------------------------------------------

def _write(path: Path, names: list[str], shape=(4, 4)) -> Path:
    save_file({n: torch.zeros(shape) for n in names}, str(path))
    return path


@pytest.mark.parametrize("names,what", [
    (["model.diffusion_model.blocks.0.self_attn.q.weight", "model.diffusion_model.patch_embedding.weight"],
     "a Wan 2.1/2.2 video DiT"),
    (["blocks.0.attn1.to_q.weight", "blocks.0.attn2.to_k.weight", "condition_embedder.time_embedder.linear_1.weight"],
     "a Wan 2.1/2.2 video DiT"),
    (["double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight"], "a Flux-style image DiT"),
    (["model.diffusion_model.input_blocks.0.0.weight"], "a Stable Diffusion / SDXL UNet"),
    (["decoder.middle.0.residual.0.gamma"], "a VAE"),
    (["model.language_model.layers.0.mlp.up_proj.weight"], "a text encoder"),
])
def test_another_family_is_named_in_one_line(tmp_path, names, what):
    with pytest.raises(CheckpointError) as err:
        dit_file_source(_write(tmp_path / "other.safetensors", names))
    message = str(err.value)
    assert f"other.safetensors is {what}, not a LingBot-Video DiT" in message and "\n" not in message


def test_a_flux_gguf_is_named(tmp_path):
    path = tmp_path / "flux1-dev-Q4_0.gguf"
    writer = gguf.GGUFWriter(path, arch="flux")
    writer.add_tensor("img_in.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"flux1-dev-Q4_0.gguf is a GGUF whose general.architecture is 'flux'"):
        dit_file_source(path)


def test_a_lingbot_dit_of_an_unknown_size_is_refused_naming_the_tensor(tiny, tmp_path):
    sd = load_file(str(tiny["dense"] / "transformer" / "diffusion_pytorch_model.safetensors"))
    sd["blocks.1.attn.to_k.weight"] = torch.zeros(16, 32)
    with pytest.raises(CheckpointError, match=r"dense DiT of a size .*blocks.1.attn.to_k.weight: stored \[16, 32\]"):
        dit_file_source(_save(sd, tmp_path / "x.safetensors"))


def _save(sd: dict[str, torch.Tensor], path: Path) -> Path:
    save_file(sd, str(path))
    return path


# -- everything that works for folders works for files (a representative set) ------------------------

def _dit_out(handle) -> torch.Tensor:
    from lingbot_core.placement.door import stage

    with stage(handle, "transformer"):
        return _out(handle.component("transformer"))


def _pair(folder: Path, file: Path, **kwargs):
    """A handle on the folder, and one on the same folder with its transformer given as `file`."""
    return (PipelineHandle.open(folder, device="cpu", **kwargs),
            PipelineHandle.open(folder, device="cpu", files=ComponentFiles(transformer=file), **kwargs))


@pytest.mark.parametrize("mode,home", [("sequential", "ram"), ("group", "ram"), ("model", "disk"),
                                       ("sequential", "disk")])
def test_offload_modes_on_a_gguf_file(gguf_folder, gguf_files, mode, home):
    from lingbot_core.placement.door import configure_offload

    folder, file = _pair(gguf_folder, gguf_files["transformer"])
    expected = _dit_out(folder)
    view = configure_offload(file, mode, offload_to=home, **({"use_stream": False} if mode == "group" else {}))
    assert torch.equal(_dit_out(view), expected)
    dit = view.shared.loaded["transformer"]
    if home == "disk":  # the single file is the home: nothing held between forwards, spans in that file
        assert all(t.device.type == "meta" for t in [*dit.parameters(), *dit.buffers()])
        assert {Path(s.path) for s in view.shared.states["transformer"].spans.values()} == {gguf_files["transformer"]}


def test_disk_offload_on_a_safetensors_file(tiny, tmp_path):
    """offload_to disk on a plain safetensors DiT file in a community layout: the file is the home of every
    tensor kept as stored; the per-expert stacks (stacked on load) stream from the converted-weights cache."""
    from lingbot_core.placement.door import configure_offload

    sd = load_file(str(tiny["moe"] / "transformer" / "diffusion_pytorch_model.safetensors"))
    path = _save(_renamed(sd, "model.diffusion_model.", "weight"), tmp_path / "lingbot_moe.safetensors")
    folder, file = _pair(tiny["moe"], path)
    view = configure_offload(file, "group", offload_to="disk", use_stream=False)
    assert torch.equal(_dit_out(view), _dit_out(folder))
    dit = view.shared.loaded["transformer"]
    assert all(t.device.type == "meta" for t in [*dit.parameters(), *dit.buffers()])
    homes = {name: Path(span.path) for name, span in view.shared.states["transformer"].spans.items()}
    assert {home for name, home in homes.items() if not STACK.search(name)} == {path}
    assert all(home != path for name, home in homes.items() if STACK.search(name))


def test_lora_on_a_dit_file_matches_the_folder(gguf_folder, gguf_files):
    from lingbot_core.lora import LoraFile, with_lora

    g = torch.Generator().manual_seed(3)
    lora = LoraFile.from_state_dict({"blocks.0.attn.to_q.lora_A.weight": torch.randn(2, 32, generator=g),
                                     "blocks.0.attn.to_q.lora_B.weight": torch.randn(32, 2, generator=g)}, name="t")
    folder, file = _pair(gguf_folder, gguf_files["transformer"])
    plain = _dit_out(file)
    expected, got = _dit_out(with_lora(folder, lora)), _dit_out(with_lora(file, lora))
    assert torch.equal(got, expected) and not torch.equal(got, plain)


def test_fp8_on_load_of_a_safetensors_file_matches_the_folder(tiny, tmp_path):
    sd = load_file(str(tiny["moe"] / "transformer" / "diffusion_pytorch_model.safetensors"))
    path = tmp_path / "moe.safetensors"
    save_file(_renamed(sd, "diffusion_model.", "weight"), str(path))
    folder, file = _pair(tiny["moe"], path, weights="fp8_e4m3")
    assert torch.equal(_dit_out(file), _dit_out(folder))
    assert "fp8" in file.shared.states["transformer"].format


def test_estimate_report_auto_and_reload_on_a_dit_file(gguf_folder, gguf_files, monkeypatch):
    from lingbot_core.placement.door import configure_offload, effective_mode, memory_report, release
    from lingbot_core.weights import sources

    walks: list[str] = []
    real = sources.read_header
    monkeypatch.setattr(sources, "read_header", lambda path: walks.append(str(path)) or real(path))
    folder, file = _pair(gguf_folder, gguf_files["transformer"])
    sizes_folder, sizes_file = plan.model_sizes(folder.shared), plan.model_sizes(file.shared)
    # the community file holds the same blocks plus longer names: within its header's bytes
    assert abs(sizes_file.transformer - sizes_folder.transformer) < 64 * 1024
    budget = 10**12
    view = configure_offload(file, "auto", budget_bytes=budget, height=32, width=32, num_frames=5)
    assert effective_mode(view) == effective_mode(
        configure_offload(folder, "auto", budget_bytes=budget, height=32, width=32, num_frames=5))
    first = _dit_out(view)
    report = memory_report(view)
    assert any(c.name == "transformer" and sum(c.bytes_by_location.values()) > 0 for c in report.components)
    release(view)
    assert "transformer" not in view.shared.loaded
    assert torch.equal(_dit_out(view), first)  # reloaded from the file
    assert walks.count(str(gguf_files["transformer"])) == 1  # its header walked once: open, load, reload
