"""Preemption: SIGTERM or SIGUSR1 stops the run at the next step boundary with a checkpoint.

A cluster that preempts a job, or reaches its time limit, first signals it. ``StopOnSignal`` turns
that signal into a request the training loop looks at between steps: the step in flight finishes
(abandoning it half-way would lose the rollouts and updates already done and gain nothing, since a
step is short next to Slurm's notice, e.g. ``--signal=B:USR1@120``), then the trainer saves a
checkpoint of it into ``trainer.checkpoint_dir`` whatever ``trainer.save_every`` is (a preempted run
without a checkpoint could not continue; ``trainer.keep_last`` applies as to every save) and raises
``Preempted``. ``rlx train`` exits with ``REQUEUE_EXIT_STATUS`` (75, EX_TEMPFAIL: "try again later"),
which ``launch/rlx.sbatch`` turns into ``scontrol requeue``; the requeued job resumes with
``trainer.resume=auto`` and its steps equal an uninterrupted run's.

Repeated signals while stopping (Slurm may signal again, an operator may press on) are reported and
ignored until the process exits: neither the save nor the shutdown after it is cut short by one. A SIGKILL during the save still leaves the previous
checkpoint, because saves are atomic (``rlcore/checkpoint.py``).
"""
from __future__ import annotations

import signal
import sys
import threading
from typing import Callable, Optional

REQUEUE_EXIT_STATUS = 75  # sysexits.h EX_TEMPFAIL: stopped to be started again
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """The run stopped on a signal after ``step`` (its checkpoint saved, unless it was a fresh start
    stopped before its first step: nothing to save)."""

    def __init__(self, signum: int, step: int, total_steps: int, checkpoint: Optional[str]):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        saved = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (no step had finished)"
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step} of {total_steps} with "
                         f"{saved}; exiting with status {REQUEUE_EXIT_STATUS} so that the job is requeued "
                         "(trainer.resume=auto continues from it)")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class StopOnSignal:
    """``install()`` (or ``with StopOnSignal() as stop:``) sets handlers for ``STOP_SIGNALS`` (in the
    main thread only: Python delivers signals there), ``restore()`` puts the previous ones back.
    ``stop.signum`` is the first signal received, or None."""

    def __init__(self, signals=STOP_SIGNALS, say: Callable[[str], None] = _say):
        self.signals, self.say = tuple(signals), say
        self.signum: Optional[int] = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            self.say(f"rlx: {name} received: finishing the step in flight, then saving a checkpoint and exiting "
                     f"with status {REQUEUE_EXIT_STATUS}")
        else:
            self.say(f"rlx: {name} received again while stopping: ignored (the checkpoint is being saved)")

    def install(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def restore(self) -> None:
        """The previous handlers back; after a stop signal ours stay, so that a repeated signal is
        still ignored while the engines and Ray shut down and the process exits with its status."""
        if self.signum is None:
            for s, previous in self._previous.items():
                signal.signal(s, previous)
        self._previous.clear()

    def __enter__(self) -> "StopOnSignal":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def check(self, done: int, total_steps: int, save: Callable[[int], Optional[str]]) -> None:
        """At a step boundary, ``done`` steps finished: when a signal came, saves step ``done`` with
        ``save(step) -> folder or None`` (which skips a step that is saved already) and raises
        ``Preempted``. Step 0 of a fresh start is not saved: the requeued run starts it the same."""
        if self.signum is None:
            return
        raise Preempted(self.signum, done, total_steps, save(done) if done > 0 else None)
