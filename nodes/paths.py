"""Which files a node may touch: the host's folders inside ComfyUI, the user's machine headless.

A ComfyUI server may be shared, and every path in a workflow is the client's to choose, so inside
ComfyUI our nodes stay in ComfyUI's folders: Save Video in the output folder, Load Image in the
input (or annotated output/temp) folder, the Loader in the model folders. Headless, the person
running ``lingbot-run`` owns the machine: any image or checkpoint path is fine, and saving still
stays inside ``--output``. Refusals never say whether a path outside exists.
"""

from __future__ import annotations

import mimetypes
import os
from pathlib import Path

from lingbot_core.save_path import (
    SaveTarget,
    UnsafePrefix,
    check_prefix,
    expand_prefix,
    is_inside,
    split_prefix,
)
from lingbot_core.save_path import save_target as headless_save_target

from . import runtime

ANY_MODEL_PATH_ENV = "LINGBOT_ALLOW_ANY_MODEL_PATH"
_ANNOTATIONS = {"[input]": "input", "[output]": "output", "[temp]": "temp"}


def _folder_paths():
    return runtime._comfy("folder_paths") if runtime.in_comfy() else None


# -- caches ----------------------------------------------------------------------------------------

def calibration_dir() -> str | None:
    """Where MagCache calibrations are written: ComfyUI's user folder inside ComfyUI (a workflow never
    chooses the path), else None (the core's user cache folder)."""
    folder_paths = _folder_paths()
    if folder_paths is None:
        return None
    return str(Path(folder_paths.get_user_directory()) / "lingbot" / "magcache")


# -- saving ----------------------------------------------------------------------------------------

def save_target(prefix: str, width: int = 0, height: int = 0) -> SaveTarget:
    """Where a save with this prefix goes, checked when the file is written (links included).

    Inside ComfyUI the folder and counter come from ``folder_paths.get_save_image_path`` (ComfyUI's
    own rules and its own outside-the-folder refusal); our stricter, portable checks run first.
    """
    output_dir = runtime.output_dir()
    expanded = expand_prefix(prefix, width=width, height=height)
    # empty stem, '..', absolute, backslash, drive, control characters, and a folder that resolves outside
    # (an operator's symlink in the output folder): ComfyUI's get_save_image_path creates the folder before
    # its own check, which compares paths without following links, so this must come first
    check_prefix(prefix, output_dir, width=width, height=height)
    folder_paths = _folder_paths()
    comfy_save_path = getattr(folder_paths, "get_save_image_path", None)
    if comfy_save_path is None:  # headless (or a host without it): the same rules in our own code
        return headless_save_target(prefix, output_dir, width=width, height=height)
    try:
        folder, stem, counter, subfolder, _ = comfy_save_path(expanded, str(output_dir), width, height)
    except Exception as exc:  # ComfyUI raises a bare Exception for a folder outside the output folder
        raise UnsafePrefix(f"filename_prefix {prefix[:80]!r} is not inside the output folder") from exc
    if not is_inside(Path(output_dir), Path(folder)):
        raise UnsafePrefix(f"filename_prefix {prefix[:80]!r} resolves outside the output folder")
    return SaveTarget(Path(folder), stem, int(counter), str(subfolder).replace(os.sep, "/"))


def check_save_prefix(prefix: str) -> str | None:
    """A validation-time check of a constant prefix (no folder is created): None, or the problem."""
    try:
        expanded = expand_prefix(prefix)
        folders, _stem = split_prefix(expanded)
        root = runtime.output_dir()
        if not is_inside(root, root.joinpath(*folders)):
            return f"filename_prefix {prefix[:80]!r} resolves outside the output folder"
    except UnsafePrefix as err:
        return str(err)
    return None


# -- images ----------------------------------------------------------------------------------------

def _annotated(name: str) -> tuple[str, str | None]:
    """``"x.png [output]"`` -> ``("x.png", "output")``, as ComfyUI's annotated file names work."""
    for suffix, kind in _ANNOTATIONS.items():
        if name.endswith(suffix):
            return name[: -len(suffix)].rstrip(), kind
    return name, None


def _host_dir(kind: str) -> Path:
    folder_paths = _folder_paths()
    getter = {"input": "get_input_directory", "output": "get_output_directory", "temp": "get_temp_directory"}[kind]
    return Path(getattr(folder_paths, getter)())


