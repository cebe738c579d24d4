"""The progress bar of long commands (PS training, and the lab's benchmarks).
Whether it is drawn is tensorwire.config.progress_bar's to say."""

from __future__ import annotations

import sys
import time

from .config import progress_bar


class Progress:
    """A progress bar on stderr (the benchmarks', `tensorwire train`'s): one line
    redrawn in place on a terminal, whole lines elsewhere (a rank's stderr reaches
    the terminal through `tensorwire run`, whose relay passes complete lines only). Drawn when the command's
    --progress/--no-progress says so, or (not given) TENSORWIRE_PROGRESS_BAR, or
    (not set) when stderr is a terminal: tensorwire.config.progress_bar."""

    def __init__(self, total: int, label: str, enabled: bool | None = None) -> None:
        self.total, self.label, self.done = total, label, 0
        self.enabled = progress_bar(enabled)
        self.start = time.monotonic()
        self._drawn = ""  # the unfinished bar now on the terminal's last line (redrawn in place)

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / max(1, self.total))
        bar = f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
        elapsed = time.monotonic() - self.start
        if sys.stderr.isatty():  # padded: a shorter step must cover the longer one it redraws
            line = f"{bar} {what:<12} {elapsed:6.1f}s"
            done = self.done >= self.total
            self._drawn = "" if done else line
            sys.stderr.write(f"\r{line}" + ("\n" if done else ""))
        else:
            sys.stderr.write(f"{bar} {what} {elapsed:.1f}s\n")
        sys.stderr.flush()

    def clear(self) -> None:
        """Blanks the bar's line on the terminal, so that a line printed next (a table row
        on stdout, the same terminal) starts clean; redraw() puts the bar back."""
        if self._drawn:
            sys.stderr.write("\r" + " " * len(self._drawn) + "\r")
            sys.stderr.flush()

    def redraw(self) -> None:
        if self._drawn:
            sys.stderr.write("\r" + self._drawn)
            sys.stderr.flush()
