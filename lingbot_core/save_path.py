"""Where a Save node may write: ComfyUI's filename-prefix rules, and the refusal of everything else.

A ``filename_prefix`` comes from a workflow, possibly through a link (a PrimitiveString), so it is
judged when the file is written, not only when the prompt is validated. The rules follow ComfyUI
(``folder_paths.get_save_image_path``) so a prefix means the same in the editor, in ComfyUI's
API and headless:

- ``%date:FORMAT%`` as the frontend expands it (``yyyy``, ``yy``, ``MM``/``M``, ``dd``/``d``,
  ``hh``/``h`` (24 h), ``mm``/``m``, ``ss``/``s``), then the server's ``%year%``, ``%month%``,
  ``%day%``, ``%hour%``, ``%minute%``, ``%second%``, ``%width%`` and ``%height%``;
- the part before the last ``/`` is a sub-folder of the output folder, the rest the file stem;
- files are named ``<stem>_<counter:05>_.<ext>``, the counter one past the highest already there.

Stricter than ComfyUI where a prefix is ambiguous or not portable: an empty stem (``""``, ``"."``,
``"./"``, ``"x/"``), absolute paths, ``..``, backslashes, drive letters (``D:x``), NUL and other
control characters are refused, and so is any folder that resolves (symlinks followed) outside the
output folder.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import surrogate_problem

MAX_PREFIX_CHARS = 1024
_DATE_TOKEN = re.compile(r"d{1,2}|M{1,2}|h{1,2}|m{1,2}|s{1,2}|y{2,4}")
_DATE_FIELD = re.compile(r"%date:([^%]*)%")
_SERVER_VARS = ("year", "month", "day", "hour", "minute", "second")


class UnsafePrefix(ValueError):
    """A filename prefix that would write outside the output folder, or that is not a file name."""


@dataclass(frozen=True)
class SaveTarget:
    folder: Path  # absolute, inside the output folder, created
    stem: str
    counter: int
    subfolder: str  # relative to the output folder, "/"-separated ("" for the folder itself)

    def path(self, extension: str) -> Path:
        return self.folder / f"{self.stem}_{self.counter:05d}_.{extension.lstrip('.')}"


def _format_date(pattern: str, now: time.struct_time) -> str:
    def field(match: re.Match[str]) -> str:
        token = match.group(0)
        if token[0] == "y":
            if token == "yyyy":
                return f"{now.tm_year:04d}"
            if token == "yy":
                return f"{now.tm_year % 100:02d}"
            return token  # "yyy" stays as written, as in the frontend
        value = {"d": now.tm_mday, "M": now.tm_mon, "h": now.tm_hour, "m": now.tm_min, "s": now.tm_sec}[token[0]]
        return str(value).zfill(len(token))

    return _DATE_TOKEN.sub(field, pattern)


def expand_prefix(prefix: str, *, width: int = 0, height: int = 0, now: time.struct_time | None = None) -> str:
    """The prefix with its ``%...%`` fields filled in (the frontend's and the server's)."""
    now = now or time.localtime()
    prefix = _DATE_FIELD.sub(lambda m: _format_date(m.group(1), now), prefix)
    if "%" not in prefix:
        return prefix
    values = {"width": width, "height": height, "year": now.tm_year, "month": now.tm_mon, "day": now.tm_mday,
              "hour": now.tm_hour, "minute": now.tm_min, "second": now.tm_sec}
    for name, value in values.items():
        text = str(value) if name in ("width", "height", "year") else f"{value:02d}"
        prefix = prefix.replace(f"%{name}%", text)
    return prefix


def split_prefix(prefix: str) -> tuple[list[str], str]:
    """(sub-folder parts, stem) of an expanded prefix; UnsafePrefix for anything not portable."""
    if not isinstance(prefix, str):
        raise UnsafePrefix(f"filename_prefix must be text, got {type(prefix).__name__}")
    shown = prefix if len(prefix) <= 80 else prefix[:80] + "..."
    if len(prefix) > MAX_PREFIX_CHARS:
        raise UnsafePrefix(f"filename_prefix is {len(prefix)} characters; at most {MAX_PREFIX_CHARS}")
    surrogate = surrogate_problem(prefix, "filename_prefix")
    if surrogate:
        raise UnsafePrefix(surrogate)
    if any(ord(c) < 32 or c == "\x7f" for c in prefix):
        raise UnsafePrefix(f"filename_prefix {shown!r} contains control characters")
    if "\\" in prefix:
        raise UnsafePrefix(f"filename_prefix {shown!r} contains a backslash; use '/' between folders")
    if re.match(r"^[A-Za-z]:", prefix) or ":" in prefix:
        raise UnsafePrefix(f"filename_prefix {shown!r} contains ':' (a drive or stream name on Windows)")
    if prefix.startswith("/") or prefix.startswith("~"):
        raise UnsafePrefix(f"filename_prefix {shown!r} is an absolute path; give a relative path inside the output folder")
    parts = [p for p in prefix.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise UnsafePrefix(f"filename_prefix {shown!r} climbs out with '..'; give a relative path inside the output folder")
    if not parts or prefix.endswith("/") or prefix.rstrip("/").endswith("/.") or prefix.strip() in (".", ""):
        raise UnsafePrefix(f"filename_prefix {shown!r} has no file name; end it with a name, e.g. 'lingbot/video'")
    if any(p.strip() != p or p.endswith(".") for p in parts):
        raise UnsafePrefix(f"filename_prefix {shown!r}: a folder or file name starts or ends with a space or "
                           "ends with '.' (not portable)")
    return parts[:-1], parts[-1]


def is_inside(root: Path, target: Path) -> bool:
    """Whether ``target`` resolves (symlinks followed, even for parts not created yet) into ``root``."""
    try:
        real_root = os.path.realpath(root)
        real = os.path.realpath(target)
        return os.path.commonpath([real_root, real]) == real_root
    except ValueError:
        return False


def check_prefix(prefix: str, output_dir: str | os.PathLike[str], *, width: int = 0, height: int = 0) -> tuple[Path, str, str]:
    """Validate without writing: (absolute folder, stem, "/"-joined sub-folder) or UnsafePrefix."""
    expanded = expand_prefix(prefix, width=width, height=height)
    folders, stem = split_prefix(expanded)
    root = Path(output_dir)
    folder = root.joinpath(*folders)
    if not is_inside(root, folder):
        raise UnsafePrefix(f"filename_prefix {prefix[:80]!r} resolves outside the output folder (a link inside it "
                           "points elsewhere); give a path inside the output folder")
    return folder, stem, "/".join(folders)


def next_counter(folder: Path, stem: str) -> int:
    """One past the highest ``<stem>_<digits>_*`` counter in ``folder`` (ComfyUI's numbering)."""
    highest = 0
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return 1
    key = os.path.normcase(stem + "_")
    for name in names:
        if os.path.normcase(name[: len(key)]) != key:
            continue
        digits = name[len(key):].split(".")[0].split("_")[0]
        if digits.isdigit():
            highest = max(highest, int(digits))
    return highest + 1


def save_target(prefix: str, output_dir: str | os.PathLike[str], *, width: int = 0, height: int = 0) -> SaveTarget:
    """Check the prefix, create its folder inside the output folder, and pick the next counter."""
    folder, stem, subfolder = check_prefix(prefix, output_dir, width=width, height=height)
    folder.mkdir(parents=True, exist_ok=True)
    if not is_inside(Path(output_dir), folder):  # re-check after creating (a link may have appeared)
        raise UnsafePrefix(f"filename_prefix {prefix[:80]!r} resolves outside the output folder")
    return SaveTarget(folder, stem, next_counter(folder, stem), subfolder)


__all__ = ["SaveTarget", "UnsafePrefix", "check_prefix", "expand_prefix", "is_inside", "next_counter",
           "save_target", "split_prefix"]


def check_output_folder(folder: Path, flag: str = "--output") -> None:
    """Fail now, not after the generation, when `folder` cannot hold the outputs.

    The folder (or its nearest existing parent) must be a folder this process can write in: a probe
    file is written there and removed (permission bits do not say it: root passes `os.access` on a
    read-only mount or a system folder such as /sys, and fails at the first file). Nothing is left.
    """
    import tempfile

    folder = Path(folder)
    probe = folder
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise NotADirectoryError(f"{flag} {folder}: {probe} exists and is not a folder")
    try:
        handle, name = tempfile.mkstemp(prefix=".lingbot-probe-", dir=probe)
    except OSError as err:
        raise PermissionError(f"{flag} {folder}: cannot write in {probe} ({err.strerror or type(err).__name__}); "
                              "give a folder you can write in") from None
    os.close(handle)
    os.unlink(name)
