"""Peak memory of a process tree, counted once: the largest sum over the tree of each process's
proportional set size (PSS: a page shared by k processes counts 1/k in each), sampled while it runs.

A sum of peak RSS (``ru_maxrss``) over several processes counts every shared page once per process:
torch's and the other libraries' code, Ray's object store, the weight sync's shared-memory slots.
PSS counts them once in total, so summed PSS compares fairly with one process's memory. Linux only
(``/proc/PID/smaps_rollup``); the peak is that of the samples (every ``interval_s``).
"""
from __future__ import annotations

import os
import threading


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(name))
    return out


def tree_pss_mb(root: int) -> float:
    """The summed PSS (MiB) of ``root`` and all its descendants now."""
    children, stack, total = _children(), [root], 0
    while stack:
        pid = stack.pop()
        stack += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return total / 1024


class PeakTreePss:
    """``with PeakTreePss(pid) as peak: ...`` then ``peak.mb``: the largest summed PSS of the tree
    under ``pid`` (default this process) seen while the block ran."""

    def __init__(self, root: int | None = None, interval_s: float = 0.5):
        self.root, self.interval_s, self.mb = root or os.getpid(), interval_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.mb = max(self.mb, tree_pss_mb(self.root))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "PeakTreePss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.mb = max(self.mb, tree_pss_mb(self.root))
