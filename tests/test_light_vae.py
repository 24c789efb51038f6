"""The light decoder (TAEHV / LightTAE): its file read and checked like every other, Decode's
`vae: light`, the fallback to the full VAE, and the previews. Random tiny-shaped weights only.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import save_file

from lingbot_core.checkpoints import light_vae_file
from lingbot_core.checkpoints.light_vae_file import LIGHT_FILES, inspect_light_vae_file, load_light_vae
from lingbot_core.errors import CheckpointError
from lingbot_core.handle import PipelineHandle
from lingbot_core.latents import dit_to_vae, vae_to_dit
from lingbot_core.models import light_vae

# A few tensors of the published file layout (madebyollin/taehv: layers numbered along one chain),
# written out here from that description rather than taken from our module.
PUBLISHED = {
    "decoder.1.weight": (256, 16, 3, 3), "decoder.1.bias": (256,),
    "decoder.3.conv.0.weight": (256, 512, 3, 3), "decoder.5.conv.4.bias": (256,),
    "decoder.8.weight": (128, 256, 3, 3), "decoder.13.conv.weight": (256, 128, 1, 1),
    "decoder.14.weight": (64, 128, 3, 3), "decoder.19.conv.weight": (128, 64, 1, 1),
    "decoder.20.weight": (64, 64, 3, 3), "decoder.22.weight": (3, 64, 3, 3), "decoder.22.bias": (3,),
}


def _state(seed: int = 0, *, doubled_grow: bool = True, encoder: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {name: torch.randn(shape, generator=g) * 0.05 for name, shape in light_vae.expected_shapes().items()}
    if doubled_grow:  # files trained with stride 2 in the first stage store twice the rows there
        state["decoder.7.conv.weight"] = torch.randn(512, 256, 1, 1, generator=g) * 0.05
    if encoder:  # the encoder half, which is skipped
        state["encoder.0.weight"] = torch.randn(64, 3, 3, 3, generator=g)
    return {k: v.half() for k, v in state.items()}


@pytest.fixture
def light_file(tmp_path):
    path = tmp_path / "taew2_1.safetensors"
    save_file(_state(), str(path))
    return path


@pytest.fixture
def tiny(fixtures_root):
    return PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")


def test_the_layout_is_the_published_one():
    shapes = light_vae.expected_shapes()
    for name, shape in PUBLISHED.items():
        assert shapes[name] == shape, name
    assert len(shapes) == 9 * 6 + 7 + 3  # 9 memory blocks of 3 convs with bias, 5 convs (2 with bias), 3 grows


def test_load_reads_the_file_and_keeps_the_last_grow_rows(light_file):
    info = inspect_light_vae_file(light_file)
    assert info.latent_space == "normalised" and info.keep_rows == {"decoder.7.conv.weight": 256}
    model = load_light_vae(info)
    stored = _state()
    assert torch.equal(model.state_dict()["decoder.7.conv.weight"], stored["decoder.7.conv.weight"][256:].float())
    assert torch.equal(model.state_dict()["decoder.22.bias"], stored["decoder.22.bias"].float())


def test_frames_count_size_and_range():
    model = light_vae.LightVideoDecoder().eval()
    with torch.no_grad():
        out = model(torch.randn(1, 16, 3, 4, 6))
    assert tuple(out.shape) == (1, 3, 9, 32, 48)  # 4T-3 frames, 8x the size: the Wan VAE's geometry
    assert light_vae.output_shape((1, 16, 3, 4, 6)) == (9, 32, 48)
    assert out.min() >= 0 and out.max() <= 1
    with torch.no_grad():
        half = model(torch.randn(1, 16, 2, 4, 6), full_size=False)
    assert tuple(half.shape) == (1, 3, 5, 16, 24)


def test_chunks_give_the_same_frames_and_time_runs_forward():
    torch.manual_seed(0)
    model = light_vae.LightVideoDecoder().eval()
    for p in model.parameters():  # weights large enough that a mistake shows, small enough not to saturate
        p.data.normal_(0, 0.02)
    z = torch.randn(1, 16, 4, 3, 5)
    with torch.no_grad():
        whole = model(z, chunk=4)
        assert ((whole > 0) & (whole < 1)).float().mean() > 0.5
        assert torch.allclose(model(z, chunk=1), whole, atol=1e-5)
        assert torch.allclose(model(z, chunk=3), whole, atol=1e-5)
        changed = z.clone()
        changed[:, :, 2] += 1.0
        other = model(changed, chunk=2)
    # latent frame 2 makes output frames 8..11 before the 3 warm-up frames are dropped: 5.. after
    assert torch.equal(other[:, :, :5], whole[:, :, :5])
    assert not torch.allclose(other[:, :, 5:9], whole[:, :, 5:9])


def _write(path, state):
    save_file(state, str(path))
    return path


@pytest.mark.parametrize("name, state, said", [
    ("taew2_1.safetensors", {"decoder.middle.0.residual.0.gamma": torch.zeros(384, 1, 1, 1)}, "full Wan 2.1 VAE"),
    ("taew2_1.safetensors", {"decoder.1.weight": torch.zeros(256, 48, 3, 3), "decoder.22.bias": torch.zeros(12)},
     "Wan 2.2"),
    ("taew2_1.safetensors", {"blocks.0.weight": torch.zeros(2)}, "not a light video decoder"),
    ("taehv.safetensors", None, "must start with"),
    ("taew2_1.pth", None, "must be .safetensors"),
])
def test_a_wrong_file_is_refused_in_one_line_before_any_tensor_is_read(tmp_path, monkeypatch, name, state, said):
    path = _write(tmp_path / name, state if state is not None else _state())
    monkeypatch.setattr(light_vae_file.TensorReader, "get", lambda *a: pytest.fail("a tensor was read"))
    with pytest.raises(CheckpointError) as err:
        load_light_vae(path)
    text = str(err.value)
    assert said in text and "\n" not in text and "vae_approx" in text


def test_a_wrong_shape_is_refused(tmp_path):
    state = _state()
    state["decoder.8.weight"] = torch.zeros(128, 200, 3, 3)
    with pytest.raises(CheckpointError, match="wrong shape.*decoder.8.weight"):
        inspect_light_vae_file(_write(tmp_path / "taew2_1.safetensors", state))


def test_decode_stage_uses_the_light_file_and_leaves_the_wan_vae_unloaded(tiny, light_file):
    from lingbot_core import stages

    latents = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    frames = stages.decode(tiny, latents, light=light_file)
    assert tuple(frames.shape) == (5, 32, 32, 3) and frames.dtype == torch.float32
    assert "vae" not in tiny.shared.loaded
    full = stages.decode(tiny, latents)
    assert full.shape == frames.shape  # the same geometry as the Wan VAE


def test_lighttae_reads_raw_latents(tiny, tmp_path):
    """The same weights named as LightTAE decode dit_to_vae(x) where named as TAEHV they decode x."""
    from lingbot_core import stages

    state = _state(seed=3)
    taew = _write(tmp_path / "taew2_1.safetensors", state)
    light = _write(tmp_path / "lighttaew2_1.safetensors", state)
    config = tiny.vae_config()
    z = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(2))
    raw = stages.decode(tiny, z, light=light)
    normalised = stages.decode(tiny, dit_to_vae(z, config), light=taew)
    assert torch.allclose(raw, normalised, atol=1e-5)
    assert not torch.allclose(raw, stages.decode(tiny, z, light=taew), atol=1e-3)


@pytest.fixture
def files_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LINGBOT_FILES_DIR", str(tmp_path / "files"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "files" / "vae_approx").mkdir(parents=True)
    return tmp_path / "files" / "vae_approx"


def test_decode_node_light_and_its_preference(tiny, files_dir):
    from lingbot_nodes.files import light_vae_file
    from lingbot_nodes.output import LingBotDecode

    assert light_vae_file() is None
    _write(files_dir / "taew2_1.safetensors", _state())
    assert light_vae_file().name == "taew2_1.safetensors"
    _write(files_dir / "lighttaew2_1.safetensors", _state(seed=5))
    assert light_vae_file().name == LIGHT_FILES[0].prefix + ".safetensors"
    latent = {"samples": dit_to_vae(torch.randn(1, 16, 2, 4, 4), tiny.vae_config())}
    images, _video = LingBotDecode.execute(tiny, latent, vae="light").args
    assert tuple(images.shape) == (5, 32, 32, 3) and "vae" not in tiny.shared.loaded


def test_no_light_file_falls_back_to_the_full_vae_with_one_warning(tiny, files_dir, caplog):
    from lingbot_nodes.output import LingBotDecode

    latent = {"samples": torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(4))}
    with caplog.at_level(logging.WARNING):
        light, _ = LingBotDecode.execute(tiny, latent, vae="light").args
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "light" in r.getMessage()]
    assert len(warned) == 1 and "vae_approx" in warned[0].getMessage()
    full, _ = LingBotDecode.execute(tiny, latent, vae="full").args
    assert torch.equal(light, full)


def test_decode_vae_widget_is_last_and_refuses_other_values():
    from lingbot_nodes.output import LingBotDecode, light_decoder

    inputs = LingBotDecode.define_schema().inputs
    assert inputs[-1].id == "vae" and inputs[-1].default == "full"
    with pytest.raises(ValueError, match="vae must be one of"):
        light_decoder("tiny")


def test_headless_previews_use_the_light_decoder(files_dir, tmp_path, monkeypatch):
    from PIL import Image

    from lingbot_nodes.preview import Previewer

    monkeypatch.setenv("LINGBOT_PREVIEW_DIR", str(tmp_path / "previews"))
    latents = vae_to_dit(torch.randn(1, 16, 3, 6, 10), {"latents_mean": [0.0] * 16, "latents_std": [1.0] * 16})
    plain = Previewer("denoise", comfy=False).write(1, latents)
    assert Image.open(plain).size == (10, 6)  # the latent approximation: one pixel per latent
    _write(files_dir / "taew2_1.safetensors", _state())
    light = Previewer("denoise", comfy=False).write(2, latents)
    assert Image.open(light).size == (40, 24)  # the decoder at half the video's size (80x48)


def test_comfy_previews_use_the_light_decoder_when_the_method_allows(files_dir, monkeypatch):
    from lingbot_nodes import preview

    _write(files_dir / "lighttaew2_1.safetensors", _state())
    latents = torch.randn(1, 16, 2, 4, 6)
    monkeypatch.setattr(preview, "_comfy_method_allows_light", lambda: False)
    kept = preview.Previewer("denoise", comfy=True)
    assert kept.comfy_preview(latents) is None  # latent2rgb / none: ComfyUI's previewer (absent here)
    monkeypatch.setattr(preview, "_comfy_method_allows_light", lambda: True)
    shown = preview.Previewer("denoise", comfy=True)
    assert shown.active
    kind, image, _size = shown.comfy_preview(latents)
    assert kind == "JPEG" and image.size == (24, 16)


def test_a_broken_light_file_leaves_the_approximation_with_one_warning(files_dir, tmp_path, monkeypatch, caplog):
    from PIL import Image

    from lingbot_nodes.preview import Previewer

    monkeypatch.setenv("LINGBOT_PREVIEW_DIR", str(tmp_path / "previews"))
    _write(files_dir / "taew2_1.safetensors", {"decoder.1.weight": torch.zeros(256, 48, 3, 3),
                                               "decoder.22.bias": torch.zeros(12)})
    previewer = Previewer("denoise", comfy=False)
    latents = torch.randn(1, 16, 1, 6, 10)
    with caplog.at_level(logging.WARNING):
        paths = [previewer.write(step, latents) for step in (1, 2)]
    assert [Image.open(p).size for p in paths] == [(10, 6)] * 2
    assert len([r for r in caplog.records if "light decoder" in r.getMessage()]) == 1


def test_bench_quick_runs_both_decoders_side_by_side(tmp_path, capsys):
    import json

    from bench import light_vae as bench

    result = bench.main(["--quick", "--threads", "1", "--json", str(tmp_path / "light.json")])
    assert "full / light" in capsys.readouterr().out
    full, light = result["decoders"]["full"], result["decoders"]["light"]
    assert full["frames_out"] == light["frames_out"] == (5, 16, 16)  # the same video out of the same latents
    assert set(json.loads((tmp_path / "light.json").read_text())["ratios"]) == {
        "time_full_over_light", "cpu_time_full_over_light", "peak_full_over_light"}


def test_core_command_decodes_with_light_vae_and_refuses_a_wrong_file_before_loading(tmp_path, capsys, monkeypatch):
    from lingbot_core import stages
    from lingbot_core.__main__ import main as core_main

    wrong = _write(tmp_path / "taew2_1.safetensors", {"decoder.middle.0.residual.0.gamma": torch.zeros(4, 1, 1, 1)})
    assert core_main(["--light-vae", str(wrong), "--output", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "full Wan 2.1 VAE" in err
    good = _write(tmp_path / "lighttaew2_1.safetensors", _state())
    used = []
    decode = stages.decode
    monkeypatch.setattr(stages, "decode", lambda *a, **k: used.append(k.get("light")) or decode(*a, **k))
    assert core_main(["--light-vae", str(good), "--steps", "1", "--output", str(tmp_path / "out"), "-q"]) == 0
    assert used == [str(good)] and capsys.readouterr().out.strip().endswith(".mp4")


def test_lingbot_run_t2v_with_the_light_decoder_and_light_previews(files_dir, tmp_path, capsys, monkeypatch):
    """The shipped T2V workflow on the tiny model, `--set Decode.vae=light`: its latent decodes with the
    light decoder into the same geometry, and the step previews are the decoder's half-size frames."""
    from PIL import Image

    from lingbot_nodes.cli import main

    _write(files_dir / "taew2_1.safetensors", _state())
    monkeypatch.setenv("LINGBOT_PREVIEW_DIR", str(tmp_path / "previews"))
    assert main(["--output", str(tmp_path / "out"), "--set", "Decode.vae=light", "-q"]) == 0
    (written,) = capsys.readouterr().out.split()
    from video_reader import read_video

    frames, _fps = read_video(written)
    assert frames.shape == (9, 64, 64, 3)
    previews = sorted((tmp_path / "previews").glob("*.png"))
    assert previews and {Image.open(p).size for p in previews} == {(32, 32)}  # not the 8x8 latent sketch


