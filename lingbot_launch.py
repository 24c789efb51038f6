"""`lingbot-run`'s entry point: Ctrl-C is clean from the first instant.

Importing the runner takes seconds (torch, diffusers, transformers). The console script starts
here, a module with no heavy imports, so an interrupt during those imports ends the same way as one
during the run: one line, exit code 130, no traceback.
"""

from __future__ import annotations

import sys

from lingbot_core.exit_codes import INTERRUPTED  # a light module (lingbot_core imports nothing heavy)


def main() -> int:
    try:
        from lingbot_nodes.cli import main as run

        return run()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
