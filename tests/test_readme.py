"""The README's numbers, commands and pictures are checked against what they claim to come from; so are the
docs/ pages it moved its reference material to (`GUIDE`: their commands are run or parsed here too)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from bench.recipes import GUIDE

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8") for path in GUIDE}  # README first


ILLUSTRATIVE = "(illustrative"  # in the paragraph just above a code block: the block is not run


def _blocks(text: str, language: str) -> list[tuple[str, str]]:
    """(the paragraph line just above, the code) for every fenced block of `language`."""
    out = []
    for match in re.finditer(r"```" + language + r"\n(.*?)```", text, flags=re.S):
        above = [line for line in text[:match.start()].splitlines() if line.strip()]
        out.append((above[-1] if above else "", match.group(1)))
    return out


def _checked(language: str) -> list[str]:
    return [code for text in PAGES.values() for above, code in _blocks(text, language) if ILLUSTRATIVE not in above]


UV_RUN_OPTIONS = ("--no-sync",)  # the `uv run` options the guide uses


def _inside_uv_run(argv: list[str]) -> list[str]:
    """`uv run [options] CMD ...` runs CMD in the project's environment: the command is CMD."""
    if argv[:2] != ["uv", "run"]:
        return argv
    rest = argv[2:]
    while rest and rest[0].startswith("-"):
        assert rest[0] in UV_RUN_OPTIONS, f"guide: unexpected uv run option in {argv}"
        rest = rest[1:]
    return rest


def _all_commands() -> list[list[str]]:
    """Every command line in the guide's bash blocks not marked illustrative (continuations
    joined, comments dropped, `a && b` split, a leading `uv run` dropped)."""
    commands = []
    for block in _checked("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                commands.append(_inside_uv_run(words[:cut]))
                words = words[cut + 1:]
    return commands


def _code_commands(program: str) -> list[list[str]]:
    """Every `program ...` command in the README's bash blocks."""
    n = len(program.split())
    return [argv for argv in _all_commands() if argv[:n] == program.split()]


def _table_rows(header_start: str, text: str | None = None) -> list[list[str]]:
    """The rows of the table whose header line starts with `header_start`, in `text` (default: the first
    guide page that has it, the README first)."""
    if text is None:
        text = next(t for t in PAGES.values() if any(line.startswith(header_start) for line in t.splitlines()))
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_offload_table_is_what_the_bench_script_prints():
    from bench.memory_table import MODES, collect

    data = collect()
    printed = {key: [f"{est[m] / 1024**3:.1f}" for m in MODES] for key, est in data["estimate"].items()}
    readme = {row[0]: row[1:] for row in _table_rows("| model and size")}
    assert readme == printed
    assert "not yet confirmed by a GPU run" in PAGES["docs/memory.md"]  # labelled as an estimate

    disk = _table_rows("| checkpoint | transformer")
    for row, variant in zip(disk, ("dense", "moe")):
        total = sum(data["disk"][variant]["bytes"].values()) / 1e9
        assert row[-1] == f"**{total:.1f} GB**", row


@pytest.mark.parametrize("argv", _code_commands("lingbot-run"), ids=lambda a: " ".join(a[:2]))
def test_readme_commands_are_complete_and_valid(argv, tmp_path):
    """No placeholder `...`; every --set applies to the named workflow (nothing is run)."""
    from lingbot_core.workflow import apply_overrides, load_workflow
    from lingbot_nodes import NODE_CLASS_MAPPINGS
    from lingbot_nodes.cli import build_parser, resolve_workflow

    assert "..." not in argv
    args = build_parser().parse_args(argv[1:])
    prompt = load_workflow(resolve_workflow(args.workflow), NODE_CLASS_MAPPINGS)
    changed = apply_overrides(prompt, args.overrides, NODE_CLASS_MAPPINGS)
    for text in args.overrides:
        assert text.split("=", 1)[1] in {str(v) for node in changed.nodes.values() for v in node["inputs"].values()}


def test_a_complete_moe_command_is_shown():
    moe = [a for a in _code_commands("lingbot-run") if a[1:2] == ["moe"]]
    assert moe and any("--model" in a for a in moe)
    assert "--set Refine.width=1920 --set Refine.height=1088 ..." not in README


def test_pictures_exist_and_are_pngs():
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README)
    assert pictures
    for rel in pictures:
        data = (ROOT / rel).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", rel


# -- every command and snippet is run or checked -------------------------------------------------