def image_path(name: str, what: str = "image") -> Path:
    """The file a Load Image ``path`` names: inside ComfyUI, only in its input/output/temp folders.

    The same message answers a missing file and a path outside the folders, so a client cannot use
    the node (or its validation) to learn what exists on the server. `what` names the file in the
    messages (Load Video reads its files by the same rules).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"no {what} file given")
    if _folder_paths() is None:
        path = Path(name).expanduser()
        if not path.is_file():
            raise ValueError(f"{what} file not found: {name}")
        return path
    relative, kind = _annotated(name.strip())
    base = _host_dir(kind or "input")
    refusal = ValueError(f"{what} {name[:200]!r} is not a file in ComfyUI's {kind or 'input'} folder "
                         "(upload it there, or name it 'file.png [output]' for an output)")
    if "\x00" in relative or Path(relative).is_absolute() or "\\" in relative or ":" in relative:
        raise refusal
    target = base / relative
    if not is_inside(base, target) or not target.is_file():
        raise refusal
    return target


def input_images() -> list[str]:
    """Image files in ComfyUI's input folder (for a combo); empty headless."""
    if _folder_paths() is None:
        return []
    base = _host_dir("input")
    names = []
    try:
        for entry in sorted(os.listdir(base)):
            if entry.lower().endswith((".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif")) \
                    and (base / entry).is_file():
                names.append(entry)
    except OSError:
        return []
    return names


def input_videos() -> list[str]:
    """Video files in ComfyUI's input folder (for Load Video's upload combo), sorted; empty headless.

    Kept by their MIME type as core Load Video keeps them (ComfyUI's `filter_files_content_types`
    where the host has it, else the same rule through `mimetypes`), so both list the same files."""
    if _folder_paths() is None:
        return []
    base = _host_dir("input")
    try:
        names = sorted(entry for entry in os.listdir(base) if (base / entry).is_file())
    except OSError:
        return []
    by_type = getattr(_folder_paths(), "filter_files_content_types", None)
    if callable(by_type):
        return sorted(by_type(names, ["video"]))
    return [name for name in names if (mimetypes.guess_type(name, strict=False)[0] or "").startswith("video/")]



# -- checkpoints -----------------------------------------------------------------------------------

def model_folders() -> list[Path]:
    """Every folder ComfyUI keeps models in (its models dir and each registered model path)."""
    folder_paths = _folder_paths()
    roots: list[Path] = []
    if folder_paths is not None:
        models_dir = getattr(folder_paths, "models_dir", None)
        if models_dir:
            roots.append(Path(models_dir))
        for paths, _extensions in getattr(folder_paths, "folder_names_and_paths", {}).values():
            roots += [Path(p) for p in paths]
    roots += runtime.model_roots()
    return list(dict.fromkeys(roots))


def checkpoint_path(path: str) -> Path:
    """The Loader's ``path`` input: any folder headless; inside ComfyUI one of its model folders.

    The check is made on the path alone, before anything is looked up, so the answer for a folder
    outside the model folders is the same whether it exists or not. Starting ComfyUI with
    ``LINGBOT_ALLOW_ANY_MODEL_PATH=1`` lifts the restriction (for a single-user machine).
    """
    raw = path.strip()
    if _folder_paths() is None or os.environ.get(ANY_MODEL_PATH_ENV) == "1":
        return Path(raw).expanduser()
    roots = model_folders()
    candidate = Path(raw)
    if "\x00" in raw:
        candidate = None
    elif not candidate.is_absolute():
        candidate = roots[0] / candidate if roots else None
    if candidate is None or not any(is_inside(root, candidate) for root in roots):
        raise ValueError(
            "inside ComfyUI the Loader's path must be a folder under ComfyUI's model folders (e.g. "
            "models/lingbot_video/<name>); start ComfyUI with LINGBOT_ALLOW_ANY_MODEL_PATH=1 to load from "
            "anywhere (single-user machines only)")
    return candidate


PROCESSOR_SUBFOLDERS = ("", "processor", "tokenizer")
"""Where the processor's files are read from, under a processor folder (`checkpoints.processor_files.resolve_processor_folder`)."""


def check_folder_files_inside(folder: Path, what: str, subs: tuple[str, ...] = PROCESSOR_SUBFOLDERS) -> None:
    """Inside ComfyUI (restricted), refuse a folder whose files (its own, and those of its processor/ and
    tokenizer/ sub-folders: what the processor reads) resolve outside the model folders: a symlinked
    `tokenizer.json` would read any file on the server. Headless, or with the override, any is fine."""
    if _folder_paths() is None or os.environ.get(ANY_MODEL_PATH_ENV) == "1":
        return
    roots = model_folders()
    for sub in subs:
        where = folder / sub if sub else folder
        try:
            names = sorted(os.listdir(where))[:10000] if where.is_dir() else []
        except OSError:
            continue
        for name in names:
            candidate = where / name
            if not any(is_inside(root, candidate) for root in roots):
                raise ValueError(f"{what}: {(Path(sub) / name).as_posix()!r} in {folder.name!r} links outside "
                                 "ComfyUI's model folders; copy the file into the folder (or start ComfyUI "
                                 f"with {ANY_MODEL_PATH_ENV}=1 on a single-user machine)")


__all__ = ["ANY_MODEL_PATH_ENV", "check_folder_files_inside", "check_save_prefix", "checkpoint_path", "image_path", "input_images", "input_videos",
           "model_folders", "save_target"]
