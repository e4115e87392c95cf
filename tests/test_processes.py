"""No process outlives its run (rlcore/reaper.py): here the reaper itself, on a SIGKILLed driver of
plain processes, marked and not. The process table of real `rlx train` runs (tests/procs.py) is checked
where those runs happen anyway, each with checkpoints (megatron's checkpoint writer used to leave a
multiprocessing Manager and its resource tracker behind each Megatron rank): one that failed (its
reward function raises: tests/test_e2e.py), one whose driver alone was SIGKILLed mid-run
(tests/test_checkpoint.py), one that finished and one stopped by SIGTERM (tests/test_preemption.py).
Our processes are the driver's descendants recorded while it ran, and whatever carries its run marker;
other runs on the machine are never counted."""
from __future__ import annotations

import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


DRIVER = """
import os, signal, subprocess, sys, time
from rlcore import reaper
env = {**os.environ, reaper.MARKER_ENV: reaper.this_process_marker()}
# Marked: one that ignores SIGTERM in a session of its own (only the SIGKILL after the grace ends it),
# and a plain one; not marked but a child: found as the driver's descendant.
subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "time.sleep(600)"], env=env, start_new_session=True)
subprocess.Popen(["sleep", "600"], env=env)
child = subprocess.Popen(["sleep", "600"])
print(reaper.this_process_marker(), child.pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_reaper_ends_the_processes_of_a_sigkilled_driver_and_no_other():
    from rlcore.reaper import GRACE_S, POLL_S, marked

    bystander = subprocess.Popen(["sleep", "600"])  # not the driver's: must survive
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=REPO, stdout=subprocess.PIPE, text=True)
    marker, child = driver.stdout.readline().split()
    try:
        deadline = time.monotonic() + 30
        while len(marked(marker)) < 2:
            assert time.monotonic() < deadline, marked(marker)
            time.sleep(0.1)
        time.sleep(2 * POLL_S)  # the reaper has noted the driver's unmarked child
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + GRACE_S + 10
        while (marked(marker) or _running(int(child))) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marked(marker) == [] and not _running(int(child))
        assert _running(bystander.pid)
    finally:
        bystander.kill()
        bystander.wait()