def test_light_decode_moves_progress_per_latent_frame_and_can_be_cancelled(tiny, files_dir, monkeypatch):
    from lingbot_nodes import runtime
    from lingbot_nodes.output import LingBotDecode

    class Bar:
        made: list = []

        def __init__(self, total, label="lingbot"):
            self.total, self.label, self.values = total, label, []
            Bar.made.append(self)

        def update(self, value, total=None, preview=None):
            self.values.append(value)

        def close(self):
            pass

    monkeypatch.setattr(runtime, "Progress", Bar)
    _write(files_dir / "taew2_1.safetensors", _state())
    latent = {"samples": torch.randn(1, 16, 3, 4, 4)}
    LingBotDecode.execute(tiny, latent, vae="light")
    (bar,) = [b for b in Bar.made if b.label == "decode"]
    assert bar.total == 3 and bar.values[-1] == 3  # one unit per latent frame, ends at 100 %

    calls = []

    def cancel():
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(runtime, "interrupt_check", lambda: cancel)
    with pytest.raises(KeyboardInterrupt):
        LingBotDecode.execute(tiny, latent, vae="light")
    monkeypatch.setattr(runtime, "interrupt_check", lambda: (lambda: None))
    images, _video = LingBotDecode.execute(tiny, latent, vae="light").args  # the handle still works
    assert tuple(images.shape) == (9, 32, 32, 3)


