"""Preemption: SIGTERM / SIGUSR1 finishes the step in flight, saves a checkpoint (whatever
trainer.save_every is), and `rlx train` exits with status 75 (launch/rlx.sbatch requeues on it); the
rerun resumes with resume=auto and its per-step metrics equal an uninterrupted run's. The handler and
the loop's stopping first without Ray, then `rlx train` for real."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from rlcore.preemption import REQUEUE_EXIT_STATUS, Preempted, StopOnSignal
from tests.procs import ProcessWatch
from tests.runs import REPO, SMALL_STEPS as STEPS, small_quickstart_cmd, step_metrics


# ------------------------------------------------------------------------------- the handler (no Ray)
def test_the_first_signal_requests_a_stop_and_repeats_are_ignored():
    said, saved = [], []
    before = signal.getsignal(signal.SIGUSR1)
    stop = StopOnSignal(say=said.append).install()
    try:
        stop.check(3, 10, saved.append)  # no signal yet: nothing happens
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second one, as while the checkpoint is saved
        assert stop.signum == signal.SIGUSR1
        assert "SIGUSR1 received: finishing the step in flight" in said[0]
        assert "SIGTERM received again while stopping: ignored" in said[1]
        with pytest.raises(Preempted, match="stopped by SIGUSR1 after step 3 of 10 with checkpoint /ck/3; exiting "
                                            "with status 75") as e:
            stop.check(3, 10, lambda step: saved.append(step) or f"/ck/{step}")
        assert saved == [3] and e.value.step == 3 and e.value.checkpoint == "/ck/3"
    finally:
        stop.restore()
    # After a stop, ours stay (the shutdown must not be cut short either); still ignoring repeats.
    os.kill(os.getpid(), signal.SIGUSR1)
    assert "SIGUSR1 received again" in said[-1]
    for s in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(s, before if s == signal.SIGUSR1 else signal.SIG_DFL)


def test_no_signal_restores_the_handlers_and_step_0_is_not_saved():
    before = signal.getsignal(signal.SIGTERM)
    with StopOnSignal(say=lambda m: None):
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
    stop = StopOnSignal(say=lambda m: None)
    stop.signum = signal.SIGTERM  # as if received before the first step of a fresh start
    with pytest.raises(Preempted, match="after step 0 of 5 with no checkpoint") as e:
        stop.check(0, 5, lambda step: pytest.fail("nothing to save at step 0"))
    assert e.value.checkpoint is None and REQUEUE_EXIT_STATUS == 75


# --------------------------------------------------------------------------------- rlx train (e2e)
@pytest.mark.e2e
def test_sigterm_saves_exits_75_and_the_rerun_equals_an_uninterrupted_run(tiny_assets, reference_run, tmp_path):
    """The small quickstart (tests/runs.py) with no periodic checkpoints, SIGTERMed twice after step 1:
    the one checkpoint is the one the signal asks for; the rerun equals the uninterrupted run
    (tests/conftest.py reference_run). Neither the stopped run nor the finished one leaves a process."""
    model, data = tiny_assets
    assert reference_run.saw_raylet, "the watch never saw the reference run's Ray"
    assert reference_run.left == []  # a run that finished leaves no process

    run_dir = tmp_path / "run"
    log = tmp_path / "stopped.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(small_quickstart_cmd(model, data, run_dir), cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT)
    watch = ProcessWatch(proc.pid)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):  # step 1 logged
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, "step 1 did not finish within 10 minutes"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)  # again, while it finishes the step or saves
    assert proc.wait(timeout=600) == REQUEUE_EXIT_STATUS, log.read_text()[-4000:]
    text = log.read_text()
    done = max(step_metrics(run_dir))
    assert 1 <= done < STEPS, text[-3000:]
    assert f"stopped by SIGTERM after step {done} of {STEPS} with checkpoint" in text
    assert "received again while stopping: ignored" in text
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{done:08d}"
    # trainer.save_every=0: nothing was saved before the signal (a finished run saves nothing at all:
    # tests/test_console.py).
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_")) == \
        [f"step_{done:08d}"]
    watch.stop()
    assert watch.wait_until_none_left(30) == []  # the stopped run leaves no process

    resumed = subprocess.run(small_quickstart_cmd(model, data, run_dir), cwd=REPO, capture_output=True, text=True,
                             timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    assert f"checkpoint: resumed from {run_dir / 'checkpoints' / f'step_{done:08d}'}" in resumed.stdout
    got, want = step_metrics(run_dir), step_metrics(reference_run.run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == want[step], (step, got[step], want[step])
