"""Issue 34 (the file surfaces): single-file configs bounded before any skeleton is built, headers
refused where safetensors would refuse them, files that change while read, lone surrogates, the
files Loader's attention check, and the smaller holes. Hangs and kills run forked with limits."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from bench._common import run_limited
from bench.fuzz_single_files import write_reshaped_q4k_gguf
from lingbot_core.errors import CheckpointError, WeightsError
from lingbot_nodes import NODE_CLASS_MAPPINGS
from lingbot_nodes import files as node_files
from tests.test_loader_files import comfy_folders  # noqa: F401 (a fixture)

FILES_LOADER = NODE_CLASS_MAPPINGS["LingBotLoaderFiles"]
LOADER = NODE_CLASS_MAPPINGS["LingBotLoader"]
TINY = Path(__file__).resolve().parent / "fixtures" / "lingbot" / "models" / "tiny-dense"
REPO = Path(__file__).resolve().parents[1]


# -- helpers ----------------------------------------------------------------------------------------

def raw_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]], *, gap: int = 0,
                    trailing: bytes = b"", metadata: object = None) -> Path:
    """A safetensors file written by hand: (dtype, shape, bytes) per tensor, in order; `gap` unused
    bytes before the second tensor, `trailing` bytes after the last."""
    header: dict = {} if metadata is None else {"__metadata__": metadata}
    data, at = b"", 0
    for i, (name, (dtype, shape, raw)) in enumerate(tensors.items()):
        if i == 1 and gap:
            data += b"\0" * gap
            at += gap
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(raw)]}
        data += raw
        at += len(raw)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data + trailing)
    return path


def limited(fn, *args, seconds: float = 20, memory: int = 1 << 30) -> tuple[str, str]:
    """`fn(*args)` in a memory- and time-limited child: ("ok", ""), (exception type, message), ("hang", "")
    or ("killed", exit code)."""
    status, value = run_limited(lambda: fn(*args) and None, seconds=seconds, memory=memory)  # the value stays in the child
    if status == "raised":
        return value
    return {"ok": ("ok", ""), "hang": ("hang", ""), "died": ("killed", str(value))}[status]


# -- item 10: the files Loader validates attention as the Loader does ---------------------------------

@pytest.mark.parametrize("value", ["bogus", 3, ["x"]])
def test_files_loader_refuses_a_bad_attention_like_the_loader(value):
    mine, theirs = FILES_LOADER.validate_inputs(attention=value), LOADER.validate_inputs(attention=value)
    assert mine is not True and str(mine) == str(theirs)
    assert "attention must be one of" in str(mine) and "{" not in str(mine)  # a sentence, not a dict repr


def test_files_loader_refuses_a_null_attention_before_opening_anything(tmp_path):
    with pytest.raises(ValueError, match="attention must be one of"):
        FILES_LOADER.execute(node_files.FROM_CHECKPOINT, node_files.FROM_CHECKPOINT, node_files.FROM_CHECKPOINT,
                             "none", attention=None, dit_path=str(tmp_path / "absent.safetensors"))


# -- item 1: single-file configs bounded before the skeleton ------------------------------------------

def _f32(*shape: int) -> tuple[str, list[int], bytes]:
    return "F32", list(shape), bytes(4 * int(np.prod(shape)))


def _hostile_vae(path: Path) -> Path:
    """592 bytes of diffusers-named Wan VAE whose one zero-size tensor claims 100,001 residual blocks."""
    return raw_safetensors(path, {
        "decoder.mid_block.resnets.0.norm1.gamma": _f32(0),
        "encoder.conv_in.weight": ("F32", [96, 3, 3, 3, 0], b""),
        "post_quant_conv.weight": ("F32", [16, 16, 1, 1, 0], b""),
        "decoder.conv_out.weight": ("F32", [3, 96, 3, 3, 0], b""),
        "encoder.down_blocks.0.conv1.weight": ("F32", [96, 96, 3, 3, 0], b""),
        "decoder.up_blocks.0.resnets.100000.norm1.gamma": _f32(0)})


def _inspect_vae(path: Path) -> None:
    from lingbot_core.checkpoints.vae_file import inspect_vae_file

    inspect_vae_file(path)


def test_a_vae_file_claiming_100000_blocks_is_refused_before_its_skeleton(tmp_path):
    kind, message = limited(_inspect_vae, _hostile_vae(tmp_path / "v.safetensors"), seconds=30)
    assert kind == "CheckpointError", (kind, message)
    assert "num_res_blocks" in message and "v.safetensors" in message and "\n" not in message


def _tiny_te(tmp_path: Path, change) -> Path:
    state = load_file(str(TINY / "text_encoder" / "model.safetensors"))
    change(state)
    path = tmp_path / "te.safetensors"
    save_file(state, str(path))
    return path


def test_a_text_encoder_with_an_empty_q_norm_is_refused_not_a_zero_division(tmp_path):
    from lingbot_core.checkpoints.text_encoder_file import inspect_text_encoder_file

    path = _tiny_te(tmp_path, lambda s: s.__setitem__("model.language_model.layers.0.self_attn.q_norm.weight",
                                                       torch.zeros(0)))
    with pytest.raises(CheckpointError, match=r"te\.safetensors: tensor .*q_norm.* no empty dimension"):
        inspect_text_encoder_file(path)


def test_a_text_encoder_with_too_many_layers_is_refused_by_its_bounds(tmp_path):
    from lingbot_core.checkpoints.text_encoder_file import inspect_text_encoder_file

    def deep(state):
        for i in range(300):
            state[f"model.language_model.layers.{i}.extra"] = torch.zeros(0)

    with pytest.raises(CheckpointError, match=r"num_hidden_layers' must be .* no larger than 256"):
        inspect_text_encoder_file(_tiny_te(tmp_path, deep))


def test_a_comfy_quant_entry_nested_4096_deep_is_a_checkpoint_error(tmp_path):
    from lingbot_core.checkpoints.text_encoder_file import inspect_text_encoder_file

    def nested(state):
        name = "model.language_model.layers.0.mlp.gate_proj"
        state[f"{name}.weight"] = state[f"{name}.weight"].to(torch.float8_e4m3fn)
        state[f"{name}.weight_scale"] = torch.ones(1)
        state[f"{name}.comfy_quant"] = torch.frombuffer(bytearray(b"[" * 4096), dtype=torch.uint8)

    with pytest.raises(CheckpointError, match=r"comfy_quant does not hold JSON"):
        inspect_text_encoder_file(_tiny_te(tmp_path, nested))


def test_a_dit_tensor_with_a_5000_digit_index_is_refused_in_one_line(tmp_path):
    from lingbot_core.checkpoints.dit_file import dit_file_source

    path = tmp_path / "dit.safetensors"
    shutil.copy(TINY / "transformer" / "diffusion_pytorch_model.safetensors", path)
    state = load_file(str(path))
    state["blocks." + "9" * 5000 + ".x"] = torch.zeros(1)
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match=r"an index of more than 6 digits") as err:
        dit_file_source(path)
    assert len(str(err.value)) < 600


# -- item 2: our header check refuses what safe_open refuses ------------------------------------------

def _safe_open_refuses(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():
                fh.get_tensor(key)
    except Exception:  # safetensors' own SafetensorError
        return True
    return False


@pytest.mark.parametrize("layout", ["gap", "trailing", "gap_at_start", "metadata_not_strings"])
def test_header_check_refuses_what_safe_open_refuses(tmp_path, layout):
    from lingbot_core.weights.safetensors_header import read_safetensors_file

    tensors = {"a": _f32(2), "b": _f32(3)}
    path = tmp_path / "x.safetensors"
    if layout == "gap":
        raw_safetensors(path, tensors, gap=8)
    elif layout == "trailing":
        raw_safetensors(path, tensors, trailing=b"\0" * 4)
    elif layout == "gap_at_start":
        text = json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(8))
    else:
        raw_safetensors(path, tensors, metadata={"format": 1})
    assert _safe_open_refuses(path)
    with pytest.raises(CheckpointError, match=r"x\.safetensors"):
        read_safetensors_file(path)


def test_a_vae_file_with_a_gap_is_refused_at_inspection_naming_it(tmp_path):
    from lingbot_core.checkpoints.vae_file import inspect_vae_file

    state = load_file(str(TINY / "vae" / "diffusion_pytorch_model.safetensors"))
    tensors = {k: (("F32", list(v.shape), v.float().contiguous().numpy().tobytes())) for k, v in state.items()}
    path = raw_safetensors(tmp_path / "wan_vae.safetensors", tensors, gap=64)
    assert _safe_open_refuses(path)
    with pytest.raises(CheckpointError, match=r"wan_vae\.safetensors: 64 unused bytes"):
        inspect_vae_file(path)


# -- item 8: files that change while read --------------------------------------------------------------

def _walk_a_gguf_truncated_midway(path: Path) -> None:
    from lingbot_core.weights import gguf_file

    real = gguf_file._Walk.string

    def string(self, what, limit=None):
        if what.startswith("metadata key 1"):
            os.truncate(path, 40)  # a download restarted, a copy being written over
        return real(self, what, limit)

    gguf_file._Walk.string = string
    gguf_file.read_header(path)


def _small_gguf(path: Path) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "lingbot_video")
    writer.add_string("general.name", "x" * 4096)
    writer.add_array("some.numbers", list(range(300000)))
    writer.add_tensor("w", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_truncated_during_the_header_walk_is_an_error_not_sigbus(tmp_path):
    kind, message = limited(_walk_a_gguf_truncated_midway, _small_gguf(tmp_path / "m.gguf"))
    assert kind == "GGUFError", (kind, message)  # was: the child killed by SIGBUS
    assert "m.gguf" in message and "changed while" in message


def test_disk_offload_refuses_a_file_replaced_since_it_was_loaded(tmp_path):
    from lingbot_core.weights.sources import SafetensorsSource

    path = tmp_path / "dit.safetensors"
    save_file({"w": torch.arange(8, dtype=torch.float32)}, str(path))
    source = SafetensorsSource([path])
    span = source.span("w", torch.float32, (8,))
    assert span.read(torch.device("cpu")).tolist() == list(range(8))
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.full((8,), 7.0)}, str(other))  # the same size and layout: another model
    os.replace(other, path)
    with pytest.raises(WeightsError, match=r"dit\.safetensors was replaced by another file since it was loaded"):
        span.read(torch.device("cpu"))


# -- item 9: lone surrogates refused where the text is validated ----------------------------------------

@pytest.mark.parametrize("prompt", ["a red \ud83d boat", '{"caption": "a boat \\udc00"}'])
def test_a_lone_surrogate_in_a_prompt_is_refused_at_validation(prompt):
    node = NODE_CLASS_MAPPINGS["LingBotTextEncode"]
    message = node.validate_inputs(prompt=prompt)
    assert isinstance(message, str) and "lone UTF-16 surrogate" in message and "\n" not in message


def test_a_lone_surrogate_in_a_negative_prompt_or_prefix_is_refused():
    from lingbot_core.save_path import UnsafePrefix, split_prefix
    from lingbot_core.stage_inputs import check_negative_prompt

    with pytest.raises(ValueError, match="negative_prompt holds a lone UTF-16 surrogate"):
        check_negative_prompt("blurry \udfff")
    with pytest.raises(UnsafePrefix, match="filename_prefix holds a lone UTF-16 surrogate"):
        split_prefix("lingbot/clip\ud800")
    assert NODE_CLASS_MAPPINGS["LingBotSaveVideo"].validate_inputs(filename_prefix="x\ud800") is not True


def test_a_rewritten_caption_with_a_lone_surrogate_has_a_problem():
    from lingbot_core.caption_schema import caption_problems

    problems = caption_problems({"caption": {"comprehensive_description": {"scene_content_description": "a \ud83d"}},
                                 "duration": 1.0}, 1.0)
    assert any("lone UTF-16 surrogate" in p for p in problems)


# -- item 12: a GGUF tensor recorded in rows that are not whole blocks is decoded at load --------------

def test_a_dit_gguf_with_a_reshaped_tensor_loads_it_decoded(tmp_path):
    import gguf
    from gguf import GGMLQuantizationType as T

    from lingbot_core.checkpoints.dit_file import dit_file_source
    from lingbot_core.weights.loader import load_dit

    state = load_file(str(TINY / "transformer" / "diffusion_pytorch_model.safetensors"))
    # RESHAPED_TENSOR is [32, 64]: rows of 64 values, not whole Q4_K blocks (256)
    path = tmp_path / "lingbot-q4k.gguf"
    blocks = write_reshaped_q4k_gguf(state, path)
    expected = gguf.quants.dequantize(np.frombuffer(blocks, np.uint8).reshape(8, 144), T.Q4_K).reshape(32, 64)
    model = load_dit(dit_file_source(path))  # was: refused ("not whole Q4_K blocks")
    weight = model.blocks[0].ffn.down_proj.weight
    assert tuple(weight.shape) == (32, 64) and weight.dtype == torch.float32
    np.testing.assert_array_equal(weight.detach().numpy(), expected)


# -- item 11: the smaller holes --------------------------------------------------------------------------

def test_a_20mb_tensor_name_makes_a_short_message(tmp_path):
    from lingbot_core.weights.checks import tensor_set_problems

    long = "blocks.0." + "x" * (20 << 20)
    problems = tensor_set_problems({long: (1,), "a": (2,)}, {"a": (3,), "b": (1,)})
    assert len("; ".join(problems)) < 1000 and "unexpected" in problems[1]


def test_a_long_tensor_name_in_a_vae_file_makes_a_short_message(tmp_path):
    from lingbot_core.checkpoints.vae_file import inspect_vae_file

    state = load_file(str(TINY / "vae" / "diffusion_pytorch_model.safetensors"))
    state["decoder." + "y" * (2 << 20)] = torch.zeros(1)
    path = tmp_path / "vae.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match="unexpected tensors") as err:
        inspect_vae_file(path)
    assert len(str(err.value)) < 2000


def test_an_integer_dit_weight_is_refused(tmp_path):
    from lingbot_core.checkpoints.dit_file import dit_file_source
    from lingbot_core.weights.loader import load_dit

    state = load_file(str(TINY / "transformer" / "diffusion_pytorch_model.safetensors"))
    state["blocks.0.attn.to_q.weight"] = (state["blocks.0.attn.to_q.weight"] * 100).to(torch.int32)
    path = tmp_path / "dit.safetensors"
    save_file(state, str(path))
    with pytest.raises(WeightsError, match=r"blocks\.0\.attn\.to_q\.weight .* stored as int32"):
        load_dit(dit_file_source(path))


@pytest.mark.parametrize("key, value", [("rope_theta", 1e-300), ("norm_eps", 1e300), ("rope_theta", 1e308)])
def test_dit_config_floats_have_real_bounds(key, value):
    from lingbot_core.checkpoints.configs import FLOAT_RANGES, check_transformer_config
    from lingbot_core.tiny import tiny_dit_config

    config = tiny_dit_config("dense")
    check_transformer_config(config, "cfg")
    low, high = FLOAT_RANGES[key]
    assert low <= config[key] <= high  # the shipped value is inside
    with pytest.raises(CheckpointError, match=f"'{key}' must be a number in"):
        check_transformer_config({**config, key: value}, "cfg")


def test_routed_scaling_factor_and_shift_have_real_bounds():
    from lingbot_core.checkpoints.configs import check_scheduler_config, check_transformer_config
    from lingbot_core.sampling.sigmas import SHIFT_RANGE, check_shift
    from lingbot_core.tiny import tiny_dit_config

    moe = tiny_dit_config("moe")
    with pytest.raises(CheckpointError, match="routed_scaling_factor"):
        check_transformer_config({**moe, "routed_scaling_factor": 1e308}, "cfg")
    with pytest.raises(CheckpointError, match="'shift' must be a number in"):
        check_scheduler_config({"shift": 1e308}, "cfg")
    with pytest.raises(ValueError, match="shift must be a positive number in"):
        check_shift(1e308)
    check_shift(SHIFT_RANGE[1])
    for node in ("LingBotDenoise", "LingBotRefine"):  # the nodes' widget range is the same range
        spec = NODE_CLASS_MAPPINGS[node].INPUT_TYPES()
        shift = {**spec["required"], **spec.get("optional", {})}["shift"][1]
        assert (shift["min"], shift["max"]) == SHIFT_RANGE


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_a_fifo_directory_or_device_is_named_for_what_it_is(tmp_path, kind):
    from lingbot_core.checkpoints.dit_file import dit_file_source
    from lingbot_core.checkpoints.text_encoder_file import inspect_text_encoder_file
    from lingbot_core.checkpoints.vae_file import inspect_vae_file

    path = tmp_path / "model.safetensors"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    says = {"fifo": "is a FIFO", "directory": "is a directory", "device": "is a device"}[kind]
    for inspect in (inspect_vae_file, inspect_text_encoder_file, dit_file_source):
        with pytest.raises(CheckpointError, match=says) as err:
            inspect(path)
        assert "does not exist" not in str(err.value)


def test_too_many_tensors_are_refused_before_the_header_is_parsed(tmp_path, monkeypatch):
    from lingbot_core.weights import safetensors_header as sh

    count = sh.MAX_TENSORS + 1
    body = ",".join(f'"t{i}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}' for i in range(count))
    text = ("{" + body + "}").encode()
    path = tmp_path / "many.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text)

    def parse(*args):
        raise AssertionError("the header was parsed")

    monkeypatch.setattr(sh, "parse_json_text", parse)
    with pytest.raises(CheckpointError, match=f"declares {count} tensors"):
        sh.read_safetensors_file(path)


_SLOW_IMPORT = """
import os, sys, time
MARKER = sys.argv[1]
class Slow:
    def find_spec(self, name, path=None, target=None):
        if name == "lingbot_core.components":  # the first of quantize's own imports
            open(MARKER, "w").close()
            time.sleep(30)
        return None
