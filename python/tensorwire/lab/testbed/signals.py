"""Signals while a testbed is built: SIGTERM and SIGHUP interrupt ``up`` as Ctrl-C does, and
its cleanup is not interrupted."""

from __future__ import annotations

import signal
import threading
from typing import Any


class _Interrupted(KeyboardInterrupt):
    """SIGTERM/SIGHUP during `up`: handled like Ctrl-C, so the partial testbed is removed."""


class signals_as_interrupt:
    """Within the block, SIGTERM and SIGHUP raise _Interrupted (main thread only; elsewhere the
    caller's handlers stay)."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __enter__(self) -> None:
        self.saved: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            raise _Interrupted(f"signal {signal.Signals(signum).name}")

        for s in self.SIGNALS:
            self.saved[s] = signal.signal(s, handler)

    def __exit__(self, *exc: Any) -> None:
        for s, h in self.saved.items():
            signal.signal(s, h)


class signals_ignored:
    """Cleanup must finish: a second Ctrl-C or SIGTERM while it runs is ignored (main thread)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __enter__(self) -> None:
        self.saved: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self.saved[s] = signal.signal(s, signal.SIG_IGN)

    def __exit__(self, *exc: Any) -> None:
        for s, h in self.saved.items():
            signal.signal(s, h)
