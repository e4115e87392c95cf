"""Peak resident memory of a sync, on either side."""
from __future__ import annotations

import os
import threading


class PeakRss:
    """Measures this process's peak resident memory above its level at entry (``extra_bytes``), by
    sampling /proc/self/statm from a thread every ``interval_s``: what a sync really holds on top of
    the model, whatever allocated it (buffers, gathered tensors, vLLM's reload temporaries)."""

    def __init__(self, interval_s: float = 0.002):
        self._interval, self._page = interval_s, os.sysconf("SC_PAGE_SIZE")
        self._stop, self._thread = threading.Event(), threading.Thread(target=self._run, daemon=True)
        self.extra_bytes = 0

    def _rss(self) -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page
        except OSError:  # not Linux: no measurement
            return 0

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.extra_bytes = max(self.extra_bytes, self._rss() - self._base)

    def __enter__(self) -> "PeakRss":
        self._base = self._rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.extra_bytes = max(self.extra_bytes, self._rss() - self._base)
