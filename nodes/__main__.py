"""`python -m lingbot_nodes`: the same command as `lingbot-run`, Ctrl-C clean from the first instant
(the package import before this file is light; torch comes in with `.cli`, inside the `try`)."""

import sys

from lingbot_core.exit_codes import INTERRUPTED

try:
    from .cli import main

    code = main()
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    code = INTERRUPTED
raise SystemExit(code)