def _pip_install(argv: list[str]) -> None:
    """The install lines: the torch wheel index is PyTorch's, the requirements file and the
    package extra exist, and requirements.txt lists every runtime dependency but torch."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    args = argv[2:]
    if "--index-url" in args:
        url = args[args.index("--index-url") + 1]
        assert re.fullmatch(r"https://download\.pytorch\.org/whl/(cpu|cu\d{3})", url), url
        assert {a for a in args if not a.startswith("-") and a != url} <= {"torch", "torchvision"}
    elif "-r" in args:
        wanted = [d for d in project["dependencies"] if not d.startswith(("torch", "torchvision"))]
        lines = [line.strip() for line in (ROOT / args[args.index("-r") + 1]).read_text().splitlines()
                 if line.strip() and not line.startswith("#")]
        assert sorted(lines) == sorted(wanted)
    else:
        assert args[0] == "-e", argv
        extra = re.fullmatch(r"\.\[(\w+)\]", args[1])
        assert extra and extra.group(1) in project["optional-dependencies"], argv


def _landed(args: list[str]) -> tuple[Path, Path, str | None]:
    """`hf download REPO [FILE] ... --local-dir DIR` (args after `hf download`): DIR, where the file (or the
    first --include folder) lands, and FILE. hf keeps the repository's folders: FILE lands at DIR/FILE."""
    dest = Path(args[args.index("--local-dir") + 1])
    file = args[1] if len(args) > 1 and not args[1].startswith("-") else None
    include = [args[i + 1].split("/")[0] for i, a in enumerate(args) if a == "--include"]
    return dest, dest / file if file else dest / include[0] if include else dest, file


def _hf_download(argv: list[str]) -> None:
    """A download lands where the pack looks (headless roots): a checkpoint folder in a checkpoint root
    (--exclude naming a real component), a LoRA in a LoRA root, a single file (or the processor folder)
    under the model folder of its kind, with that kind's suffix."""
    from bench.memory_table import REPOS
    from lingbot_core.tiny import ensure_tiny_checkpoint
    from lingbot_nodes.files import FILE_KINDS, file_roots
    from lingbot_nodes.lora import lora_roots
    from lingbot_nodes.runtime import model_roots

    args = argv[2:]
    repo = args[0]
    dest, landed, file = _landed(args)
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", repo)
    if dest.parent in model_roots() and landed == dest:
        assert repo in REPOS.values()
        for pattern in (args[i + 1] for i, a in enumerate(args) if a == "--exclude"):
            assert (ensure_tiny_checkpoint("moe") / pattern.split("/")[0]).is_dir(), pattern
    elif landed.parent in lora_roots():
        assert file and file.endswith(".safetensors"), argv
    else:
        # single files for LingBot Loader (files): the checkpoint's own files, or Comfy-Org's repacks
        kinds = [k for k in FILE_KINDS if any(landed.is_relative_to(root) for root in file_roots(k))]
        assert kinds, f"{landed} is in no folder the Loader (files) reads"
        assert repo in {*REPOS.values(), *COMFY_REPACKS}, repo
        if file:
            assert landed.suffix in FILE_KINDS[kinds[0]].suffixes, argv
        else:  # a folder of the checkpoint (the processor)
            assert (ensure_tiny_checkpoint("dense") / landed.name).is_dir(), argv


COMFY_REPACKS = ("Comfy-Org/Wan_2.1_ComfyUI_repackaged", "Comfy-Org/Qwen3-VL")


def _download_lines(text: str) -> list[tuple[str, list[str]]]:
    """(the comment line just above, the words) of every `hf download` line in `text`'s bash blocks."""
    out = []
    for _above, code in _blocks(text, "bash"):
        lines = code.replace("\\\n", " ").splitlines()
        for i, line in enumerate(lines):
            if line.startswith("hf download"):
                out.append((lines[i - 1] if i and lines[i - 1].startswith("#") else "", shlex.split(line, comments=True)))
    return out