def test_the_full_vae_fit_check_does_not_refuse_a_light_decode(tiny, light_file, monkeypatch):
    """A device too small for the Wan VAE's decode refuses `full` before loading, and still decodes `light`."""
    from lingbot_core import stages
    from lingbot_core.placement import plan

    monkeypatch.setattr(plan, "device_capacity", lambda device: 1 << 20)  # 1 MiB
    latents = torch.randn(1, 16, 2, 4, 4)
    with pytest.raises(ValueError, match="decoding these latents"):
        stages.decode(tiny, latents)
    assert tuple(stages.decode(tiny, latents, light=light_file).shape) == (5, 32, 32, 3)


def test_an_accelerator_decodes_a_half_precision_copy_and_leaves_the_cached_decoder_as_it_was(monkeypatch):
    """The non-CPU branch (float16 on a GPU) through a fake: the CPU standing in, bfloat16 for float16."""
    assert light_vae.compute_dtype(torch.device("cuda")) == torch.float16
    assert light_vae.compute_dtype(torch.device("cpu")) == torch.float32
    torch.manual_seed(0)
    model = light_vae.LightVideoDecoder().eval()
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    z = torch.randn(1, 16, 2, 3, 4)
    exact = light_vae.decode_frames(model, z, None, torch.device("cpu"))
    monkeypatch.setattr(light_vae, "compute_dtype", lambda device: torch.bfloat16)
    half = light_vae.decode_frames(model, z, None, torch.device("cpu"))
    assert half.dtype == torch.float32 and half.shape == exact.shape == (5, 24, 32, 3)
    assert (half - exact).abs().max() < 0.05 and not torch.equal(half, exact)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) and after[k].dtype == torch.float32 for k, v in before.items())
