"""`python -m lingbot_nodes`: the same command as `lingbot-run`, Ctrl-C (and SIGTERM) clean from the
first instant (the package import before this file is light; torch comes in with `.cli`, inside the `try`)."""

import sys

from lingbot_core.exit_codes import interrupted_code, sigterm_interrupts

with sigterm_interrupts() as terms:
    try:
        from .cli import main

        code = main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = interrupted_code(terms)
raise SystemExit(code)
