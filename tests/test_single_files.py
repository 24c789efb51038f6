"""The handle's slot for single-file VAE / text encoder / processor: checked at open, loaded later,
and held to each other and to the DiT's config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lingbot_core.checkpoints import single_files as sf
from lingbot_core.checkpoints.processor_files import check_token_ids
from lingbot_core.errors import CheckpointError
from lingbot_core.placement import plan

TINY = Path(__file__).resolve().parent / "fixtures" / "lingbot" / "models" / "tiny-dense"


def _config(name: str) -> dict:
    return json.loads((TINY / name / "config.json").read_text())


def test_inspect_then_load_each_kind():
    vae = sf.inspect_file("vae", TINY / "vae" / "diffusion_pytorch_model.safetensors")
    te = sf.inspect_file("text_encoder", TINY / "text_encoder" / "model.safetensors", folder=TINY)
    proc = sf.inspect_file("processor", TINY)
    assert vae.config["z_dim"] == 16 and te.config["text_config"]["hidden_size"] == 32
    assert proc.path == TINY / "processor" and proc.info == "processor"
    loaded = {c.name: sf.load_file(c) for c in (vae, te, proc)}
    assert type(loaded["vae"]).__name__ == "AutoencoderKLWan"
    check_token_ids(loaded["processor"], te.config, str(proc.path))
    sf.check_fit(_config("transformer"), vae.config, te.config, {})


def test_parts_that_do_not_belong_together_are_refused():
    dit = _config("transformer")
    with pytest.raises(CheckpointError, match="the VAE has 48 latent channels, the DiT .* takes 16"):
        sf.check_fit(dit, {"z_dim": 48}, None, {"vae": Path("wan2.2_vae.safetensors")})
    with pytest.raises(CheckpointError, match="its hidden size is 2560, the DiT .* reads text 32 wide"):
        sf.check_fit(dit, None, {"text_config": {"hidden_size": 2560}}, {"text_encoder": Path("te.safetensors")})


def test_unknown_component():
    with pytest.raises(ValueError, match="cannot be given as a single file"):
        sf.inspect_file("scheduler", TINY)


def test_a_text_encoder_file_of_another_width_is_refused_when_the_checkpoint_opens():
    """The open-time check holds a single-file text encoder to the DiT's text width, as it does a folder's."""
    from lingbot_core.checkpoints.inspection import check_values_and_shapes

    configs = {name: _config(name) for name in ("transformer", "vae", "text_encoder")}
    check_values_and_shapes(TINY, configs, {}, skip={"text_encoder"}, scheduler=False)  # the tiny parts fit
    configs["text_encoder"]["text_config"] = dict(configs["text_encoder"]["text_config"], hidden_size=2560)
    with pytest.raises(CheckpointError, match="its hidden size is 2560, the DiT .* reads text 32 wide"):
        check_values_and_shapes(TINY, configs, {}, skip={"text_encoder"}, scheduler=False)


def _swapped_tokenizer(target: Path) -> Path:
    """The tiny processor with <|image_pad|> and <|video_pad|> trading ids: a tokenizer that looks right
    but does not belong to the text encoder."""
    folder = shutil.copytree(TINY / "processor", target)
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    swap = {"<|image_pad|>": "<|video_pad|>", "<|video_pad|>": "<|image_pad|>"}
    vocab = data["model"]["vocab"]
    vocab.update({swap[k]: v for k, v in list(vocab.items()) if k in swap})
    for token in data["added_tokens"]:
        token["content"] = swap.get(token["content"], token["content"])
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return folder


@pytest.mark.parametrize("route", ["files_only", "over_checkpoint"])
def test_a_processor_of_another_model_is_refused_when_the_handle_opens(tmp_path, monkeypatch, route):
    """A processor given apart from its checkpoint (an explicit folder, or ComfyUI's Qwen tokenizer files)
    is held to the text encoder's token ids at open: before any weights load."""
    from lingbot_core.checkpoints import loading as checkpoint
    from lingbot_core.components import ComponentFiles
    from lingbot_core.handle import PipelineHandle
    from tests.test_processor_files import comfy_tokenizer_folder

    def no_loading(*_a, **_k):
        raise AssertionError("weights loaded before the processor was checked")

    monkeypatch.setattr(checkpoint, "load_component", no_loading)
    te = tmp_path / "qwen3vl_tiny.safetensors"
    shutil.copy(TINY / "text_encoder" / "model.safetensors", te)
    parts = {"text_encoder": te}
    if route == "files_only":
        parts.update(transformer=TINY / "transformer" / "diffusion_pytorch_model.safetensors",
                     vae=TINY / "vae" / "diffusion_pytorch_model.safetensors")
    folder = None if route == "files_only" else TINY

    def open_with(processor: Path) -> PipelineHandle:
        return PipelineHandle.open(folder, files=ComponentFiles(**parts, processor=processor), device="cpu")

    assert open_with(comfy_tokenizer_folder(tmp_path / "qwen25_tokenizer")).info is not None  # the right one opens
    with pytest.raises(CheckpointError, match=r"gives <\|image_pad\|> the id 6, but the text encoder expects 5"):
        open_with(_swapped_tokenizer(tmp_path / "swapped"))
    with pytest.raises(CheckpointError, match=r"lacks <\|video_pad\|>"):
        open_with(comfy_tokenizer_folder(tmp_path / "other", drop="<|video_pad|>"))


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_the_scheduler_without_a_folder_is_the_checkpoints(variant):
    """Single files only: the scheduler takes its defaults, which must be the scheduler_config.json the
    reference writes for the dense and the MoE checkpoint (the fixtures' copies; flow UniPC, shift 1.0 in
    the file, 3.0 passed at call time), key by key and in the sigmas it gives."""
    from lingbot_core.checkpoints.loading import load_component

    folder = TINY.parent / f"tiny-{variant}"
    published = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    default, loaded = load_component(None, "scheduler"), load_component(folder, "scheduler")
    ours = dict(default.config)
    assert {k: ours.get(k) for k in published if not k.startswith("_")} == \
        {k: v for k, v in published.items() if not k.startswith("_")}
    for scheduler in (default, loaded):
        scheduler.set_timesteps(40, shift=3.0)
    assert torch.equal(default.timesteps, loaded.timesteps) and torch.equal(default.sigmas, loaded.sigmas)


def test_the_memory_estimate_of_single_files_is_what_they_hold(tmp_path):
    """The estimate behind the memory report, `auto` and the fit check counts a VAE / text encoder file's
    values at the dtype they load in, whatever the file stores (here bf16 files, loaded as float32 and as
    bfloat16): a file's bytes are not its held bytes (an fp8 file holds 2-4x them)."""
    from safetensors.torch import load_file, save_file

    from lingbot_core.components import ComponentFiles
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.placement.tensors import stored_bytes
    from tests.test_vae_file import write_original

    vae = write_original(load_file(str(TINY / "vae" / "diffusion_pytorch_model.safetensors")),
                         tmp_path / "wan_2.1_vae.safetensors", 1, torch.bfloat16)
    te = tmp_path / "qwen3vl_tiny_bf16.safetensors"
    save_file({k.replace("model.language_model.", "model.", 1): v.to(torch.bfloat16)
               for k, v in load_file(str(TINY / "text_encoder" / "model.safetensors")).items()}, str(te))
    for dtypes in ({}, {"vae": torch.bfloat16, "text_encoder": torch.bfloat16}):
        handle = PipelineHandle.open(TINY, files=ComponentFiles(vae=vae, text_encoder=te), device="cpu", dtypes=dtypes)
        sizes = plan.model_sizes(handle.shared)
        for name in ("vae", "text_encoder"):
            held = stored_bytes(handle.shared.get(name), include_meta=True)
            assert abs(getattr(sizes, name) - held) <= 1024, (name, dtypes)  # rotary tables are not weights


def test_a_files_only_handle_plans_reports_and_releases_like_the_folder():
    """No checkpoint folder at all: `auto` picks the folder's mode, the memory report shows the same
    held bytes, and after `release` the text encoder reloads from its file to the same conditioning."""
    from lingbot_core import stages
    from lingbot_core.components import ComponentFiles
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.placement.door import configure_offload, effective_mode, memory_report, release

    files = ComponentFiles(transformer=TINY / "transformer" / "diffusion_pytorch_model.safetensors",
                           vae=TINY / "vae" / "diffusion_pytorch_model.safetensors",
                           text_encoder=TINY / "text_encoder" / "model.safetensors", processor=TINY / "processor")
    geometry = dict(budget_bytes=10**12, height=32, width=32, num_frames=5)
    alone = configure_offload(PipelineHandle.open(None, files=files, device="cpu"), "auto", **geometry)
    folder = configure_offload(PipelineHandle.open(TINY, device="cpu"), "auto", **geometry)
    assert effective_mode(alone) == effective_mode(folder)
    first = stages.encode_prompt(alone, "a boat").positive.embeds
    assert torch.equal(first, stages.encode_prompt(folder, "a boat").positive.embeds)

    def held(view) -> dict[str, int]:
        return {c.name: sum(c.bytes_by_location.values()) for c in memory_report(view).components}

    assert held(alone) == held(folder) and held(alone)["text_encoder"] > 0
    release(alone)
    assert not alone.shared.loaded
    assert torch.equal(stages.encode_prompt(alone, "a boat").positive.embeds, first)
