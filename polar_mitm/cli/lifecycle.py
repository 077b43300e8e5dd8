"""One life for every long-running command (`up`, `demo`, `dashboard`, `rollout`,
`rollout-server`, `node`, `polar-train loop` and `train`): Ctrl-C and SIGTERM raise
Interrupted, which knows its signal; what the command started is stopped once, in one place;
and the command exits with the shell's code for the signal (130, 143), never with a traceback
or click's "Aborted!". Only the standard library: the commands' entry uses it before the rest
loads."""

from __future__ import annotations

import signal
import sys
import time
from contextlib import ContextDecorator
from types import TracebackType
from typing import Callable, NoReturn, Protocol, TypeVar


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM; exit_code is the shell's 128 + the signal's number."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


# The first signal since the handlers were installed: a library may turn Interrupted into an
# exception of its own (DuckDB: RuntimeError('Query interrupted'), re-raised by the store as a
# plain KeyboardInterrupt), and the exit code must still be the signal's.
_first_signal: int | None = None


def interrupted_exit_code(e: KeyboardInterrupt) -> int:
    """130 after SIGINT, 143 after SIGTERM; a plain KeyboardInterrupt: the signal received
    (130 when none was: Python's own Ctrl-C)."""
    return e.exit_code if isinstance(e, Interrupted) else 128 + (_first_signal or signal.SIGINT)


def stop_on_sigterm() -> None:
    """SIGTERM (systemd, docker, kill) stops the children as Ctrl-C does; by default it would
    end this process at once and leave mitmdump listening and holding the database. Both
    raise Interrupted (a KeyboardInterrupt) that knows its signal, for the exit code."""
    global _first_signal
    _first_signal = None

    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # once: the cleanup must not be cut short
        raise _received(signal.SIGTERM)

    def ctrl_c(signum, frame):
        raise _received(signal.SIGINT)
    signal.signal(signal.SIGTERM, interrupt)
    # Ctrl-C too, even when started with SIGINT ignored (a background job of a script):
    # Python then keeps it ignored, and the stack could only be stopped by SIGTERM.
    signal.signal(signal.SIGINT, ctrl_c)


def _received(signum: int) -> Interrupted:
    global _first_signal
    _first_signal = _first_signal or signum
    return Interrupted(signum)


class Stoppable(Protocol):
    def stop(self) -> object: ...


class Services(Protocol):
    """What a long-running command waits on (stack.local.Stack): the services that stopped by
    themselves, and why."""

    def dead(self) -> list: ...

    def why_dead(self) -> str: ...


S = TypeVar("S", bound=Stoppable)


class LongRunning(ContextDecorator):
    """`with LongRunning() as life:` around the whole body of a long-running command (or
    `@LongRunning(after)` on one that hands nothing to stop: it is used once per process).

    From the start, Ctrl-C and SIGTERM raise Interrupted (stop_on_sigterm): an interrupt during
    the checks before anything starts exits 130 or 143 as well. What the body hands to
    `stops` or `on_stop` is stopped on the way out, last first, once, whatever happened. After
    an interrupt the command exits 130 or 143, with the line `interrupted (Ctrl-C): <after>`
    on stderr when `after` (settable as the command goes on) says what the user should know.
    A failure while stopping is one line on stderr (exit 1 when nothing else failed). The
    handlers stay installed after the block: the process is about to end, and a second SIGTERM
    must not cut its exit short."""

    def __init__(self, after: str = "") -> None:
        self.after = after
        self._stops: list[Callable[[], object]] = []

    def stops(self, part: S) -> S:
        """Stop `part` (a Stack, a server) on the way out; returns it."""
        self._stops.append(part.stop)
        return part

    def on_stop(self, stop: Callable[[], object]) -> None:
        self._stops.append(stop)

    def wait(self, services: Services | None = None) -> NoReturn:
        """Serve until interrupted or, when `services` are given, until one of them stops by
        itself: then exit 1, saying which."""
        while services is None or not services.dead():
            time.sleep(1)
        _say(f"a service stopped: {services.why_dead()}")
        raise SystemExit(1)

    def __enter__(self) -> LongRunning:
        stop_on_sigterm()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        global _first_signal
        try:
            code = self._stop(error)
        finally:
            _first_signal = None    # this command's: an in-process caller (a test) goes on
        if code is not None:
            raise SystemExit(code) from None

    def _stop(self, error: BaseException | None) -> int | None:
        """Stops everything; the exit code, where it is not the body's own."""
        code = self._interrupted(error)
        failed = self._stop_all()
        if error is None and isinstance(failed, KeyboardInterrupt):
            code = interrupted_exit_code(failed)        # Ctrl-C while stopping: a stop still
        interrupted = code is not None
        if failed is not None and not isinstance(failed, KeyboardInterrupt):
            _say(f"while stopping: {type(failed).__name__}: {failed}")
            if not interrupted and (error is None or (isinstance(error, SystemExit) and not error.code)):
                code = 1
        if interrupted and self.after:
            _say(f"interrupted ({'SIGTERM' if code == 128 + signal.SIGTERM else 'Ctrl-C'}): {self.after}")
        return code

    @staticmethod
    def _interrupted(error: BaseException | None) -> int | None:
        """The exit code when `error` ended the command because of a signal: a KeyboardInterrupt,
        or any other error once a signal came (what a library made of the interrupt: it is not
        shown); None otherwise (a deliberate SystemExit included)."""
        if isinstance(error, KeyboardInterrupt):
            return interrupted_exit_code(error)
        if error is not None and not isinstance(error, SystemExit) and _first_signal is not None:
            return 128 + _first_signal
        return None

    def _stop_all(self) -> BaseException | None:
        """Every stop, last first, each once even when another fails; the first failure."""
        first = None
        while self._stops:
            try:
                self._stops.pop()()
            except BaseException as e:
                first = e if first is None else first
        return first


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
