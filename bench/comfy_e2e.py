"""End-to-end check of the pack inside a real ComfyUI, over its HTTP API (not run by CI: it needs ComfyUI).

    python bench/comfy_e2e.py COMFYUI_DIR [--python PY] [--port 8199]
    python bench/comfy_e2e.py COMFYUI_DIR --url http://127.0.0.1:8188   # a server you started yourself
    python bench/comfy_e2e.py COMFYUI_DIR --skip workflows files advice interrupt --parallel   # LingBot Parallel only

Run it with a Python that has this pack's requirements and aiohttp (ComfyUI's own Python does). The pack must
already be in `COMFYUI_DIR/custom_nodes/` (a copy or a link of this folder). Without `--url` the script starts
`main.py --cpu` itself with `--python` (default: this interpreter) and stops it at the end.

What it checks, each printed as PASS/FAIL with the reason (exit status 1 if any failed):
- the pack imported: every node of the registry is in `/object_info`, and the console shows no import failure;
- every shipped API-format workflow (`workflows/api/*.json`) is accepted by `POST /prompt` and runs to the end
  on the built-in tiny model (one with a local Rewrite is refused at once with the rewriter's message instead:
  the tiny text encoder's random weights write no caption);
- Loader (files) lists files placed in `diffusion_models` / `unet`, `vae`, `text_encoders` / `clip` (the tiny
  checkpoint copied there as single files, under `lingbot_e2e_*` names removed at the end) and runs from them;
- on a checkpoint as wide as the published ones (a one-block stand-in), the few-step workflows without their
  LoRA / student run and say so on Denoise (and LoRA, Loader) as the text the editor shows;
- `POST /interrupt` in the middle of Denoise stops the run, and the next run's latents equal, bit for bit, those
  of a run that was never interrupted (core `SaveLatent`, read back through `/view`);
- `POST /free` (unload models, and free the node cache) answers, and the next run is again bit-identical;
- with `--parallel` (last; needs the server the script starts): a LingBot Parallel node between Loader and
  Offload ('none') runs and its latents equal the single-device run's bit for bit; a second prompt reuses the
  workers (no new start in the log, same pids); an interrupt mid-Denoise leaves the next run exact and keeps the workers; POST /free
  (unload models) stops the worker processes, twice; a LingBot Release on the parallel pipe stops them and the
  next prompt starts new ones, exact; a worker killed between prompts gives the next prompt a clear error and
  the pipe without LingBot Parallel still runs, exact; the MoE's Refine on a parallel pipe equals the
  single-device Refine (bit for bit with cfg alone, within float rounding with a ulysses share); SIGINT to main.py leaves no worker process;
- the Loader's `ffn_chunk` (a chunk shorter than the sequence) changes no bit of Denoise's latents (dense), and
  Refine's (MoE, in the `--parallel` section) only within float rounding; the Memory Report names the chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / "workflows" / "api"
PREFIX = "lingbot_e2e"
RESULTS: list[tuple[bool, str, str]] = []
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # lingbot_core, as the pack itself does inside ComfyUI


def record(ok: bool, name: str, detail: str = "") -> bool:
    RESULTS.append((ok, name, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    return ok


def pack_nodes() -> dict[str, Any]:
    """The pack's NODE_CLASS_MAPPINGS, from its own registry (`nodes/` loaded as `lingbot_nodes`, as it is
    installed; this checkout's `lingbot_core` on the path)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if "lingbot_nodes" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "lingbot_nodes", ROOT / "nodes" / "__init__.py", submodule_search_locations=[str(ROOT / "nodes")])
        module = importlib.util.module_from_spec(spec)
        sys.modules["lingbot_nodes"] = module
        spec.loader.exec_module(module)
    return sys.modules["lingbot_nodes"].NODE_CLASS_MAPPINGS


def node_registry() -> list[str]:
    """The pack's node ids, from its own registry."""
    return list(pack_nodes())


class Server:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.client_id = uuid.uuid4().hex

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=60) as r:
            return json.loads(r.read() or b"null")

    def raw(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=60) as r:
            return r.read()

    def post(self, path: str, body: dict) -> tuple[int, Any]:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                data = r.read()
                return r.status, json.loads(data) if data else None
        except urllib.error.HTTPError as e:
            data = e.read()
            try:
                return e.code, json.loads(data)
            except ValueError:
                return e.code, data.decode(errors="replace")

    def queue(self, prompt: dict) -> tuple[str | None, Any]:
        code, body = self.post("/prompt", {"prompt": prompt, "client_id": self.client_id})
        if code != 200:
            return None, body
        return body["prompt_id"], body

    def wait(self, prompt_id: str, timeout: float = 900) -> dict:
        end = time.time() + timeout
        while time.time() < end:
            history = self.get(f"/history/{prompt_id}")
            if prompt_id in history and history[prompt_id].get("status", {}).get("completed") is not None:
                return history[prompt_id]
            time.sleep(0.5)
        raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout:.0f} s")

    def run(self, prompt: dict, timeout: float = 900) -> tuple[dict | None, Any]:
        prompt_id, body = self.queue(prompt)
        if prompt_id is None:
            return None, body
        return self.wait(prompt_id, timeout), None

    def latent(self, entry: dict, node: str) -> Any:
        """The LATENT that core SaveLatent `node` wrote in this run, read back through /view."""
        from safetensors.torch import load

        saved = entry["outputs"][node]["latents"][0]
        query = urllib.parse.urlencode(saved)
        return load(self.raw(f"/view?{query}"))["latent_tensor"]


