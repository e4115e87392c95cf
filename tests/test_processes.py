"""No process outlives its run: the process table before and after `rlx train` that failed (its reward
function raises at step 2) and was SIGKILLed mid-run, with checkpoints (a run that finishes, and one
stopped by SIGTERM, are checked in tests/test_preemption.py) (megatron's
checkpoint writer used to leave a multiprocessing Manager and its resource tracker behind each
Megatron rank). Our processes are the driver's descendants recorded while it ran, and whatever carries
its run marker (rlcore/reaper.py); other runs on the machine are never counted."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.procs import ProcessWatch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = "yaml_configs/quickstart_cpu.yaml"
GRACE_S = 30  # Ray's agents notice a dead raylet within seconds; the reaper's own grace is 5 s


def _cmd(model, data, run_dir, *extra):
    return [sys.executable, "-m", "launch.cli", "train", SPEC, f"model.path={model}", f"data.train_files=[{data}]",
            "data.val_files=[]", "data.batch_size=8", "rollout.n=8", f"trainer.run_dir={run_dir}",
            "trainer.val_every=0", "trainer.logger=[console,jsonl]", "trainer.save_every=1", *extra]


def _start(cmd, log):
    out = open(log, "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    out.close()
    return proc, ProcessWatch(proc.pid)


def _assert_none_left(watch: ProcessWatch, log) -> None:
    watch.stop()
    assert watch.markers, "the run's Ray processes carry no marker:\n" + open(log).read()[-3000:]
    assert any("raylet" in cmd for _, cmd in watch.seen.values()), "the watch never saw the run's Ray"
    left = watch.wait_until_none_left(GRACE_S)
    assert left == [], f"{len(left)} process(es) of the run still alive {GRACE_S} s after it ended: {left}"


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


@pytest.mark.e2e
def test_a_failed_run_leaves_no_process(tiny_assets, tmp_path):
    reward = tmp_path / "reward_fails.py"
    reward.write_text("calls = 0\n\n\ndef score(data_source, solution_str, ground_truth, extra_info):\n"
                      "    global calls\n    calls += 1\n"
                      "    if calls > 64:  # the second step's first response\n"
                      "        raise ValueError('the verifier broke')\n    return 0.0\n")
    proc, watch = _start(_cmd(*tiny_assets, tmp_path / "run", "trainer.total_steps=3",
                              f"reward.function={reward}:score"), tmp_path / "log")
    assert proc.wait(timeout=900) == 1, open(tmp_path / "log").read()[-3000:]
    assert "the verifier broke" in open(tmp_path / "log").read()
    assert (tmp_path / "run" / "checkpoints" / "step_00000001").is_dir()
    _assert_none_left(watch, tmp_path / "log")
    # The checkpoint writer started no long-lived multiprocessing helper (Manager, resource tracker).
    helpers = [cmd for _, cmd in watch.seen.values() if "multiprocessing" in cmd]
    assert helpers == [], helpers


@pytest.mark.e2e
def test_a_sigkilled_run_leaves_no_process(tiny_assets, tmp_path):
    """SIGKILL of the driver alone right after the first checkpoint (so Megatron's checkpoint writer
    ran in every rank): no exit handler of the driver runs, Ray's processes lose their parent, the
    reaper ends what is left."""
    latest = tmp_path / "run" / "checkpoints" / "latest"
    proc, watch = _start(_cmd(*tiny_assets, tmp_path / "run", "trainer.total_steps=50"), tmp_path / "log")
    deadline = time.monotonic() + 600
    while not latest.exists():
        assert proc.poll() is None, open(tmp_path / "log").read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.1)
    time.sleep(1)  # into the next step
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    _assert_none_left(watch, tmp_path / "log")
