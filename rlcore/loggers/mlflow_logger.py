"""``mlflow``: an MLflow run (``pip install rlx[mlflow]``; mlflow-skinny is enough). The experiment
is trainer.project_name, the run name trainer.experiment_name; the resolved job spec flattened into
params (and whole as the artifact job.yaml), every metric at its step. The tracking store is
trainer.mlflow_tracking_uri, else MLFLOW_TRACKING_URI, else a file store ``file:<run_dir>/mlruns``
(no server, no network; view it with ``mlflow ui --backend-store-uri file:<run_dir>/mlruns``). A
resumed run continues the same MLflow run: its id is kept in ``<run_dir>/mlflow_run.json``."""
from __future__ import annotations

import os
import time
from typing import Mapping

from rlcore.loggers.base import LoggerContext, RunRecord


def tracking_uri(ctx: LoggerContext) -> str:
    return (ctx.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            or "file:" + os.path.join(os.path.abspath(ctx.run_dir), "mlruns"))


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]


class MlflowLogger:
    def __init__(self, ctx: LoggerContext):
        uri = tracking_uri(ctx)
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps its file store in maintenance mode behind this opt-in; a file store is
            # what runs with no server or database. An explicit MLFLOW_ALLOW_FILE_STORE wins.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param, RunStatus
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        self._Metric, self._RunStatus, self._metrics_per_batch = Metric, RunStatus, MAX_METRICS_PER_BATCH
        self._client = client = MlflowClient(tracking_uri=uri)
        self._record = RunRecord(ctx.run_dir, "mlflow", ctx.start_step)
        have: dict[str, str] = {}
        if self._record.run_id is not None:  # resuming: the same run, running again
            run_id = self._record.run_id
            client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            have = client.get_run(run_id).data.params
        else:
            experiment = client.get_experiment_by_name(ctx.project)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(ctx.project)
            run_id = client.create_run(experiment_id, run_name=ctx.experiment,
                                       tags={"rlx.run_dir": os.path.abspath(ctx.run_dir)}).info.run_id
            if ctx.spec_yaml:
                client.log_text(run_id, ctx.spec_yaml, "job.yaml")
        # MLflow params are write-once: a resumed run adds only keys the run lacks (a changed value
        # stays the first attempt's; the checkpoint log names the changes). Values over MLflow's
        # length limit are cut; job.yaml holds them whole.
        params = [Param(key, str(value)[:MAX_PARAM_VAL_LENGTH]) for key, value in ctx.config.items() if key not in have]
        for chunk in _chunks(params, MAX_PARAMS_TAGS_PER_BATCH):
            client.log_batch(run_id, params=chunk)
        self._run_id = run_id
        self._record.save(run_id)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._record.holds(step):  # logged by the attempt this run resumes
            return
        now = int(time.time() * 1000)
        batch = [self._Metric(key, value, now, step) for key, value in metrics.items()]
        for chunk in _chunks(batch, self._metrics_per_batch):
            self._client.log_batch(self._run_id, metrics=chunk)
        self._record.save(self._run_id, step)

    def close(self, failed: bool = False) -> None:
        status = self._RunStatus.FAILED if failed else self._RunStatus.FINISHED
        self._client.set_terminated(self._run_id, status=self._RunStatus.to_string(status))
