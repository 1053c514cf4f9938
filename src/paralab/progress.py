"""A small progress bar on stderr (redrawn in place on a terminal, a line per 10% otherwise)."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str, enabled: bool = True, start: int = 0, stream=None):
        self.total, self.label, self.enabled = max(total, 1), label, enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self.start = start
        self.done = start
        self.last_decile = -1
        self.drawn = False

    def update(self, done: int, note: str = "") -> None:
        self.done = done
        if not self.enabled:
            return
        frac = done / self.total
        elapsed = time.perf_counter() - self.t0
        rate = (done - self.start) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else float("nan")
        bar = "#" * int(frac * 24)
        text = (f"{self.label} [{bar:<24}] {done}/{self.total} {100 * frac:5.1f}% "
                f"{rate:6.2f} it/s eta {eta:5.0f}s {note}")
        if self.tty:
            self.stream.write("\r" + text[:120])
            self.drawn = True
        elif int(frac * 10) != self.last_decile or done == self.total:
            self.last_decile = int(frac * 10)
            self.stream.write(text + "\n")
        self.stream.flush()

    def clear(self) -> str:
        """Erase the bar so a log line can be printed; returns '' for convenience in f-strings."""
        if self.enabled and self.tty and self.drawn:
            self.stream.write("\r" + " " * 120 + "\r")
            self.stream.flush()
            self.drawn = False
        return ""

    def close(self) -> None:
        if self.enabled and self.tty and self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False
