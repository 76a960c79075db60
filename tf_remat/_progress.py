"""A small progress display shared by long-running tools (silenced by verbose=0)."""

from __future__ import annotations

import sys
import time

__all__ = ["bar"]


class _Bar:
    def __init__(self, total, label, verbose, stream=None):
        self.total, self.label, self.verbose = total, label, verbose
        self.stream = stream or sys.stderr
        self.count = 0
        self.start = time.perf_counter()

    def update(self, message: str = "", n: int = 1):
        self.count += n
        if not self.verbose:
            return
        elapsed = time.perf_counter() - self.start
        of = f"/{self.total}" if self.total else ""
        if self.total:
            width = 20
            filled = int(width * min(1.0, self.count / self.total))
            head = f"[{'=' * filled}{'.' * (width - filled)}]"
        else:
            head = ""
        print(f"{self.label} {self.count}{of} {head} {elapsed:6.1f}s {message}".rstrip(),
              file=self.stream, flush=True)

    def close(self):
        pass


def bar(total, label, verbose=1, stream=None):
    """A progress line printer: ``b = bar(10, 'profiling'); b.update('conv1'); b.close()``."""
    return _Bar(total, label, verbose, stream)
