"""No process outlives its run: a watchdog that ends a local Ray cluster's processes when its driver dies.

Ray's own cleanup (``ray.shutdown``, the exit handlers) never runs in a driver that was SIGKILLed, and
Ray's fate sharing covers the head's own processes only: the raylet's agents lingered, and any
process a worker started (a multiprocessing helper) is nobody's child once the worker is gone.

``start_ray`` therefore marks what the local cluster starts: the variable ``RLX_RUN_MARKER`` is in the
environment of Ray's head processes and so of every worker and every process a worker starts. Then
``watch(marker)`` starts this file as a process of its own session, holding the read end of a pipe whose
write end only the driver holds. While the driver lives, the reaper notes the driver's descendants
every ``POLL_S`` (a process that renames itself may hide its environment; once the raylet is gone its
children are nobody's descendants). Whatever way the driver ends, the kernel closes the pipe; the
reaper reads EOF, sends SIGTERM to every marked or noted process still alive, SIGKILL to those left
after ``GRACE_S``, and exits. It imports nothing but the standard library.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

MARKER_ENV = "RLX_RUN_MARKER"
GRACE_S = 5.0
POLL_S = 1.0


def marked(marker: str) -> list[int]:
    """Pids of the processes whose environment holds ``RLX_RUN_MARKER=marker`` (this one excluded)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:  # gone, or another user's
            continue
    return found


def _table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks) of every process."""
    table = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            table[int(pid)] = (int(fields[1]), int(fields[19]))
        except (OSError, IndexError, ValueError):
            continue
    return table


def descendants(root: int, table: dict[int, tuple[int, int]]) -> set[tuple[int, int]]:
    """(pid, start time) of every descendant of ``root`` in ``table``."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.add((pid, table[pid][1]))
        todo += children.get(pid, [])
    return found


def _alive(marker: str, noted: set[tuple[int, int]]) -> list[int]:
    table = _table()
    pids = set(marked(marker)) | {pid for pid, start in noted if table.get(pid, (0, None))[1] == start}
    pids.discard(os.getpid())
    return sorted(pids)


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def reap(marker: str, noted: set[tuple[int, int]] = frozenset(), grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM to every process marked ``marker`` or in ``noted`` (pid, start time) and still alive,
    SIGKILL to those still there after ``grace_s``; returns the pids that needed SIGKILL."""
    _signal_all(_alive(marker, noted), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _alive(marker, noted) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _alive(marker, noted)
    _signal_all(left, signal.SIGKILL)
    return left


def watch(marker: str) -> int:
    """Starts the reaper of ``marker`` for this (the driver) process; returns its pid. The pipe's write
    end stays open in this process only (not inheritable, so no child keeps it open)."""
    read_end, write_end = os.pipe()
    env = {k: v for k, v in os.environ.items() if k != MARKER_ENV}
    # -I: the standard library only, not this folder's modules shadowing it.
    proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), marker, str(os.getpid())],
                            stdin=read_end, env=env,
                            start_new_session=True, close_fds=True)
    os.close(read_end)
    _WRITE_ENDS.append(write_end)  # open until this process ends
    return proc.pid


_WRITE_ENDS: list[int] = []
_MARKER: list[str] = []


def this_process_marker() -> str:
    """This process's marker, its reaper started on first use (one per driver process, however many
    local clusters it starts one after the other)."""
    if not _MARKER:
        import uuid

        _MARKER.append(uuid.uuid4().hex)
        watch(_MARKER[0])
    return _MARKER[0]


def main(marker: str, driver: int) -> int:
    for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):  # outlive the driver's terminal and group
        signal.signal(s, signal.SIG_IGN)
    noted: set[tuple[int, int]] = set()
    while True:  # nothing is ever written: reading gives b"" once the driver has exited
        if select.select([0], [], [], POLL_S)[0]:
            if not os.read(0, 4096):
                break
        else:  # the living ones only: a long-lived driver starts many short-lived processes
            table = _table()
            noted = {(pid, start) for pid, start in noted if table.get(pid, (0, None))[1] == start}
            noted |= descendants(driver, table)
    reap(marker, noted)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
