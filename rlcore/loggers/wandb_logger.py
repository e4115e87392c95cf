"""``wandb``: a Weights & Biases run (``pip install rlx[wandb]``). Project and name from
trainer.project_name / trainer.experiment_name, the resolved job spec (flattened) as its config,
every metric at its step. Files under ``<run_dir>/wandb``. With no network, ``WANDB_MODE=offline``
(or trainer.wandb_mode=offline) keeps the run on disk for a later ``wandb sync <run_dir>/wandb``.
A resumed run continues the same W&B run: its id is kept in ``<run_dir>/wandb_run.json``."""
from __future__ import annotations

from typing import Mapping

from rlcore.loggers.base import LoggerContext, RunRecord


class WandbLogger:
    def __init__(self, ctx: LoggerContext):
        import wandb
        from wandb.sdk.lib.runid import generate_id

        self._record = RunRecord(ctx.run_dir, "wandb", ctx.start_step)
        run_id = self._record.run_id or generate_id()
        self._run = wandb.init(
            project=ctx.project, name=ctx.experiment, id=run_id, resume="allow", dir=ctx.run_dir,
            config=ctx.config, allow_val_change=True, mode=ctx.wandb_mode,
            # console="off": wandb would otherwise wrap stdout/stderr under the progress bar.
            settings=wandb.Settings(console="off", quiet=True), reinit="create_new")
        self._record.save(self._run.id)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._record.holds(step):  # logged by the attempt this run resumes
            return
        self._run.log(dict(metrics), step=step)
        self._record.save(self._run.id, step)

    def close(self, failed: bool = False) -> None:
        self._run.finish(exit_code=1 if failed else 0)
