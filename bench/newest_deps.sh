#!/usr/bin/env bash
# The whole suite on the newest Python and the newest release of every dependency pyproject.toml allows.
#
# Why: CI runs what uv.lock pins; a plain `pip install -e ".[test]"` (and ComfyUI's own environment,
# whose portable build ships a newer Python) takes the newest releases instead, and those change under
# us: PyAV 19 made a process forked after a frame conversion hang (fixed in video_input), and torch,
# transformers and diffusers move as fast. This builds a separate venv (never the one you work in) on
# $PYTHON (default python3.13), installs this checkout with the newest of everything, prints what it got
# and runs the suite.
#
#   bench/newest_deps.sh                  # venv in ${TMPDIR:-/tmp}/lingbot-newest-deps (reused, upgraded)
#   NEWEST_DEPS_VENV=DIR PYTHON=python3.12 bench/newest_deps.sh
#   bench/newest_deps.sh -x -k video      # extra arguments go to pytest
#
# The first run downloads torch (a CUDA build from PyPI: a few GB with its nvidia-* packages) and
# takes several minutes; the suite then takes as long as CI's.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${NEWEST_DEPS_VENV:-${TMPDIR:-/tmp}/lingbot-newest-deps}
python=${PYTHON:-python3.13}

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install --upgrade pip
"${pip[@]}" install --upgrade --upgrade-strategy eager -e "$root[test]"
"$venv/bin/python" - <<'PY'
import sys
from importlib.metadata import version

names = ("torch", "diffusers", "transformers", "accelerate", "safetensors", "gguf", "av", "numpy")
print(f"Python {sys.version.split()[0]}: " + ", ".join(f"{n} {version(n)}" for n in names))
PY
cd "$root"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider tests "$@"