def test_single_file_downloads_land_where_the_files_table_says():
    """`hf download REPO FILE --local-dir DIR` writes DIR/FILE (subfolders kept): the comment above each
    such line states that path, the path lies in a folder the files table names, and the table's column
    for that folder names the file."""
    from bench import files_table, recipes

    table = recipes.readme_block(README, files_table.START, files_table.END)
    header = [cell.strip() for cell in table.splitlines()[0].strip("|").split("|")]
    rows = _table_rows("| GPU | DiT, in", README)
    checked = 0
    for comment, argv in _download_lines(README):
        dest, landed, file = _landed(argv[2:])
        if landed == dest:
            continue  # a whole checkpoint folder (LingBot Loader)
        said = comment.removeprefix("# -> ").split(" (")[0].rstrip("/")
        assert comment.startswith("# -> ") and Path(said) == landed, (comment, landed.as_posix())
        folder = "/".join(landed.parts[:2])
        assert f"`{folder}`" in table, f"the files table names no folder {folder} (for {landed})"
        columns = [i for i, cell in enumerate(header) if f"`{folder}`" in cell]
        if file and columns:
            cells = " ".join(row[columns[0]] for row in rows)
            assert f"`{file}`" in cells or f"`{landed.name}`" in cells, (landed, header[columns[0]])
        checked += 1
    assert checked >= 4


def _quantize(argv: list[str]) -> None:
    from lingbot_core.quantize import TARGETS

    src, dst = argv[3:5]
    assert argv[argv.index("--to") + 1] in TARGETS
    downloads = {a[a.index("--local-dir") + 1] for a in _code_commands("hf download")}
    assert src in downloads and Path(dst).parent == Path(src).parent


def _uv_pip_install(argv: list[str]) -> None:
    """The set-up line for another torch build: the package's test extra, exactly the torch pins that
    uv.lock is resolved under (the versions CI tests), and a torch backend uv knows."""
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    args = argv[3:]
    backend = args[args.index("--torch-backend") + 1]
    assert re.fullmatch(r"cpu|auto|cu\d{3}", backend), backend
    extra = re.fullmatch(r"\.\[(\w+)\]", args[args.index("-e") + 1])
    assert extra and extra.group(1) in pyproject["project"]["optional-dependencies"], argv
    pins = [a for a in args if not a.startswith("-") and a not in (backend, extra.group(0))]
    assert sorted(pins) == sorted(pyproject["tool"]["uv"]["constraint-dependencies"]), argv


SHELL = {("python3", "-m", "venv"), (".",), ("cd",), ("python", "-m", "pytest"), ("pytest",), ("uv", "venv")}


def test_every_readme_command_is_checked():
    """Each command line is parsed by the program it calls (or its inputs checked); a command no
    check knows fails here: check it, or mark its block illustrative."""
    from lingbot_core.__main__ import build_parser as core_parser
    from lingbot_nodes.cli import build_parser as run_parser

    kinds = set()
    for argv in _all_commands():
        if argv[:2] == ["pip", "install"] or argv[:4] == ["python", "-m", "pip", "install"]:
            _pip_install(argv[2:] if argv[0] == "python" else argv)
        elif argv[:3] == ["uv", "pip", "install"]:
            _uv_pip_install(argv)
        elif argv[:2] == ["hf", "download"]:
            _hf_download(argv)
        elif argv[:3] == ["python", "-m", "lingbot_core.quantize"]:
            _quantize(argv)
        elif argv[:3] == ["python", "-m", "lingbot_core.doctor"]:
            from lingbot_core.doctor import parse_args as doctor_args

            doctor_args(argv[3:])
        elif argv[:3] == ["python", "-m", "lingbot_core"]:
            core_parser().parse_args(argv[3:])
        elif argv[0] == "lingbot-run":
            run_parser().parse_args(argv[1:])
        elif argv[0] == "torchrun":  # torchrun [its options] -m lingbot_nodes [lingbot-run's options]
            from torch.distributed.run import get_args_parser as torchrun_parser

            launch = torchrun_parser().parse_args(argv[1:])  # torchrun's own parser: its options, multi-node too
            assert launch.module and launch.training_script == "lingbot_nodes", argv
            run_parser().parse_args(launch.training_script_args)
        else:
            assert any(tuple(argv[:len(s)]) == s for s in SHELL), f"no check for README command {argv}"
        kinds.add(argv[0])
    assert {"hf", "lingbot-run", "python", "pytest", "uv"} <= kinds


def test_python_snippet_runs_and_saves(tmp_path, monkeypatch, capsys):
    """The README's Python example, as printed, on the tiny checkpoint: it writes its video."""
    snippets = _checked("python")
    assert snippets
    monkeypatch.chdir(tmp_path)
    for code in snippets:
        exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
    written = [Path(line) for line in capsys.readouterr().out.splitlines() if line.endswith((".mp4", ".png"))]
    assert written and all((tmp_path / p).is_file() and (tmp_path / p).stat().st_size > 0 for p in written)