def errors_of(entry: dict) -> str:
    out = []
    for kind, data in entry.get("status", {}).get("messages", []):
        if kind in ("execution_error", "execution_interrupted"):
            out.append(f"{kind} in {data.get('node_type')}: {data.get('exception_message', '')}".strip())
    return "; ".join(out)


def find_node(prompt: dict, class_type: str) -> str:
    return next(k for k, v in prompt.items() if v["class_type"] == class_type)


# ------------------------------------------------------------------------------------------------- checks

def check_import(server: Server, log_text: str | None, folder: str = ROOT.name) -> None:
    """`folder`: the pack's name in custom_nodes/ (ComfyUI's console names the pack by it)."""
    info = server.get("/object_info")
    missing = [n for n in node_registry() if n not in info]
    record(not missing, "pack imported: every registry node is in /object_info",
           f"missing {missing}" if missing else f"{len(node_registry())} nodes")
    if log_text is not None:
        bad = [line for line in log_text.splitlines()
               if ("IMPORT FAILED" in line or "Cannot import" in line) and f"custom_nodes/{folder}" in line]
        record(not bad, "no import failure of the pack on the console", "; ".join(bad[:3]))
    extensions = server.get("/extensions")
    record(any(e.endswith("/lingbot_text.js") for e in extensions), "the editor extension is served",
           str([e for e in extensions if "lingbot" in e]))


def check_workflows(server: Server) -> None:
    for path in sorted(WORKFLOWS.glob("*.json")):
        prompt = json.loads(path.read_text())
        local_rewrite = [k for k, v in prompt.items() if v["class_type"] == "LingBotRewrite" and
                         not v["inputs"].get("endpoint")]
        start = time.time()
        entry, refused = server.run(prompt)
        if entry is None:
            record(False, f"workflow {path.name} queues", json.dumps(refused)[:600])
            continue
        ok = entry["status"]["status_str"] == "success"
        # a node with nothing to say sends an empty text (it clears its box): only what was said is shown
        texts = [t for out in entry["outputs"].values() for t in out.get("text", []) if t.strip()]
        shown = f"; on nodes: {' | '.join(t.splitlines()[0] for t in texts)}" if texts else ""
        if local_rewrite:
            # A local Rewrite needs a real text encoder: on the built-in tiny model it is refused at once with
            # the rewriter's own message (not a crash elsewhere, not minutes of random tokens). With a real checkpoint the workflow runs as shipped.
            error = errors_of(entry)
            record(ok or "tiny checkpoint has random weights" in error,
                   f"workflow {path.name} runs, or (tiny text encoder) stops with the rewriter's message",
                   f"{time.time() - start:.1f} s; " + ("ran" if ok else error[:160]))
            continue
        record(ok, f"workflow {path.name} runs to the end",
               (f"{time.time() - start:.1f} s{shown}" if ok else errors_of(entry)))


def place_single_files(comfy: Path) -> dict[str, str]:
    """The tiny dense checkpoint copied into ComfyUI's model folders as the single files users keep."""
    from lingbot_core.tiny import ensure_tiny_checkpoint

    tiny = ensure_tiny_checkpoint("dense")
    models = comfy / "models"
    placed = {
        "dit": (tiny / "transformer" / "diffusion_pytorch_model.safetensors", models / "diffusion_models"),
        "dit_unet": (tiny / "transformer" / "diffusion_pytorch_model.safetensors", models / "unet"),
        "vae": (tiny / "vae" / "diffusion_pytorch_model.safetensors", models / "vae"),
        "text_encoder": (tiny / "text_encoder" / "model.safetensors", models / "text_encoders"),
        "text_encoder_clip": (tiny / "text_encoder" / "model.safetensors", models / "clip"),
    }
    names = {}
    for key, (src, folder) in placed.items():
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{PREFIX}_{key}.safetensors"
        shutil.copyfile(src, folder / name)
        names[key] = name
    shutil.copytree(tiny / "processor", models / "text_encoders" / f"{PREFIX}_processor", dirs_exist_ok=True)
    names["processor"] = str(models / "text_encoders" / f"{PREFIX}_processor")
    return names


