#!/usr/bin/env bash
# The kernel-choice and placement tests on the oldest torch pyproject.toml allows.
#
# Why: CI runs on the newest torch; ComfyUI users keep older builds (2.7-2.9 are common), and
# several paths depend on the torch version (torch._grouped_mm exists from 2.8, fully_shard's
# ignored_params from 2.7, torch.OutOfMemoryError from 2.5). This builds a separate venv (never the
# one you work in) with that torch and its torchvision, installs this checkout into it and runs the
# tests whose code takes such version-dependent paths.
#
#   bench/oldest_torch.sh                 # venv in ${TMPDIR:-/tmp}/lingbot-oldest-torch (reused when present)
#   OLDEST_TORCH_VENV=DIR bench/oldest_torch.sh
#   bench/oldest_torch.sh -k grouped      # extra arguments go to pytest
#
# The first run downloads torch (a CUDA build from PyPI: a few GB with its nvidia-* packages) and
# takes several minutes; later runs reuse the venv. Keep TORCH in step with the floor in pyproject.toml
# (tests/test_pack.py checks that they agree).
set -euo pipefail
TORCH=2.7.0
TORCHVISION=0.22.0
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${OLDEST_TORCH_VENV:-${TMPDIR:-/tmp}/lingbot-oldest-torch}
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install "torch==$TORCH" "torchvision==$TORCHVISION"
# The pack and its test tools; the constraint keeps pip from replacing the old torch.
constraint=$(mktemp)
trap 'rm -f "$constraint"' EXIT
printf 'torch==%s\ntorchvision==%s\n' "$TORCH" "$TORCHVISION" > "$constraint"
"${pip[@]}" install -c "$constraint" -e "$root[test]"
got=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
if [ "$got" != "$TORCH" ]; then
    echo "expected torch $TORCH in $venv, found $got" >&2
    exit 1
fi

cd "$root"
tests=(tests/test_dit.py tests/test_placement.py tests/test_offload.py tests/test_mode_registry.py
       tests/test_memory.py tests/test_fit.py
       # torch.distributed (its store, FSDP, DTensor) changes from release to release too: the
       # process-group paths (LingBot Parallel's pool, --parallel/--fsdp, --jobs under torchrun)
       tests/test_parallel.py tests/test_parallel_pool.py tests/test_parallel_failures.py tests/test_jobs.py)
for extra in tests/test_kernels.py tests/test_doctor.py; do  # present in this checkout or not
    [ -f "$extra" ] && tests+=("$extra")
done
echo "torch $got (oldest allowed): ${tests[*]}"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" "$@"