sys.meta_path.insert(0, Slow())
sys.argv = ["quantize", MARKER + ".src", MARKER + ".dst", "--to", "fp8"]
import runpy
runpy.run_module("lingbot_core.quantize", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_while_quantize_imports_is_one_line(tmp_path):
    marker = tmp_path / "importing"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_IMPORT, str(marker)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert marker.exists(), proc.communicate()[1].decode()[-2000:]
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130 and err.decode().strip() == "quantize: interrupted.", err.decode()[-2000:]


def test_a_processor_file_linking_out_of_the_model_folders_is_refused(comfy_folders, tmp_path,  # noqa: F811
                                                                      monkeypatch):
    monkeypatch.delenv("LINGBOT_ALLOW_ANY_MODEL_PATH", raising=False)
    models = comfy_folders
    processor = models / "text_encoders" / "lingbot-processor"
    shutil.copytree(TINY / "processor", processor)
    assert node_files.resolve_processor(node_files.AUTO, str(processor), None) == processor
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    (processor / "tokenizer.json").unlink()
    (processor / "tokenizer.json").symlink_to(secret)
    with pytest.raises(ValueError, match="'tokenizer.json' in 'lingbot-processor' links outside"):
        node_files.resolve_processor(node_files.AUTO, str(processor), None)


# -- cancellable waits: skeleton builds and header walks check interrupts ---------------------------

class _Cancelled(Exception):
    pass


def test_a_skeleton_build_stops_at_a_cancel_and_the_cancel_is_not_rewrapped(monkeypatch):
    from lingbot_core import interrupt
    from lingbot_core.interrupt import interrupt_checker

    monkeypatch.setattr(interrupt, "BUILD_CHECK_EVERY", 0.0)  # every parameter: the tiny build is fast
    from lingbot_core.tiny import tiny_dit_config
    from lingbot_core.weights.checks import dit_shapes

    calls = []

    def cancel():
        calls.append(1)
        if len(calls) > 5:
            raise _Cancelled("cancelled")

    config = {**tiny_dit_config("dense"), "depth": 7}  # not memoized by another test
    with interrupt_checker(cancel), pytest.raises(_Cancelled):
        dit_shapes(config, "cfg")
    assert len(calls) == 6  # stopped at the sixth parameter, not after the whole build


def test_a_gguf_header_walk_checks_interrupts(tmp_path):
    import gguf

    from lingbot_core.interrupt import interrupt_checker
    from lingbot_core.weights.gguf_file import read_header

    path = tmp_path / "many.gguf"
    writer = gguf.GGUFWriter(str(path), "lingbot_video")
    for i in range(5000):
        writer.add_uint32(f"k.{i}", i)
    writer.add_tensor("w", np.zeros((1, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    calls = []
    with interrupt_checker(lambda: calls.append(1)):
        read_header(path)
    assert len(calls) >= 4


def test_the_files_loader_opens_under_the_interrupt_checker(tmp_path, monkeypatch):
    from lingbot_nodes import runtime
    from tests.test_loader_files import single_files

    files = single_files(tmp_path / "models")

    def cancel():
        raise _Cancelled("cancelled")

    monkeypatch.setattr(runtime, "interrupt_check", lambda: cancel)
    with pytest.raises(_Cancelled):  # was: the whole open ran, the cancel unseen
        FILES_LOADER.execute(node_files.FROM_CHECKPOINT, node_files.FROM_CHECKPOINT, node_files.FROM_CHECKPOINT,
                             "none", dit_path=str(files["dit"]), vae_path=str(files["vae"]),
                             text_encoder_path=str(files["text_encoder"]), processor_path=str(files["processor"]))


def test_a_rewriter_prompt_with_a_lone_surrogate_is_refused_before_any_call():
    from lingbot_core.rewrite.core import RewriteRequest

    with pytest.raises(ValueError, match="the rewriter's prompt holds a lone UTF-16 surrogate"):
        RewriteRequest("a red \ud83d boat", "t2v", 5.0).checked()


def test_a_checkpoint_whose_processor_links_outside_is_refused(comfy_folders, tmp_path, monkeypatch):  # noqa: F811
    from lingbot_nodes.loader import resolve_checkpoint

    monkeypatch.delenv("LINGBOT_ALLOW_ANY_MODEL_PATH", raising=False)
    folder = comfy_folders / "lingbot_video" / "mine"
    shutil.copytree(TINY, folder)
    assert resolve_checkpoint("mine") == folder
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    (folder / "processor" / "tokenizer.json").unlink()
    (folder / "processor" / "tokenizer.json").symlink_to(secret)
    with pytest.raises(ValueError, match="'processor/tokenizer.json' in 'mine' links outside"):
        resolve_checkpoint("mine")
    assert resolve_checkpoint(next(iter(node_files.TINY)))  # the built-in tiny checkpoint lives in the cache


def test_a_typed_file_path_that_is_a_fifo_says_so(tmp_path):
    fifo = tmp_path / "dit.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is a FIFO"):
        node_files.resolve_file("dit", node_files.FROM_CHECKPOINT, str(fifo))


def test_the_loader_opens_under_the_interrupt_checker(monkeypatch):
    from lingbot_nodes import runtime

    def cancel():
        raise _Cancelled("cancelled")

    monkeypatch.setattr(runtime, "interrupt_check", lambda: cancel)
    with pytest.raises(_Cancelled):
        LOADER.execute(next(iter(node_files.TINY)), "auto", "auto", "default")
