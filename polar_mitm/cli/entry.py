"""The `polar-mitm` and `polar-train` commands' first moments. Its imports take ~0.6 s (seconds on a loaded
machine); a Ctrl-C there would otherwise end it with a traceback and death by SIGINT, where
every command documents exit status 130. Only the standard library loads before the CLI."""

from __future__ import annotations

import sys

from .lifecycle import interrupted_exit_code


def polar_mitm() -> None:
    try:
        from .main import main
    except KeyboardInterrupt as e:
        # nothing has started yet: nothing to stop
        sys.exit(interrupted_exit_code(e))
    main()


def polar_train() -> None:
    try:
        from .train import main     # torch and transformers: seconds
    except KeyboardInterrupt as e:
        sys.exit(interrupted_exit_code(e))
    main()
