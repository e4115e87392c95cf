"""Preemption: SIGTERM / SIGUSR1 finishes the step in flight, saves a checkpoint (whatever
trainer.save_every is), and `rlx train` exits with status 75 (launch/rlx.sbatch requeues on it); the
rerun resumes with resume=auto and its per-step metrics equal an uninterrupted run's. The handler and
the loop's stopping first without Ray, then `rlx train` for real."""
from __future__ import annotations

import os
import signal

import pytest

from rlcore.preemption import REQUEUE_EXIT_STATUS, Preempted, StopOnSignal
from tests.runs import SMALL_STEPS as STEPS, step_metrics


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
SURVIVES_RAY_SHUTDOWN = """
import os, signal, sys
from rlcore.placement import start_ray
from rlcore.preemption import StopOnSignal
import ray

said = []
start_ray("cpu", 1, num_cpus=1)
stop = StopOnSignal(say=said.append).install()  # after ray.init, as Trainer.fit does
os.kill(os.getpid(), signal.SIGTERM)  # the stop
ray.shutdown()  # the run's teardown
os.kill(os.getpid(), signal.SIGTERM)  # Slurm signals again while it exits
print(said)
sys.exit(75 if stop.signum == signal.SIGTERM and "received again" in said[-1] else 1)
"""


def test_a_second_sigterm_after_rays_shutdown_is_still_ignored():
    """Ray 2.60's driver sets SIGTERM back to the default in C early in ray.shutdown(), under Python's
    handler, unless its failure-signal handler is off (rlcore/placement.py
    keep_stop_handlers_through_shutdown): a repeated SIGTERM while a preempted run shut down killed it
    with -15 instead of status 75. In a process of its own: it starts and stops Ray."""
    import subprocess
    import sys

    from tests.runs import REPO

    done = subprocess.run([sys.executable, "-c", SURVIVES_RAY_SHUTDOWN], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == REQUEUE_EXIT_STATUS, (done.returncode, done.stdout[-2000:], done.stderr[-4000:])


@pytest.mark.e2e
def test_sigterm_saves_exits_75_and_the_rerun_equals_an_uninterrupted_run(interrupted_run, reference_run):
    """The small quickstart (tests/runs.py) with no periodic checkpoints, SIGTERMed twice after step 1
    (tests/conftest.py interrupted_run, leg 1): the one checkpoint is the one the signal asks for; the
    rerun resumes from it and its steps equal the uninterrupted run's (reference_run) exactly. Neither
    the stopped run nor the finished one leaves a process. (The rerun is later SIGKILLed and resumed
    again: tests/test_checkpoint.py; every step of the three legs equals the reference run's.)"""
    assert reference_run.saw_raylet, "the watch never saw the reference run's Ray"
    assert reference_run.left == []  # a run that finished leaves no process

    run, done = interrupted_run, interrupted_run.stopped_after
    assert run.stopped_code == REQUEUE_EXIT_STATUS
    assert f"stopped by SIGTERM after step {done} of {STEPS} with checkpoint" in run.stopped_log
    assert "received again while stopping: ignored" in run.stopped_log
    # trainer.save_every=0: nothing was saved before the signal (a finished run saves nothing at all:
    # tests/test_console.py).
    assert run.checkpoints_after_stop == [f"step_{done:08d}"]
    assert run.latest_after_stop == f"step_{done:08d}"
    assert run.stopped_left == []  # the stopped run leaves no process

    assert f"checkpoint: resumed from {run.run_dir / 'checkpoints' / f'step_{done:08d}'}" in run.killed_log
    got, want = step_metrics(run.run_dir), step_metrics(reference_run.run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == want[step], (step, got[step], want[step])
