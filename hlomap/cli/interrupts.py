"""Ctrl-C, cooperatively: the SIGINT handler only sets a flag, and the command looks at it where
stopping is safe (between its phases, and at every progress report of a search, which then ends
keeping its best plan).

Raising KeyboardInterrupt from the handler itself, as Python does by default, throws it wherever
the main thread happens to be: inside JAX's garbage-collector callback (where Python drops it),
half-way through importing an extension module, or in a callback from XLA's C++ code, which can
leave the process to crash at exit. A second Ctrl-C means "stop now": the process exits at once
with status 130 (the search has saved its best plan so far as it went)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Callable, TypeVar

EXIT_INTERRUPTED = 130
STDERR = 2  # written with os.write: a signal handler must not go through buffered sys.stderr

T = TypeVar("T")


class InterruptWatch:
    """The flag a SIGINT handler sets, and the checks that turn it into a KeyboardInterrupt at a
    safe point. An imperative shell around one `threading.Event`."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.previous: Any = None  # the handler `install` replaced, which `uninstall` puts back

    def handler(self, signum: int, frame: Any) -> None:
        if self.event.is_set():  # a second Ctrl-C: the user does not want to wait
            os.write(STDERR, b"hlomap: interrupted\n")
            os._exit(EXIT_INTERRUPTED)
        os.write(STDERR, b"hlomap: stopping at the next safe point (Ctrl-C again to stop at once)\n")
        self.event.set()

    def install(self) -> None:
        """Handle SIGINT in the main thread, unless it is ignored (a background job keeps it so)."""
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN):
            self.previous = signal.signal(signal.SIGINT, self.handler)

    def uninstall(self) -> None:
        """Put back the handler `install` replaced (a caller running several commands in one
        process, a test suite say, gets its own Ctrl-C back)."""
        if self.previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None

    @property
    def interrupted(self) -> bool:
        return self.event.is_set()

    def check(self) -> None:
        """Raise KeyboardInterrupt here, in ordinary Python code, once Ctrl-C was pressed."""
        if self.event.is_set():
            raise KeyboardInterrupt

    def wrap(self, callback: Callable[[T], None] | None) -> Callable[[T], None]:
        """A progress callback that stops the search (keeping its best plan) once Ctrl-C was
        pressed, whether or not a bar is drawn."""

        def on_progress(progress: T) -> None:
            self.check()
            if callback is not None:
                callback(progress)

        return on_progress


def interrupts_of(args: Any) -> InterruptWatch:
    """The watch `hlomap.cli.run` hung on `args` (a fresh, uninstalled one for arguments built by
    hand)."""
    found = getattr(args, "interrupts", None)
    return found if found is not None else InterruptWatch()
