"""Issue 21 item 7: the smaller holes, one test each (each failed before its fix)."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from lingbot_core import stage_inputs
from lingbot_core.checkpoints.inspection import inspect_checkpoint
from lingbot_core.errors import CheckpointError, WeightsError
from lingbot_core.save_path import UnsafePrefix
from lingbot_core.weights.fp8 import dequantize_fp8, quantize_fp8

API = Path(__file__).resolve().parents[1] / "workflows" / "api"


def test_fp8_takes_1d_tensors_and_refuses_what_it_cannot_quantize():
    w = torch.randn(8)
    q, scale = quantize_fp8(w)  # one row, one scale
    assert scale.shape == () and torch.allclose(dequantize_fp8(q, scale, torch.float32), w, rtol=0.07, atol=1e-3)
    for bad in (torch.tensor(3.0), torch.arange(4, dtype=torch.int32)):
        with pytest.raises(WeightsError, match="fp8 quantizes float tensors"):
            quantize_fp8(bad)


@pytest.mark.parametrize("change", [{"solver_type": "dpmsolver++"}, {"prediction_type": "epsilon"},
                                    {"lower_order_final": False, "solver_order": 2}])
def test_a_scheduler_the_sampler_cannot_run_is_refused_at_open(fixtures_root, tmp_path, change):
    folder = tmp_path / "ckpt"
    shutil.copytree(fixtures_root / "models" / "tiny-dense", folder)
    config = folder / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **change}))
    with pytest.raises(CheckpointError, match="scheduler_config.json"):
        inspect_checkpoint(folder)


def test_a_cache_root_that_is_a_file_says_what_to_do(tmp_path, monkeypatch):
    from lingbot_core.tiny import ensure_tiny_checkpoint
    from lingbot_core.weights.converted import cache_folder

    blocker = tmp_path / "cache-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LINGBOT_TINY_DIR", str(blocker))
    for call in (ensure_tiny_checkpoint, cache_folder):
        with pytest.raises(NotADirectoryError, match="is a file, not a folder. Set LINGBOT_TINY_DIR"):
            call()


def test_a_node_id_with_a_slash_still_gets_its_headless_preview(tmp_path, monkeypatch):
    from lingbot_nodes.preview import Previewer

    monkeypatch.setenv("LINGBOT_PREVIEW_DIR", str(tmp_path / "previews"))
    path = Previewer("denoise", comfy=False).write(3, torch.randn(1, 16, 2, 4, 4), node_id="12/../7:sub")
    assert path is not None and path.is_file() and path.parent == tmp_path / "previews"
    monkeypatch.setenv("WORLD_SIZE", "4")  # a torchrun world (--jobs: group leaders preview different jobs at once)
    monkeypatch.setenv("RANK", "2")
    path = Previewer("denoise", comfy=False).write(3, torch.randn(1, 16, 2, 4, 4), node_id="12")
    assert path is not None and path.is_file() and path.parent == tmp_path / "previews" / "rank2"


def test_the_python_api_has_the_nodes_limits(fixtures_root):
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.stages import generate
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    limits = stage_inputs.LIMITS
    schema = NODE_CLASS_MAPPINGS["LingBotDenoise"].INPUT_TYPES()["required"]
    assert schema["steps"][1]["max"] == limits["steps"] and schema["frames"][1]["max"] == limits["frames"]
    assert schema["width"][1]["max"] == limits["size"]
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    for kwargs, name in (({"steps": 10**9}, "steps"), ({"num_frames": 4 * 10**6 + 1}, "num_frames"),
                         ({"height": 16 * 10**4}, "height")):
        start = time.perf_counter()
        with pytest.raises(ValueError, match=name):
            generate(handle, "a cat", **kwargs)
        assert time.perf_counter() - start < 5  # refused, not allocated


@pytest.mark.parametrize("value", [None, 5, True, {"a": 1}])
def test_a_non_string_attention_is_refused_at_validation(value):
    from lingbot_core.workflow import Engine, WorkflowValidationError
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    prompt = json.loads((API / "lingbot_t2v_dense.json").read_text())
    loader = next(k for k, v in prompt.items() if v["class_type"] == "LingBotLoader")
    prompt[loader]["inputs"]["attention"] = value
    with pytest.raises(WorkflowValidationError, match="attention"):
        Engine(NODE_CLASS_MAPPINGS).validate(copy.deepcopy(prompt))


def test_the_loader_refuses_a_null_attention_when_it_runs():
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    loader = NODE_CLASS_MAPPINGS["LingBotLoader"]
    with pytest.raises(ValueError, match="attention must be one of"):
        loader.execute("tiny (built-in dense)", "auto", "auto", None)


def test_refine_says_when_it_drops_frames(fixtures_root, caplog):
    from lingbot_core.handle import PipelineHandle

    assert stage_inputs.refine_frames_notice(9) is None
    assert "first 5" in stage_inputs.refine_frames_notice(6) and "drops the last 1" in stage_inputs.refine_frames_notice(6)
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu")
    with caplog.at_level(logging.WARNING, logger="lingbot_core.stage_inputs"):
        usable = stage_inputs.check_refine_request(handle, torch.rand(6, 32, 32, 3), height=64, width=64, steps=2,
                                                   shift=3.0, t_thresh=0.85, tail_steps=0, seed=0, first_frame=None)
    assert usable == 5 and any("drops the last 1" in r.getMessage() for r in caplog.records)


@pytest.fixture
def comfy(tmp_path, monkeypatch):
    """A stand-in folder_paths whose get_save_image_path behaves as ComfyUI's: it checks the folder with
    abspath (links not followed) and creates it before returning."""
    out, models = tmp_path / "output", tmp_path / "models"
    out.mkdir()
    (models / "lingbot_video").mkdir(parents=True)
    (models / "loras").mkdir()
    fp = types.ModuleType("folder_paths")
    fp.models_dir = str(models)
    fp.folder_names_and_paths = {"lingbot_video": ([str(models / "lingbot_video")], set()),
                                 "loras": ([str(models / "loras")], set())}
    fp.get_folder_paths = lambda name: fp.folder_names_and_paths[name][0]
    fp.get_output_directory = lambda: str(out)

    def get_save_image_path(prefix, output_dir, width=0, height=0):
        subfolder, name = os.path.dirname(os.path.normpath(prefix)), os.path.basename(os.path.normpath(prefix))
        full = os.path.join(output_dir, subfolder)
        if os.path.commonpath((output_dir, os.path.abspath(full))) != output_dir:
            raise Exception("Saving image outside the output folder is not allowed.")
        os.makedirs(full, exist_ok=True)
        return full, name, 1, subfolder, prefix

    fp.get_save_image_path = get_save_image_path
    monkeypatch.setitem(sys.modules, "folder_paths", fp)
    monkeypatch.setitem(sys.modules, "comfy", types.ModuleType("comfy"))
    monkeypatch.delenv("LINGBOT_ALLOW_ANY_MODEL_PATH", raising=False)
    return types.SimpleNamespace(tmp=tmp_path, output=out, models=models)


def test_a_save_prefix_through_an_operators_link_creates_nothing_outside(comfy):
    from lingbot_nodes import paths

    outside = comfy.tmp / "elsewhere"
    outside.mkdir()
    (comfy.output / "shared").symlink_to(outside, target_is_directory=True)
    with pytest.raises(UnsafePrefix, match="outside the output folder"):
        paths.save_target("shared/new/video")
    assert list(outside.iterdir()) == []  # no empty folder made outside


def test_dropdowns_list_only_what_the_path_checks_accept(comfy, fixtures_root):
    from lingbot_nodes.loader import checkpoint_choices, resolve_checkpoint
    from lingbot_nodes.lora import lora_choices

    away = comfy.tmp / "away"
    away.mkdir()
    (away / "x.safetensors").write_bytes(b"")
    (comfy.models / "loras" / "linked.safetensors").symlink_to(away / "x.safetensors")
    (comfy.models / "loras" / "real.safetensors").write_bytes(b"")
    assert lora_choices()[1:] == ["real.safetensors"]
    shutil.copytree(fixtures_root / "models" / "tiny-dense", away / "ckpt")
    shutil.copytree(fixtures_root / "models" / "tiny-dense", comfy.models / "lingbot_video" / "here")
    (comfy.models / "lingbot_video" / "linked").symlink_to(away / "ckpt", target_is_directory=True)
    names = checkpoint_choices()
    assert "here" in names and "linked" not in names
    with pytest.raises(ValueError, match="not found"):
        resolve_checkpoint("linked")
