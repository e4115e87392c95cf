"""The run every trainer shares: resume, the metrics loggers, the stop on SIGTERM/SIGUSR1, validation
every ``trainer.val_every`` steps (and before step 1 of a fresh run), a checkpoint every
``trainer.save_every`` steps and at the last one.

The RL ``Trainer`` (``rlcore/trainer.py``) and the ``PreferenceTrainer`` (``rlcore/preference.py``)
subclass it and give what differs: ``train_step``, ``validate`` (and whether there is anything to
validate on), ``resume`` and the controller's ``state_dict``.
"""
from __future__ import annotations

from rlcore import checkpoint, preemption
from rlcore.config import JobConfig
from rlcore.metrics import MetricsLogger
from rlcore.roles import Roles


class StepLoop:
    cfg: JobConfig
    roles: Roles
    saved_step = 0  # the step a checkpoint holds already (0: none)

    # ------------------------------------------------------------------ what a trainer gives
    def train_step(self, step: int) -> dict[str, float]:
        raise NotImplementedError

    @property
    def validates(self) -> bool:
        """Whether the job has held-out data to validate on."""
        raise NotImplementedError

    def validate(self) -> dict[str, float]:
        raise NotImplementedError

    def resume(self) -> int:
        """Restores a checkpoint per ``trainer.resume``; the step to continue after (0: a fresh start)."""
        raise NotImplementedError

    def state_dict(self, step: int) -> dict:
        """What the controller must restore to continue exactly after ``step``."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------ the run
    def fit(self) -> list[dict]:
        t = self.cfg.trainer
        history = []
        # Before the logger opens metrics.jsonl: resuming drops the lines of steps it will redo.
        start = self.resume()
        logger = MetricsLogger.for_job(self.cfg, start)
        stop = preemption.StopOnSignal().install()  # SIGTERM/SIGUSR1: a checkpoint at the next step boundary
        validates = self.validates and t.val_every > 0
        try:
            if validates and start == 0:
                logger.log(0, self.validate())
            for step in range(start + 1, t.total_steps + 1):
                stop.check(step - 1, t.total_steps, self.save_unless_saved)  # raises Preempted after a signal
                metrics = self.train_step(step)
                if validates and step % t.val_every == 0:
                    metrics.update(self.validate())
                logger.log(step, metrics)
                history.append(metrics)
                self.maybe_save(step)
        finally:
            stop.restore()
            logger.close()
        return history

    # ---------------------------------------------------------------------------- checkpoints
    def maybe_save(self, step: int) -> None:
        t = self.cfg.trainer
        if t.save_every and (step % t.save_every == 0 or step == t.total_steps):
            self.save(step)

    def save(self, step: int) -> str:
        t = self.cfg.trainer
        folder = checkpoint.save_checkpoint(checkpoint.checkpoint_dir_of(t), step, self.roles.trainable(),
                                            self.state_dict(step), checkpoint.job_yaml(self.cfg), t.keep_last)
        self.saved_step = step
        return folder

    def save_unless_saved(self, step: int) -> str:
        """The checkpoint of ``step`` (a run stopping on a signal): saved now unless saved already."""
        if step == self.saved_step:
            return checkpoint.read_latest(checkpoint.checkpoint_dir_of(self.cfg.trainer)) or f"of step {step}"
        return self.save(step)
