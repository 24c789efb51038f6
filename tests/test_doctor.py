"""`python -m lingbot_core.doctor`: the CPU run writes a real report; the CUDA-only sections run through a
fake accelerator (CPU tensors, faked memory counters and device size)."""

from __future__ import annotations

import ast
import json
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from background import Child, selected

from lingbot_core import doctor
from lingbot_core.placement import estimate, recipes
from lingbot_core.placement.modes import MODE_ORDER

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def command_run(request, tmp_path_factory):
    """`python -m lingbot_core.doctor` in a process of its own, started with the module so that it runs on
    the second core while `cpu_report` runs here (tests/background.py): (the child, its report path)."""
    if not selected(request, "test_command_line_writes_the_report"):
        yield None
        return
    path = tmp_path_factory.mktemp("doctor_command") / "report.json"
    child = Child([sys.executable, "-m", "lingbot_core.doctor", "--device", "cpu", "--json", str(path),
                   "--quick", "--only", "disk,versions"], cwd=ROOT)
    yield child, path
    child.stop()


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    """One quick CPU run of every section through `main` (in this process: torch's import is paid once)."""
    path = tmp_path_factory.mktemp("doctor") / "report.json"
    code = doctor.main(["--device", "cpu", "--json", str(path), "--quick", "--threads", "1"])
    return code, json.loads(path.read_text())


def test_cpu_run_reports_every_section_and_mode(cpu_report):
    code, report = cpu_report
    assert code == 0
    assert list(report["sections"]) == list(doctor.SECTIONS)
    assert report["device"] == "cpu"
    versions = report["sections"]["versions"]
    assert versions["torch"] == torch.__version__ and versions["python"] == sys.version.split()[0]
    dit = report["sections"]["dit"]
    assert dit["status"] == "ran"
    for variant in doctor.VARIANTS:
        rows = {r["mode"]: r for r in dit["rows"] if r["variant"] == variant}
        assert list(rows) == list(MODE_ORDER), variant  # every registered mode, fastest first
        for mode, row in rows.items():
            assert row["status"] == "ran", (variant, mode, row.get("error"))
            assert row["step_s"] > 0 and row["stage_s"] >= row["step_s"]
            assert row["estimate_bytes"] == row["estimate_bytes"] // 1 > 0
            assert row["peak_bytes"] is None  # a CPU has no memory counters: not measured, not made up
            assert row["finite"] and row["max_abs_diff_vs_first_mode"] == 0.0  # offload never changes arithmetic
            assert row["hidden"] == json.loads(recipes.DIT_CONFIGS[variant].read_text())["hidden_size"]
    assert {r["experts"] for r in dit["rows"] if r["variant"] == "moe"} == {doctor.CPU_EXPERTS}
    batched = report["sections"]["cfg_batch"]  # measured on any device; on a CPU auto leaves plain weights alone
    assert batched["status"] == "ran" and batched["two_forwards_s"] > 0 and batched["batched_s"] > 0
    assert batched["batched_x_two"] == pytest.approx(batched["batched_s"] / batched["two_forwards_s"])
    assert batched["auto_batches_plain_weights"] is False
    disk = report["sections"]["disk"]
    assert disk["status"] == "ran" and disk["cold_read_MBps"] > 0 and disk["cached_read_MBps"] > 0
    for name in ("bandwidth", "recipe"):
        assert report["sections"][name]["status"] == "not applicable"
    assert any(line.startswith("bandwidth") for line in report["cuda_only"])


def test_estimate_in_the_report_is_the_estimators(cpu_report):
    """The estimate column is `estimate.estimate_peak` of the same model and geometry (its denoise phase)."""
    _, report = cpu_report
    dit = report["sections"]["dit"]
    g = dit["geometry"]
    geometry = estimate.Geometry(height=g["height"], width=g["width"], num_frames=g["num_frames"], cfg=True)
    row = next(r for r in dit["rows"] if r["variant"] == "dense" and r["mode"] == MODE_ORDER[0])
    model = doctor.random_dit(doctor.dit_config("dense", g["blocks"]), torch.float32)
    sizes = estimate.ModelSizes.from_modules({"transformer": model})
    assert row["weights_bytes"] == sizes.transformer
    assert row["estimate_bytes"] == estimate.estimate_peak(MODE_ORDER[0], sizes, geometry, ("denoise",))