def remove_single_files(comfy: Path) -> None:
    for folder in ("diffusion_models", "unet", "vae", "text_encoders", "clip"):
        for path in (comfy / "models" / folder).glob(f"{PREFIX}_*"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def check_loader_files(server: Server, comfy: Path) -> None:
    names = place_single_files(comfy)
    try:
        required = server.get("/object_info/LingBotLoaderFiles")["LingBotLoaderFiles"]["input"]["required"]
        for socket, keys in (("dit", ("dit", "dit_unet")), ("vae", ("vae",)),
                             ("text_encoder", ("text_encoder", "text_encoder_clip"))):
            listed = required[socket][0]
            missing = [names[k] for k in keys if names[k] not in listed]
            record(not missing, f"Loader (files) lists {socket} files from its folders",
                   f"missing {missing} in {listed}" if missing else ", ".join(names[k] for k in keys))
        prompt = json.loads((WORKFLOWS / "lingbot_t2v_dense_files.json").read_text())
        loader = prompt[find_node(prompt, "LingBotLoaderFiles")]["inputs"]
        loader.update(dit=names["dit_unet"], vae=names["vae"], text_encoder=names["text_encoder_clip"],
                      checkpoint="none", processor_path=names["processor"])
        entry, refused = server.run(prompt)
        ok = entry is not None and entry["status"]["status_str"] == "success"
        record(ok, "Loader (files) runs from single files (unet, vae, clip) with checkpoint none",
               "" if ok else (errors_of(entry) if entry else json.dumps(refused)[:600]))
    finally:
        remove_single_files(comfy)


def place_wide_checkpoint(comfy: Path) -> str:
    """The tiny dense checkpoint with a one-block DiT as wide as the published ones, in
    models/lingbot_video: the pack takes it for a real checkpoint, so the advice it gives only for real
    runs shows (a few-step recipe without its LoRA or student, a real model on the CPU)."""
    import torch

    from lingbot_core.models.transformer import LingBotVideoTransformer3DModel
    from lingbot_core.notices import REAL_HIDDEN_SIZE
    from lingbot_core.tiny import TINY_MARKER, ensure_tiny_checkpoint, tiny_dit_config

    name = f"{PREFIX}_wide"
    folder = comfy / "models" / "lingbot_video" / name
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(ensure_tiny_checkpoint("dense"), folder)
    (folder / TINY_MARKER).unlink(missing_ok=True)  # no longer the tiny build
    shutil.rmtree(folder / "transformer")
    config = tiny_dit_config("dense")
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    config.update(hidden_size=REAL_HIDDEN_SIZE, num_attention_heads=REAL_HIDDEN_SIZE // head_dim, depth=1)
    torch.manual_seed(0)
    LingBotVideoTransformer3DModel(**config).save_pretrained(folder / "transformer", safe_serialization=True)
    return name


def check_advice_on_nodes(server: Server, comfy: Path) -> None:
    """The shipped few-step workflows on a real-width checkpoint without their LoRA / student: the run
    goes ahead, and Denoise (and LoRA, Loader) say why its output will be unusable, on the node."""
    name = place_wide_checkpoint(comfy)
    try:
        for workflow, node_type, must in (
                ("lingbot_t2v_moe_lightlingbot4.json", "LingBotDenoise", "LightLingBot"),
                ("lingbot_t2v_moe_lightlingbot4.json", "LingBotLoRA", "lora_name is 'none'"),
                ("lingbot_t2v_moe_lightlingbot4.json", "LingBotLoader", "runs on the CPU"),
                ("lingbot_t2v_dense_dmd8.json", "LingBotDenoise", "transformer_path")):
            prompt = json.loads((WORKFLOWS / workflow).read_text())
            prompt[find_node(prompt, "LingBotLoader")]["inputs"].update(checkpoint=name, variant="auto")
            node = find_node(prompt, node_type)
            entry, refused = server.run(prompt)
            texts = [] if entry is None else entry["outputs"].get(node, {}).get("text", [])
            shown = " ".join(texts)
            record(must in shown, f"{workflow} on a real-width checkpoint: {node_type} says so on the node",
                   (shown or errors_of(entry) or str(entry["outputs"]))[:300] if entry else json.dumps(refused)[:400])
    finally:
        shutil.rmtree(comfy / "models" / "lingbot_video" / name, ignore_errors=True)


def latent_prompt(seed: int, tag: str, steps: int = 24) -> tuple[dict, str, str]:
    """The shipped T2V workflow with a longer Denoise and its LATENT saved by core SaveLatent."""
    prompt = json.loads((WORKFLOWS / "lingbot_t2v_dense.json").read_text())
    denoise = find_node(prompt, "LingBotDenoise")
    prompt[denoise]["inputs"].update(seed=seed, steps=steps, width=128, height=128, frames=17)
    prompt[find_node(prompt, "LingBotSaveVideo")]["inputs"]["filename_prefix"] = f"{PREFIX}/{tag}"
    prompt["900"] = {"class_type": "SaveLatent",
                     "inputs": {"samples": [denoise, 0], "filename_prefix": f"{PREFIX}/{tag}"}}
    return prompt, denoise, "900"


async def _interrupt_mid_denoise(server: Server, prompt: dict, denoise: str, at_step: int) -> tuple[str | None, int]:
    """Queue `prompt`, POST /interrupt once Denoise reports `at_step`; the prompt id and the step seen."""
    import aiohttp

    ws_url = server.url.replace("http", "ws", 1) + f"/ws?clientId={server.client_id}"
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url) as ws:
        prompt_id, _ = server.queue(prompt)
        if prompt_id is None:
            return None, -1
        async for msg in ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            body = data.get("data", {})
            if body.get("prompt_id") not in (None, prompt_id):
                continue
            if data["type"] == "progress" and str(body.get("node")) == denoise and body["value"] >= at_step:
                server.post("/interrupt", {})
                return prompt_id, int(body["value"])
            if data["type"] in ("execution_success", "execution_error"):
                return prompt_id, -1
    return prompt_id, -1


def interrupt_mid_denoise(server: Server, prompt: dict, denoise: str, check: str) -> bool:
    """Queue `prompt` (24 steps), interrupt it at Denoise's step 3 and record `check`: the run ended as
    interrupted after at least one step."""
    prompt_id, step = asyncio.run(_interrupt_mid_denoise(server, prompt, denoise, at_step=3))
    stopped = server.wait(prompt_id) if prompt_id else None
    interrupted = stopped is not None and any(kind == "execution_interrupted"
                                              for kind, _ in stopped["status"]["messages"])
    return record(interrupted and step > 0, check,
                  f"interrupted at step {step} of 24" if interrupted else f"status {stopped and stopped['status']}")


def ran(entry: dict | None, node: str) -> bool:
    """The run succeeded and `node` was computed in it (not served from ComfyUI's cache)."""
    if entry is None or entry["status"]["status_str"] != "success":
        return False
    cached = [data.get("nodes", []) for kind, data in entry["status"]["messages"] if kind == "execution_cached"]
    return all(node not in nodes for nodes in cached)


def check_interrupt_and_free(server: Server) -> None:
    import torch

    ref_prompt, denoise, saver = latent_prompt(seed=7, tag="ref")
    server.run(latent_prompt(seed=7, tag="evict", steps=2)[0])  # a rerun of this script finds it cached otherwise
    entry, refused = server.run(ref_prompt)
    if not record(ran(entry, denoise), "reference run (24 steps)",
                  (errors_of(entry) if entry else str(refused))):
        return
    reference = server.latent(entry, saver)

    stop_prompt, _, _ = latent_prompt(seed=8, tag="stopped")
    interrupt_mid_denoise(server, stop_prompt, denoise, "POST /interrupt stops Denoise mid-way")

    again_prompt, _, _ = latent_prompt(seed=7, tag="after_interrupt")
    entry, _ = server.run(again_prompt)  # the interrupted prompt replaced Denoise's cache entry: it runs again
    same = ran(entry, denoise) and torch.equal(server.latent(entry, saver), reference)
    record(same, "the run after the interrupt equals the uninterrupted run bit for bit",
           "" if same else (errors_of(entry) if entry else "refused"))

    for body, what in (({"unload_models": True}, "unload models"),
                       ({"unload_models": True, "free_memory": True}, "unload models and free the node cache")):
        server.run(latent_prompt(seed=7, tag="evict", steps=2)[0])  # so that Denoise is not served from the cache
        code, _ = server.post("/free", body)
        time.sleep(2)  # the prompt worker acts on /free between prompts
        prompt, _, _ = latent_prompt(seed=7, tag="after_free")
        entry, _ = server.run(prompt)
        same = code == 200 and ran(entry, denoise) and torch.equal(server.latent(entry, saver), reference)
        record(same, f"POST /free ({what}), then the next run is bit-identical",
               f"HTTP {code}" + ("" if entry is None else " " + errors_of(entry)))


def with_memory_report(prompt: dict, value: str) -> str:
    """A Memory Report on the prompt's Offload pipe after node `value`; its id (the report is its UI text)."""
    prompt["901"] = {"class_type": "LingBotMemoryReport",
                     "inputs": {"pipe": [find_node(prompt, "LingBotOffload"), 0], "value": [value, 0]}}
    return "901"


def report_text(entry: dict | None, node: str) -> str:
    return " ".join(entry["outputs"].get(node, {}).get("text", [])) if entry else ""


CHUNK = "256"  # shorter than the sequences below (dense 320 video tokens, MoE refine 320): the FFN runs in pieces
MOE_REL_L2 = 1e-5  # the MoE's Refine over fewer tokens per expert call (chunks, ulysses shares) against the whole
# sequence's (fp32 on the CPU; see check_parallel_refine)


def check_ffn_chunk(server: Server) -> None:
    """The Loader's `ffn_chunk` through the API: 256-token chunks on a 320-token sequence give Denoise's
    latents bit for bit, and the Memory Report says the DiT ran in chunks."""
    import torch

    results = {}
    for chunk in ("auto", CHUNK):
        prompt, denoise, saver = latent_prompt(seed=5, tag=f"chunk_{chunk}", steps=8)
        prompt[find_node(prompt, "LingBotLoader")]["inputs"]["ffn_chunk"] = chunk
        report = with_memory_report(prompt, denoise)
        entry, refused = server.run(prompt)
        if not record(ran(entry, denoise), f"ffn_chunk {chunk}: the T2V run (dense, 128x128x17, 8 steps)",
                      errors_of(entry) if entry else json.dumps(refused)[:300]):
            return
        results[chunk] = (server.latent(entry, saver), report_text(entry, report))
    (whole, whole_text), (chunked, chunked_text) = results["auto"], results[CHUNK]
    said = [line for line in chunked_text.splitlines() if "FFN/MoE" in line]
    record(f"{CHUNK}-token chunks" in chunked_text and "whole sequence" in whole_text,
           f"ffn_chunk {CHUNK}: the Memory Report says the DiT ran in chunks (auto: whole)", "; ".join(said))
    record(torch.equal(chunked, whole), f"ffn_chunk {CHUNK}: Denoise's latents equal ffn_chunk auto's bit for bit",
           "" if torch.equal(chunked, whole) else f"max |diff| {(chunked - whole).abs().max().item():.3g}")
    bad, _, _ = latent_prompt(seed=5, tag="chunk_bad", steps=2)
    bad[find_node(bad, "LingBotLoader")]["inputs"]["ffn_chunk"] = "300"
    prompt_id, answer = server.queue(bad)
    record(prompt_id is None and "ffn_chunk" in json.dumps(answer),
           "ffn_chunk 300 (not offered): POST /prompt refuses it, naming the input",
           json.dumps(answer)[:300] if prompt_id is None else "queued")


# ------------------------------------------------------------------------------------- LingBot Parallel

PARALLEL_STARTED = "LingBot Parallel: "  # the pool's log line, once per start of the workers


def parallel_prompt(seed: int, tag: str, parallel: dict | None, steps: int = 8) -> tuple[dict, str, str]:
    """`latent_prompt` with Offload 'none' (the modes LingBot Parallel takes) and, when `parallel` gives its
    inputs, a LingBot Parallel node between Loader and Offload (so Text Encode, Denoise and Decode get its pipe)."""
    prompt, denoise, saver = latent_prompt(seed, tag, steps)
    offload = find_node(prompt, "LingBotOffload")
    prompt[offload]["inputs"]["mode"] = "none"
    if parallel is not None:
        loader = find_node(prompt, "LingBotLoader")
        prompt["950"] = {"class_type": "LingBotParallel", "inputs": {"pipe": [loader, 0], **parallel}}
        prompt[offload]["inputs"]["pipe"] = ["950", 0]
    return prompt, denoise, saver


def worker_processes(server_pid: int) -> list[int]:
    """The server's spawned children (multiprocessing's `spawn_main`: the pool's workers), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == server_pid and b"spawn_main" in cmdline:
            found.append(int(stat.parent.name))
    return sorted(found)


def process_state(pid: int) -> str | None:
    """The state letter of `pid` in /proc (R, S, Z ...), None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def threads(pid: int) -> int:
    """How many threads `pid` has left in /proc (0 when there is no such process)."""
    try:
        return len(list(Path(f"/proc/{pid}/task").iterdir()))
    except OSError:
        return 0


def wait_for(predicate, timeout: float = 30) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return True
        time.sleep(0.5)
    return predicate()


def pool_starts(log_path: Path) -> int:
    """How many times the server's worker pools started, from its log."""
    return len(re.findall(PARALLEL_STARTED + r"\d+ worker process", log_path.read_text(errors="replace")))


def check_parallel(server: Server, proc: subprocess.Popen, log_path: Path, devices: str, cfg: str,
                   ulysses: int, fsdp: str = "off") -> None:
    """A pipe through LingBot Parallel on `devices`: its latents equal the single-device run's; a second
    prompt reuses the workers; an interrupt leaves the next run exact; POST /free (unload models) stops
    the workers and the next run starts new ones, exact again; then `check_parallel_release` and
    `check_parallel_dead_worker`. Needs the server this script started (its log and its child processes)."""
    import torch

    def starts() -> int:
        return pool_starts(log_path)

    inputs = {"devices": devices, "cfg": cfg, "ulysses": ulysses, "fsdp": fsdp}
    single, denoise, saver = parallel_prompt(seed=11, tag="par_single", parallel=None)
    entry, refused = server.run(single)
    if not record(ran(entry, denoise), "parallel: the single-device reference run (Offload none)",
                  errors_of(entry) if entry else str(refused)):
        return
    reference = server.latent(entry, saver)

    before = starts()
    prompt, _, _ = parallel_prompt(seed=11, tag="par_1", parallel=inputs)
    entry, refused = server.run(prompt)
    ok = ran(entry, denoise)
    workers = worker_processes(proc.pid)
    same = ok and torch.equal(server.latent(entry, saver), reference)
    diff = "" if not ok or same else f"max |diff| {(server.latent(entry, saver) - reference).abs().max().item():.3g}"
    record(ok and same, f"parallel ({devices}; cfg {cfg}, ulysses {ulysses}): latents equal the single-device run",
           f"workers {workers}" if same else (diff or (errors_of(entry) if entry else str(refused))))
    record(ok and starts() == before + 1 and len(workers) >= 1, "parallel: the workers started once, as processes",
           f"starts in the log {starts() - before}, worker pids {workers}")
    if not ok:
        return

    prompt, _, _ = parallel_prompt(seed=12, tag="par_2", parallel=inputs)
    entry, _ = server.run(prompt)
    record(ran(entry, denoise) and starts() == before + 1 and worker_processes(proc.pid) == workers,
           "parallel: a second prompt reuses the workers (no new start, same pids)",
           f"starts {starts() - before}, pids {worker_processes(proc.pid)}")

    stop_prompt, _, _ = parallel_prompt(seed=13, tag="par_stopped", parallel=inputs, steps=24)
    interrupt_mid_denoise(server, stop_prompt, denoise, "parallel: POST /interrupt stops Denoise mid-way")
    prompt, _, _ = parallel_prompt(seed=11, tag="par_after_interrupt", parallel=inputs)
    entry, _ = server.run(prompt)
    same = ran(entry, denoise) and torch.equal(server.latent(entry, saver), reference)
    record(same, "parallel: the run after the interrupt equals the single-device run bit for bit",
           "" if same else (errors_of(entry) if entry else "refused"))
    record(starts() == before + 1 and worker_processes(proc.pid) == workers,
           "parallel: the interrupt kept the workers (no new start, same pids)",
           f"starts {starts() - before}, pids {worker_processes(proc.pid)} (before {workers})")

    for round_ in (1, 2):  # twice: the second time the workers were started again by a cached Parallel node
        code, _ = server.post("/free", {"unload_models": True})
        gone = wait_for(lambda: not worker_processes(proc.pid))
        record(code == 200 and gone, f"parallel: POST /free (unload models) stops the workers (round {round_})",
               f"HTTP {code}, left {worker_processes(proc.pid)}")
        prompt, _, _ = parallel_prompt(seed=11 + round_ * 100, tag="par_evict", parallel=inputs, steps=2)
        server.run(prompt)  # Denoise not served from the cache below
        prompt, _, _ = parallel_prompt(seed=11, tag="par_after_free", parallel=inputs)
        entry, _ = server.run(prompt)
        same = ran(entry, denoise) and torch.equal(server.latent(entry, saver), reference)
        record(same and bool(worker_processes(proc.pid)),
               f"parallel: after /free the next run starts new workers and is bit-identical (round {round_})",
               f"pids {worker_processes(proc.pid)}" + ("" if entry is None else " " + errors_of(entry)))

    check_parallel_release(server, proc, log_path, inputs, reference)
    check_parallel_dead_worker(server, proc, log_path, inputs, reference)


def exact_run(server: Server, prompt: dict, denoise: str, saver: str, reference: Any) -> tuple[bool, str]:
    """Run `prompt`: (Denoise ran and its saved latents equal `reference` bit for bit, what went wrong)."""
    import torch

    entry, refused = server.run(prompt)
    if not ran(entry, denoise):
        return False, errors_of(entry) if entry else json.dumps(refused)[:300]
    got = server.latent(entry, saver)
    same = torch.equal(got, reference)
    return same, "" if same else f"max |diff| {(got - reference).abs().max().item():.3g}"


def check_parallel_release(server: Server, proc: subprocess.Popen, log_path: Path, inputs: dict,
                           reference: Any) -> None:
    """A LingBot Release (all) on the parallel pipe, after Denoise: the worker processes are gone when the
    prompt ends; the next prompt (the same Parallel node, served from ComfyUI's cache) starts new ones."""
    before, old = pool_starts(log_path), worker_processes(proc.pid)
    prompt, denoise, saver = parallel_prompt(seed=21, tag="par_release", parallel=inputs)
    prompt["902"] = {"class_type": "LingBotRelease",
                     "inputs": {"pipe": [find_node(prompt, "LingBotOffload"), 0], "value": [denoise, 0], "what": "all"}}
    prompt[saver]["inputs"]["samples"] = ["902", 0]
    entry, refused = server.run(prompt)
    gone = wait_for(lambda: not worker_processes(proc.pid), 10)
    record(ran(entry, "902") and bool(old) and gone,
           "parallel: LingBot Release on the parallel pipe stops the worker processes",
           f"before {old}, after {worker_processes(proc.pid)}" + (" " + errors_of(entry) if entry else str(refused)))
    prompt, denoise, saver = parallel_prompt(seed=11, tag="par_after_release", parallel=inputs)
    same, why = exact_run(server, prompt, denoise, saver, reference)
    new = worker_processes(proc.pid)
    record(same and pool_starts(log_path) == before + 1 and bool(new) and not set(new) & set(old),
           "parallel: after Release the next prompt starts a fresh pool and is bit-identical",
           f"starts {pool_starts(log_path) - before}, pids {new} (before {old}) {why}")


def check_parallel_dead_worker(server: Server, proc: subprocess.Popen, log_path: Path, inputs: dict,
                               reference: Any) -> None:
    """A worker killed (SIGKILL) between prompts: the next parallel prompt fails with the pool's message
    (the worker is gone; the pipe without LingBot Parallel works), a single-device prompt then runs and is
    exact, and the parallel pipe after that starts new workers, exact again."""
    import os

    workers = worker_processes(proc.pid)
    if not record(bool(workers), "parallel: workers running before the kill", str(workers)):
        return
    os.kill(workers[0], signal.SIGKILL)
    # until it has exited: a zombie with no thread left (its main thread turns zombie first, while its other
    # threads -- gloo's, torch's -- still exit, and until then the server cannot see it dead), or reaped; the
    # check below is of a worker gone *between* prompts
    wait_for(lambda: process_state(workers[0]) in ("Z", "X", None) and threads(workers[0]) <= 1, 30)
    prompt, denoise, _ = parallel_prompt(seed=31, tag="par_killed", parallel=inputs)
    entry, refused = server.run(prompt)
    error = errors_of(entry) if entry else json.dumps(refused)[:300]
    clear = ("LingBot Parallel" in error and ("is gone" in error or "died" in error)
             and "without LingBot Parallel works" in error)
    record(entry is not None and entry["status"]["status_str"] == "error" and clear,
           "parallel: a worker killed between prompts gives the next prompt a clear error", error[:400])
    single, denoise, saver = parallel_prompt(seed=11, tag="single_after_kill", parallel=None)
    same, why = exact_run(server, single, denoise, saver, reference)
    record(same, "parallel: after the dead worker, the pipe without LingBot Parallel runs and is bit-identical", why)
    before = pool_starts(log_path)
    prompt, denoise, saver = parallel_prompt(seed=11, tag="par_after_kill", parallel=inputs)
    same, why = exact_run(server, prompt, denoise, saver, reference)
    new = worker_processes(proc.pid)
    record(same and pool_starts(log_path) == before + 1 and bool(new) and workers[0] not in new,
           "parallel: the parallel pipe then starts new workers and is bit-identical",
           f"starts {pool_starts(log_path) - before}, pids {new} {why}")


def refine_prompt(tag: str, parallel: dict | None, chunk: str = "auto") -> tuple[dict, str, str, str]:
    """The shipped MoE refine workflow with Offload 'none', 17 frames (the refine pass: 320 tokens at
    128x128), the Loader's `ffn_chunk`, Refine's LATENT saved by core SaveLatent and, when `parallel` gives
    its inputs, a LingBot Parallel node between Loader and Offload. (prompt, Refine, SaveLatent, Memory Report)."""
    prompt = json.loads((WORKFLOWS / "lingbot_t2v_moe_refine.json").read_text())
    loader, offload = find_node(prompt, "LingBotLoader"), find_node(prompt, "LingBotOffload")
    refine = find_node(prompt, "LingBotRefine")
    prompt[loader]["inputs"]["ffn_chunk"] = chunk
    prompt[offload]["inputs"]["mode"] = "none"
    prompt[find_node(prompt, "LingBotDenoise")]["inputs"]["frames"] = 17
    prompt[find_node(prompt, "LingBotSaveVideo")]["inputs"]["filename_prefix"] = f"{PREFIX}/{tag}"
    prompt["900"] = {"class_type": "SaveLatent", "inputs": {"samples": [refine, 0], "filename_prefix": f"{PREFIX}/{tag}"}}
    if parallel is not None:
        prompt["950"] = {"class_type": "LingBotParallel", "inputs": {"pipe": [loader, 0], **parallel}}
        prompt[offload]["inputs"]["pipe"] = ["950", 0]
    return prompt, refine, "900", find_node(prompt, "LingBotMemoryReport")


def check_parallel_refine(server: Server, proc: subprocess.Popen, log_path: Path, devices: str, cfg: str,
                          ulysses: int, fsdp: str = "off") -> None:
    """The tiny MoE: Refine on a LingBot Parallel pipe gives the single-device Refine's latents (the workers
    load the base and the refiner DiT): bit for bit with cfg alone, within float rounding with a ulysses
    share; the single-device run with 256-token FFN/MoE chunks (the refiner's 320-token sequence in two
    pieces, routing per token) gives them within float rounding too."""
    import torch

    inputs = {"devices": devices, "cfg": cfg, "ulysses": ulysses, "fsdp": fsdp}
    prompt, refine, saver, report = refine_prompt("moe_single", None)
    entry, refused = server.run(prompt)
    if not record(ran(entry, refine), "MoE refine: the single-device reference run (Offload none)",
                  errors_of(entry) if entry else json.dumps(refused)[:300]):
        return
    reference = server.latent(entry, saver)

    prompt, refine, saver, report = refine_prompt("moe_chunk", None, chunk=CHUNK)
    entry, refused = server.run(prompt)
    said = [line.strip() for line in report_text(entry, report).splitlines() if "FFN/MoE" in line]
    if ran(entry, refine):
        # The MoE's experts see other row counts per chunk, and the CPU's matmul kernels may then round
        # differently (the dense FFN's do not here): float rounding, not another computation
        got = server.latent(entry, saver)
        rel = ((got - reference).norm() / reference.norm()).item()
        how = "bit-identical" if torch.equal(got, reference) else \
            f"rel-L2 {rel:.2g}, max |diff| {(got - reference).abs().max().item():.2g}"
        close = rel <= MOE_REL_L2
    else:
        close, how = False, errors_of(entry) if entry else json.dumps(refused)[:300]
    record(close and any(f"refiner FFN/MoE: {CHUNK}-token chunks" in line for line in said),
           f"MoE refine with ffn_chunk {CHUNK}: Refine's latents equal ffn_chunk auto's within float rounding "
           f"(rel-L2 <= {MOE_REL_L2:g}), chunks reported", f"{how}; " + "; ".join(said))

    before = pool_starts(log_path)
    prompt, refine, saver, report = refine_prompt("moe_parallel", inputs)
    entry, refused = server.run(prompt)
    if ran(entry, refine):
        got = server.latent(entry, saver)
        rel = ((got - reference).norm() / reference.norm()).item()
        same = torch.equal(got, reference)
        why = "bit-identical" if same else f"rel-L2 {rel:.2g}, max |diff| {(got - reference).abs().max().item():.2g}"
    else:
        same, rel, why = False, float("inf"), errors_of(entry) if entry else json.dumps(refused)[:300]
    # a ulysses share gives each rank's experts half the tokens: float rounding as with chunks (above); cfg
    # alone gives every rank the whole sequence, and then the result is the single device's, bit for bit
    ok = same if int(ulysses) <= 1 else rel <= MOE_REL_L2
    record(ok and pool_starts(log_path) == before + 1 and bool(worker_processes(proc.pid)),
           f"parallel ({devices}; cfg {cfg}, ulysses {ulysses}): MoE Refine's latents equal the single-device run"
           + ("" if int(ulysses) <= 1 else f" within float rounding (rel-L2 <= {MOE_REL_L2:g})"),
           f"{why}; starts {pool_starts(log_path) - before}, pids {worker_processes(proc.pid)}")


def check_exit_stops_workers(proc: subprocess.Popen) -> None:
    """SIGINT to main.py (Ctrl-C) ends the server and leaves none of its worker processes behind."""
    workers = worker_processes(proc.pid)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        pass
    alive = [pid for pid in workers if Path(f"/proc/{pid}").exists() and
             b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    record(proc.poll() is not None and bool(workers) and wait_for(lambda: not [
        p for p in workers if Path(f"/proc/{p}").exists()], 20),
           "parallel: SIGINT to main.py ends the server and its worker processes",
           f"server exit {proc.poll()}, workers before {workers}, alive right after {alive}")


# --------------------------------------------------------------------------------------------------- main

def start_server(comfy: Path, python: str, port: int, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    # SIGINT as the default in the server: a shell starting this script in the background ignores it, the
    # server would inherit that, and Python then installs no KeyboardInterrupt (the --parallel exit check)
    proc = subprocess.Popen([python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port)],
                            cwd=comfy, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    server = Server(f"http://127.0.0.1:{port}")
    end = time.time() + 300
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"ComfyUI exited with {proc.returncode}; see {log_path}")
        try:
            server.get("/system_stats")
            return proc
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(1)
    proc.terminate()
    raise RuntimeError(f"ComfyUI did not answer within 300 s; see {log_path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("comfy", type=Path, help="the ComfyUI folder (holding main.py and custom_nodes/)")
    parser.add_argument("--url", help="use this running server instead of starting one")
    parser.add_argument("--python", default=sys.executable, help="the Python that runs ComfyUI")
    parser.add_argument("--port", type=int, default=8199)
    parser.add_argument("--skip", nargs="*", default=[], choices=["workflows", "files", "advice", "interrupt", "chunk"])
    parser.add_argument("--parallel", nargs="?", const="cpu, cpu", metavar="DEVICES",
                        help="also check LingBot Parallel on DEVICES (default 'cpu, cpu'), last, ending with SIGINT "
                             "to the server; needs the server this script starts (not --url)")
    parser.add_argument("--parallel-cfg", default="2", choices=["1", "2"])
    parser.add_argument("--parallel-ulysses", type=int, default=1)
    parser.add_argument("--parallel-fsdp", default="off", choices=["off", "on"],
                        help="the Parallel node's fsdp: 'on' shards the DiTs' blocks over the processes")
    args = parser.parse_args(argv)
    if args.parallel and args.url:
        parser.error("--parallel reads the server's log and processes: let the script start the server (no --url)")
    comfy = args.comfy.resolve()
    linked = [p for p in (comfy / "custom_nodes").iterdir() if p.resolve() == ROOT]
    if not linked:
        print(f"the pack is not in {comfy / 'custom_nodes'}: link or copy this folder there first", file=sys.stderr)
        return 2

    proc = None
    log_path = Path(tempfile.gettempdir()) / "lingbot_comfy_e2e.log"
    if args.url:
        server = Server(args.url)
    else:
        proc = start_server(comfy, args.python, args.port, log_path)
        server = Server(f"http://127.0.0.1:{args.port}")
    try:
        stats = server.get("/system_stats")["system"]
        print(f"ComfyUI {stats.get('comfyui_version')}, Python {stats.get('python_version', '').split()[0]}, "
              f"torch {stats.get('pytorch_version')}", flush=True)
        check_import(server, log_path.read_text(errors="replace") if proc else None, linked[0].name)
        if "workflows" not in args.skip:
            check_workflows(server)
        if "files" not in args.skip:
            check_loader_files(server, comfy)
        if "advice" not in args.skip:
            check_advice_on_nodes(server, comfy)
        if "interrupt" not in args.skip:
            check_interrupt_and_free(server)
        if "chunk" not in args.skip:
            check_ffn_chunk(server)
        if args.parallel:
            layout = (args.parallel, args.parallel_cfg, args.parallel_ulysses, args.parallel_fsdp)
            check_parallel(server, proc, log_path, *layout)
            check_parallel_refine(server, proc, log_path, *layout)
            check_exit_stops_workers(proc)
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    failed = [name for ok, name, _ in RESULTS if not ok]
    print(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    if proc is not None:
        print(f"server log: {log_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
