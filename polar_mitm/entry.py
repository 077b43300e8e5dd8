"""The `polar-mitm` command's first moments. Its imports take ~0.6 s (seconds on a loaded
machine); a Ctrl-C there would otherwise end it with a traceback and death by SIGINT, where
every command documents exit status 130. Only the standard library is imported here."""

from __future__ import annotations

import signal
import sys


def polar_mitm() -> None:
    try:
        from .cli import main
    except KeyboardInterrupt:
        # nothing has started yet: nothing to stop
        sys.exit(128 + signal.SIGINT)
    main()