def test_illustrative_blocks_say_so():
    """Blocks the tests do not run are labelled for the reader, and only config examples are."""
    for language in ("bash", "python", "yaml", "json"):
        for above, code in (block for text in PAGES.values() for block in _blocks(text, language)):
            if ILLUSTRATIVE in above:
                assert language in ("yaml", "json"), code
    assert any(_blocks(text, "yaml") for text in PAGES.values())


def test_no_machine_paths_in_user_docs():
    for path in (*GUIDE, ROOT / "docs" / "benchmarks.md"):
        text = path.read_text()
        assert not re.search(r"(?<![\w.])/(work|root|home|Users|tmp)/", text), path


def test_benchmarks_moved_with_their_commands():
    """Measured tables live in docs/benchmarks.md, each section naming the bench script it came from."""
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    for section in re.split(r"\n## ", bench)[1:]:
        assert re.search(r"bench/\w+\.py", section), section[:60]
    for script in ("fewstep.py", "weights.py", "lora.py", "quant_error.py", "offload_gpu.py"):
        assert f"bench/{script}" in bench
        assert (ROOT / "bench" / script).is_file()
    assert "| recipe | DiT calls" not in README and "| recipe | DiT calls" in bench


def test_graph_picture_is_drawn_from_the_current_workflow():
    """docs/graph-moe-refine.png carries the digest of what it was drawn from; regenerate it with
    `python docs/render_graph.py` when the workflow, a node's inputs or the renderer change."""
    import importlib.util

    from PIL import Image

    spec = importlib.util.spec_from_file_location("render_graph", ROOT / "docs" / "render_graph.py")
    render_graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render_graph)
    with Image.open(ROOT / "docs" / "graph-moe-refine.png") as image:
        drawn_from = image.text.get(render_graph.DIGEST_KEY)
    from workflows import build

    expected = render_graph.inputs_digest(build.ui_path("lingbot_t2v_moe_refine"))
    assert drawn_from == expected, "docs/graph-moe-refine.png is stale: run python docs/render_graph.py"


def test_recipes_table_is_what_the_estimator_gives():
    """The hardware recipes are generated by bench/recipes.py from the estimator, and labelled."""
    from bench import recipes

    page = recipes.home(recipes.START).read_text(encoding="utf-8")
    assert recipes.readme_block(page) == recipes.table()
    above = page[:page.index(recipes.START)]
    assert "an estimate, not yet confirmed by a GPU run" in above[above.rindex("\n## "):]
    # spot-check a cell against the fit check itself: what the table says fits does fit
    from lingbot_core.placement import fit
    from lingbot_core.placement.estimate import Geometry

    cell = recipes.recipe(24, 64)
    fmt = cell.weights.split(" (")[0]
    sizes = recipes.sizes_for("moe", fmt)
    w, h = map(int, cell.refine.split("x"))
    vram, host = int(23.5 * fit.GiB), int(60 * fit.GiB)
    verdict = fit.check(sizes, Geometry(480, 832, 121, refine=(h, w), vae_tiling=True, release_base=True,
                                        ffn_chunk=recipes.run_chunk()),
                        cell.mode, cell.offload_to, vram_free=vram, host_free=host)
    assert verdict.ok, verdict.line()


def test_files_table_gpu_column_is_the_estimate_and_agrees_with_the_recipes():
    """'Which files do I need?' is bench/files_table.py's table; each dense row is the dense recipe of
    `recipe_for` for that card (the settings the fit check accepts, its figure), and where the recipes
    table picks the dense model too, the same size and mode (an 8 GB card: one answer, not two)."""
    from bench import files_table, recipes

    assert recipes.home(files_table.START) == recipes.README  # the README's one "which files" table
    assert recipes.readme_block(README, files_table.START, files_table.END) == files_table.gpu_table()
    rows = {row[0]: row for row in _table_rows("| GPU | DiT, in `models/diffusion_models`")}
    assert set(rows) == {f"{gb} GB" for gb in (*files_table.DENSE_GPUS, files_table.MOE_GPU)} | {files_table.STUDENT_GPU}
    for gb in files_table.DENSE_GPUS:
        vram, host = recipes.machine_budget(gb, files_table.FILES_RAM_GB)
        dense = recipes.recipe_for(vram, host, variants=("dense",), ffn_chunk=recipes.run_chunk())
        row = rows[f"{gb} GB"]
        w, h, frames = dense.base.split("x")
        assert f"{w}x{h}, {frames} frames" in row[4] and f"`{dense.mode}`" in row[4], row
        assert row[5] == recipes.need_cell(dense.need_gib, dense.chunk), row
        assert dense.need_gib <= gb - recipes.DESKTOP_GIB
        same = [c for c in (recipes.recipe(gb, ram) for ram in recipes.RAM_GB) if c.model.startswith("dense")]
        assert all(c.base == dense.base and c.mode == dense.mode for c in same), (row, same)
    assert any(c.model.startswith("dense") for c in [recipes.recipe(8, ram) for ram in recipes.RAM_GB])


