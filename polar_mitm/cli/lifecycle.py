"""Ctrl-C and SIGTERM for the long-running commands: both raise Interrupted, which knows its
signal, and the command exits with the shell's code for it. Only the standard library, so the
command's entry can use it before the rest loads."""

from __future__ import annotations

import signal


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM; exit_code is the shell's 128 + the signal's number."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def interrupted_exit_code(e: KeyboardInterrupt) -> int:
    """130 after SIGINT (a plain KeyboardInterrupt too), 143 after SIGTERM."""
    return e.exit_code if isinstance(e, Interrupted) else 128 + signal.SIGINT


def stop_on_sigterm() -> None:
    """SIGTERM (systemd, docker, kill) stops the children as Ctrl-C does; by default it would
    end this process at once and leave mitmdump listening and holding the database. Both
    raise Interrupted (a KeyboardInterrupt) that knows its signal, for the exit code."""
    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # once: the cleanup must not be cut short
        raise Interrupted(signal.SIGTERM)

    def ctrl_c(signum, frame):
        raise Interrupted(signal.SIGINT)
    signal.signal(signal.SIGTERM, interrupt)
    # Ctrl-C too, even when started with SIGINT ignored (a background job of a script):
    # Python then keeps it ignored, and the stack could only be stopped by SIGTERM.
    signal.signal(signal.SIGINT, ctrl_c)