def test_command_line_writes_the_report(command_run):
    """The module runs as a command (one subprocess, cheap sections) and says where the report went."""
    child, path = command_run
    done = child.result(timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(path.read_text())
    assert list(report["sections"]) == ["versions", "disk"]  # the registry's order
    assert "[disk] ran" in done.stdout and f"report written to {path}" in done.stdout


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda:99"], "cuda"),
    (["--device", "mps"], "mps"),
    (["--only", "versions,nonsense"], "nonsense"),
    (["--disk-dir", "/nonexistent/folder"], "not a folder"),
])
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        doctor.main(argv)
    assert exit_info.value.code == 2
    assert message.lower() in capsys.readouterr().err.lower()


def test_a_failing_section_is_reported_and_the_rest_still_run(monkeypatch, tmp_path):
    def broken(_doctor):
        raise RuntimeError("disk on fire")

    monkeypatch.setitem(doctor.SECTIONS, "disk", broken)
    code = doctor.main(["--device", "cpu", "--only", "disk,versions", "--json", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 1
    assert report["sections"]["disk"]["status"] == "failed"
    assert "disk on fire" in report["sections"]["disk"]["error"]
    assert report["sections"]["versions"]["status"] == "ran"


# -- the kernels section, with and without the verdicts in the build --------------------------------

def test_kernels_section_without_the_verdicts_says_so(monkeypatch):
    monkeypatch.setattr(doctor, "_kernels_module", lambda: None)
    settings = doctor.Settings.make(torch.device("cpu"), quick=True, sections=("kernels",))
    section = doctor.run(settings)["sections"]["kernels"]
    assert section["status"] == "not available in this build"


def test_kernels_section_probes_every_registered_kernel(monkeypatch):
    probed = []
    held = [{"kernel": "grouped_mm", "device": "cpu", "capability": "-", "dtype": "float32", "torch": "x",
             "verdict": "refused", "reason": "no kernel"}]

    def probe(kernel, device, dtype):
        probed.append((kernel, str(device), dtype))
        if kernel == "broken":
            raise RuntimeError("cannot even try")
        return {"kernel": kernel, "device": device.type, "capability": "-", "dtype": str(dtype).split(".")[-1],
                "torch": "x", "verdict": "fast", "reason": ""}

    fake = types.SimpleNamespace(KERNELS={"grouped_mm": None, "attention": None, "broken": None},
                                 probe=probe, verdicts=lambda: held)
    monkeypatch.setattr(doctor, "_kernels_module", lambda: fake)
    settings = doctor.Settings.make(torch.device("cpu"), quick=True, sections=("kernels",))
    rows = doctor.run(settings)["sections"]["kernels"]["rows"]
    attention = [f"attention/{b}{m}" for b in doctor.attention_probes() for m in ("", "+mask")]
    assert [p[0] for p in probed] == ["grouped_mm", *attention, "broken"]
    by_kernel = {r["kernel"]: r for r in rows}
    assert by_kernel["grouped_mm"]["verdict"] == "refused"  # the process's own verdict wins over a good probe
    assert by_kernel["attention/flash+mask"]["verdict"] == "fast"
    assert by_kernel["broken"]["verdict"] == "refused" and "cannot even try" in by_kernel["broken"]["reason"]


def test_kernels_section_of_this_build(cpu_report):
    """Every kernel family of the registry has a verdict on the CPU (the quick run skips compiling probes)."""
    from lingbot_core import kernels

    section = cpu_report[1]["sections"]["kernels"]
    assert section["status"] == "ran"
    assert {r["kernel"].split("/")[0] for r in section["rows"]} == set(kernels.KERNELS)
    assert {r["verdict"] for r in section["rows"]} <= {*kernels.VERDICTS, "not probed"}
    grouped = [r for r in section["rows"] if r["kernel"] == "grouped_mm"]
    assert grouped and all(r["verdict"] == kernels.REFUSED for r in grouped)  # float32 has no grouped path


def test_attention_probes_are_the_loaders_other_backends():
    from lingbot_core.models.transformer import SDPA_BACKENDS
    from lingbot_nodes.loader import attention_options

    # sparse is no diffusers backend: the doctor probes it as its own kernel family (`sparse_attention`)
    assert set(doctor.attention_probes()) == set(attention_options()) - {"default", "sparse", *SDPA_BACKENDS}


def test_comfyui_version_is_read_without_importing_comfyui(tmp_path, monkeypatch):
    assert doctor.comfyui_version() is None  # not importable here, and this checkout is not in custom_nodes
    (tmp_path / "comfyui_version.py").write_text('raise SystemExit("never run")\n__version__ = "0.3.64"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert doctor.comfyui_version() == "0.3.64"
    assert "comfyui_version" not in sys.modules and not any(n.split(".")[0] == "comfy" for n in sys.modules)


def test_comfyui_version_of_the_comfyui_folder_the_pack_sits_in(tmp_path, monkeypatch):
    """Run from `ComfyUI/custom_nodes/lingbot-nodes`, the doctor finds ComfyUI two folders up."""
    pack = tmp_path / "ComfyUI" / "custom_nodes" / "lingbot-nodes"
    (pack / "lingbot_core").mkdir(parents=True)
    (tmp_path / "ComfyUI" / "comfyui_version.py").write_text("__version__ = '0.4.1'\n")
    monkeypatch.setattr(doctor, "__file__", str(pack / "lingbot_core" / "doctor.py"))
    assert doctor.comfyui_version() == "0.4.1"


# -- the CUDA-only sections through a fake accelerator ---------------------------------------------

class FakeCuda(doctor.Accelerator):
    """A "CUDA device" over CPU tensors: counters that a test controls, no pinning."""

    def __init__(self, total_bytes: int, peak_scale: float):
        super().__init__(torch.device("cpu"))
        self.total = total_bytes
        self.peak_scale = peak_scale
        self.estimates: list[int] = []
        self.pinned: list[bool] = []

    @property
    def measures(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def clear(self) -> None:
        pass

    def allocated(self) -> int:
        return 0

    def peak_allocated(self) -> int:
        # the peak of the row being measured: its estimate times the scale the test chose
        return int(self.estimates[-1] * self.peak_scale)

    def peak_reserved(self) -> int:
        return self.peak_allocated()

    def total_bytes(self) -> int:
        return self.total

    def describe(self) -> dict:
        return {"name": "Fake GPU", "capability": "8.9", "total_bytes": self.total, "multiprocessors": 1}

    def host_buffer(self, nbytes: int, pinned: bool) -> torch.Tensor:
        self.pinned.append(pinned)
        return torch.empty(nbytes, dtype=torch.uint8)


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda(total_bytes=24 * doctor.GiB, peak_scale=1.25)
    real = estimate.estimate_peak

    def recording(mode, sizes, geometry, phases=None):
        value = real(mode, sizes, geometry, phases)
        fake.estimates.append(value)
        return value

    monkeypatch.setattr(estimate, "estimate_peak", recording)
    monkeypatch.setattr(doctor, "driver_version", lambda: "999.1")
    return fake


def test_cuda_sections_run_through_a_fake_accelerator(fake_cuda):
    settings = doctor.Settings.make(torch.device("cpu"), quick=True, accelerator=fake_cuda,
                                    sections=("versions", "dit", "bandwidth", "recipe"))
    # what a GPU run uses: bf16, the published expert count, a copy test
    assert settings.dtype == torch.bfloat16 and settings.experts is None and settings.copy_bytes > 0
    settings = replace(settings, height=32, width=32, num_frames=1, text_tokens=16, dtype=torch.float32,
                       experts=doctor.CPU_EXPERTS, copy_bytes=2**20)  # CPU-sized work, the GPU's code path
    report = doctor.run(settings, accelerator=fake_cuda)
    assert report["cuda_only"] == []
    sections = report["sections"]
    assert sections["versions"]["cuda"]["driver"] == "999.1"
    assert sections["versions"]["device"]["capability"] == "8.9"
    rows = sections["dit"]["rows"]
    assert [r["mode"] for r in rows] == [*MODE_ORDER, *MODE_ORDER]
    for row in rows:
        assert row["status"] == "ran", row.get("error")
        assert row["peak_bytes"] == int(row["estimate_bytes"] * 1.25)
        assert row["measured_vs_estimate"] == pytest.approx(1.25, rel=1e-6)
        assert row["calibration_factor"] == 1.0  # no CUDA device name: nothing filed for it
    bandwidth = sections["bandwidth"]
    assert bandwidth["status"] == "ran" and bandwidth["pinned_GBps"] > 0 and bandwidth["pageable_GBps"] > 0
    assert fake_cuda.pinned == [True, False]
    rec = sections["recipe"]
    assert rec["status"] == "ran", rec.get("traceback")
    assert rec["vram_bytes"] == 24 * doctor.GiB
    assert rec["measured_factor"] == pytest.approx(1.25, rel=1e-6)
    assert rec["verdict"] in ("confirmed", "corrected")
    text = doctor.render(report)
    assert "[recipe] ran" in text and "measured/est" in text


def test_recipe_is_confirmed_or_corrected_by_the_measured_factor():
    vram, host = 24 * doctor.GiB, 64 * doctor.GiB
    usable_vram = int(vram - recipes.DESKTOP_GIB * doctor.GiB)
    usable_host = int(host - recipes.SYSTEM_GIB * doctor.GiB)
    estimated = recipes.recipe_for(usable_vram, usable_host).settings()
    assert doctor.recipe_check(vram, host, None)["verdict"] == "not checked"
    same = doctor.recipe_check(vram, host, 1.0)
    assert same["verdict"] == "confirmed" and same["estimated"] == estimated == same["checked"]
    worse = doctor.recipe_check(vram, host, 3.0)  # peaks three times the estimate: a smaller recipe
    assert worse["verdict"] == "corrected" and worse["checked"] != estimated
    scaled = int((usable_vram - estimate.RESERVE_BYTES) / 3.0 + estimate.RESERVE_BYTES)
    assert worse["checked"] == recipes.recipe_for(scaled, usable_host).settings()


def test_a_cold_read_at_cache_speed_is_flagged(tmp_path, monkeypatch):
    """When the first read is as fast as the cached one, the report says it did not measure the disk."""
    monkeypatch.setattr(doctor, "_read_all", lambda path: 0.01)
    settings = replace(doctor.Settings.make(torch.device("cpu"), quick=True, disk_dir=str(tmp_path)),
                       disk_bytes=2**20)
    section = doctor.disk_read(doctor.Doctor(settings, doctor.Accelerator(settings.device)))
    assert "not the disk's speed" in section["note"]
    assert not list(tmp_path.iterdir())  # the test file is gone


def test_the_doctor_uses_lingbot_cores_public_names_only():
    """What the doctor measures is what a user's run goes through: no private name of lingbot_core."""
    tree = ast.parse(Path(doctor.__file__).read_text())
    ours: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("lingbot_core")):
            parts = (node.module or "").split(".") + [a.name for a in node.names]
            assert not [p for p in parts if p.startswith("_") and p != "__future__"], ast.unparse(node)
            ours.update(a.asname or a.name for a in node.names)
    private = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
               and n.value.id in ours and n.attr.startswith("_")]
    assert not private, private
