"""The `polar-mitm` command's first moments. Its imports take ~0.6 s (seconds on a loaded
machine); a Ctrl-C there would otherwise end it with a traceback and death by SIGINT, where
every command documents exit status 130. Only the standard library loads before the CLI."""

from __future__ import annotations

import sys

from .interrupts import interrupted_exit_code


def polar_mitm() -> None:
    try:
        from .cli import main
    except KeyboardInterrupt as e:
        # nothing has started yet: nothing to stop
        sys.exit(interrupted_exit_code(e))
    main()
