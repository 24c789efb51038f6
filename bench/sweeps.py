"""The long sweeps the test suite samples, run in full: every offload mode through every permutation of
the stages (each order twice), and every shipped workflow in every mode over four shuffled rounds.

The suite keeps one order that puts every stage after every stage (tests/test_offload.py) and two shuffled
rounds per workflow and mode (tests/test_node_graph.py), so it stays within its time budget on two cores;
this script sets LINGBOT_FULL_SWEEPS=1 and runs the same tests, so the sweep is the tests' own code.

    python bench/sweeps.py            # about 10 minutes on an idle 2-core machine
    python bench/sweeps.py -x -q      # extra pytest arguments are passed on
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = ["tests/test_offload.py::test_every_permutation_twice_equals_natural_order",
          "tests/test_node_graph.py::test_shuffled_runs_in_every_mode_give_identical_outputs"]


def main(argv: list[str] | None = None) -> int:
    env = {**os.environ, "LINGBOT_FULL_SWEEPS": "1"}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *SWEEPS, *(argv or [])]
    return subprocess.call(command, cwd=ROOT, env=env)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
