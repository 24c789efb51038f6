"""`lingbot-run`'s entry point: Ctrl-C is clean from the first instant.

Importing the runner takes seconds (torch, diffusers, transformers). The console script starts
here, a module with no heavy imports, so an interrupt during those imports ends the same way as one
during the run: one line, exit code 130, no traceback.
"""

from __future__ import annotations

import sys

# a light module (lingbot_core imports nothing heavy)
from lingbot_core.exit_codes import interrupted_code, sigterm_interrupts


def main() -> int:
    with sigterm_interrupts() as terms:  # SIGTERM (a container stop) as Ctrl-C, from the first instant too
        try:
            from lingbot_nodes.cli import main as run

            return run()
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return interrupted_code(terms)


if __name__ == "__main__":
    raise SystemExit(main())