def test_template_thumbnails_are_drawn_from_their_workflows():
    """Each shipped editor file has `<title>.jpg` beside it (ComfyUI's template browser asks for it), a
    square card drawn from the current workflow, title and summary: `python workflows/build.py` redraws."""
    import importlib.util

    from PIL import Image

    from workflows import build

    spec = importlib.util.spec_from_file_location("render_graph", ROOT / "docs" / "render_graph.py")
    render_graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render_graph)
    for name in build.WORKFLOWS:
        with Image.open(build.thumbnail_path(name)) as image:
            assert image.format == "JPEG" and image.size == (render_graph.THUMBNAIL_SIZE,) * 2, name
    assert build.stale_thumbnails(render_graph) == []


def test_format_sizes_are_computed_from_the_real_configuration():
    """The 'Smaller DiT files' sizes are the MoE DiT's bytes per format (bench/recipes.py)."""
    from bench import recipes

    dit = recipes.model_facts()["moe"]["dit"]
    rows = {row[0].split(" (")[0]: row[1] for row in _table_rows("| format | MoE DiT on disk")}
    for name in ("bf16", "GGUF Q8_0", "GGUF Q4_0", "fp8"):
        assert rows[name] == f"{dit[name] / 1e9:.1f} GB", name


# -- the guide's shape: links that resolve, headings that nest, a README that stays a guide -------------------

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(text: str) -> list[tuple[int, str]]:
    """(level, text) of every heading outside code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (found := re.match(r"(#{1,6}) (.*)", line)):
            out.append((len(found.group(1)), found.group(2)))
    return out


def test_guide_links_resolve():
    """Every relative link in the README and its docs pages names a file that exists and, with `#...`, a
    heading of that file (the reference moved out of the README: a stale anchor fails here)."""
    for name, text in PAGES.items():
        page = ROOT / name
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{name}: link to missing {target}"
            if anchor and linked.suffix == ".md":
                anchors = {_slug(h) for _, h in _headings(linked.read_text(encoding="utf-8"))}
                assert anchor in anchors, f"{name}: no heading #{anchor} in {linked.name}"


def test_guide_headings_nest():
    """One title per page, then no level skipped (an H4 straight under an H2 reads as misplaced)."""
    for name, text in PAGES.items():
        levels = [level for level, _ in _headings(text)]
        assert levels[0] == 1 and levels.count(1) == 1, name
        for before, after in zip(levels, levels[1:]):
            assert after <= before + 1, (name, _headings(text))


def test_named_workflows_ship():
    """Every API file the guide names (`lingbot_t2v_dense_dmd8.json`, ...) is in `workflows/api/`, and every
    template it names in bold by a title ("**Text to video · dense 1.3B**") is a shipped workflow's title."""
    from workflows import build

    named = {name for text in PAGES.values() for name in re.findall(r"\blingbot_\w+\.json", text)}
    assert named and sorted(n for n in named if not (ROOT / "workflows" / "api" / n).is_file()) == []
    titles = {spec["title"] for spec in build.WORKFLOWS.values()}
    bold = {t for text in PAGES.values() for t in re.findall(r"\*\*([^*]+ · [^*]+)\*\*", text)}
    assert bold and sorted(bold - titles) == []


README_MAX_LINES = 420  # about a screenful per section; reference material goes to docs/ (GUIDE)


def test_readme_stays_a_guide():
    """The README is the user's guide, not the reference: it stays short, and every docs page of the guide
    is linked from it."""
    assert len(README.splitlines()) <= README_MAX_LINES, "move reference material to a docs/ page"
    for path in GUIDE[1:]:
        assert f"](docs/{path.name})" in README, path.name
