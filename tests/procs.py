"""The process table for the e2e tests: every process a run started, found while it runs (the run's
descendants, and whatever carries its reaper marker), and which of them are still alive afterwards.
Only this run's processes are looked at: other runs share the machine."""
from __future__ import annotations

import os
import threading
import time

from rlcore.reaper import MARKER_ENV, marked


def _stat(pid: str) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _marker(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(MARKER_ENV.encode() + b"="):
                    return item.split(b"=", 1)[1].decode()
    except OSError:
        pass
    return None


class ProcessWatch:
    """Polls /proc while the run ``root_pid`` lives: every descendant is recorded (pid, start time,
    command line) and the marker its Ray processes carry. ``left()``: those still alive."""

    def __init__(self, root_pid: int, interval_s: float = 0.2):
        self.root = root_pid
        self.seen: dict[int, tuple[int, str]] = {}
        self.markers: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(interval_s,), daemon=True)
        self._thread.start()

    def _poll(self, interval_s: float) -> None:
        while not self._stop.is_set():
            table = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(p)) is not None}
            children: dict[int, list[int]] = {}
            for pid, (ppid, _) in table.items():
                children.setdefault(ppid, []).append(pid)
            todo = list(children.get(self.root, []))
            while todo:
                pid = todo.pop()
                todo += children.get(pid, [])
                if pid not in self.seen:
                    self.seen[pid] = (table[pid][1], _cmdline(pid))
                    if (m := _marker(pid)) is not None:
                        self.markers.add(m)
            time.sleep(interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def left(self) -> list[tuple[int, str]]:
        """(pid, command line) of every recorded descendant still alive (same pid, same start time),
        and of every process that carries one of the run's markers."""
        alive = {pid: cmd for pid, (start, cmd) in self.seen.items() if (s := _stat(str(pid))) and s[1] == start}
        for m in self.markers:
            alive.update({pid: _cmdline(pid) for pid in marked(m)})
        # A zombie is already dead: only its parent's wait() is missing.
        return sorted((pid, cmd) for pid, cmd in alive.items() if not _zombie(pid))

    def wait_until_none_left(self, timeout_s: float) -> list[tuple[int, str]]:
        deadline = time.monotonic() + timeout_s
        while (left := self.left()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


GRACE_S = 30  # Ray's agents notice a dead raylet within seconds; the reaper's own grace is 5 s


def assert_none_left(watch: ProcessWatch, output: str) -> None:
    """After the run ended: the watch stops; the run's Ray processes carried its marker and the watch
    saw its raylet; within GRACE_S none of its processes is still alive. ``output``: the run's, for
    the failure message."""
    watch.stop()
    assert watch.markers, "the run's Ray processes carry no marker:\n" + output[-3000:]
    assert any("raylet" in cmd for _, cmd in watch.seen.values()), "the watch never saw the run's Ray"
    left = watch.wait_until_none_left(GRACE_S)
    assert left == [], f"{len(left)} process(es) of the run still alive {GRACE_S} s after it ended: {left}"
