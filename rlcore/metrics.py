"""Per-step metrics: ``MetricsLogger`` hands every step's metrics to the loggers that trainer.logger
lists (rlcore/loggers/: console, jsonl, tensorboard, wandb, mlflow); ``timer`` times a phase."""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Mapping, MutableMapping, Optional, Sequence

from rlcore.loggers import LOGGERS, LoggerContext, check_loggers, flatten

DEFAULT_LOGGERS = ("console", "jsonl", "tensorboard")
# Metrics that measure the machine, not the training: wall times, the weight sync's parts and page
# faults. Two runs of the same job (a resumed one and an uninterrupted one) differ in these only.
MEASUREMENT_PREFIXES = ("timing/", "weight_sync/")


def is_measurement(key: str) -> bool:
    """Whether metric ``key`` is a measurement of the machine (``MEASUREMENT_PREFIXES``)."""
    return key.startswith(MEASUREMENT_PREFIXES)


def _scalar(key: str, value: Any) -> float:
    """A metric value as a float; tensors from the losses are accepted (0-d or one element)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}")
    return float(value)


class MetricsLogger:
    """Runs the named loggers together. ``jsonl`` (``<run_dir>/metrics.jsonl``) is always among them,
    listed or not: resume trims it and ``rlx report`` reads it; it is written first, so a tracker that
    fails mid-step cannot lose the step's record."""

    def __init__(self, ctx: LoggerContext, names: Sequence[str] = DEFAULT_LOGGERS):
        check_loggers(names, ctx.wandb_mode)
        os.makedirs(ctx.run_dir, exist_ok=True)
        self.ctx = ctx
        self.names = ["jsonl", *(n for n in names if n != "jsonl")]
        self.loggers = []
        try:
            for name in self.names:
                self.loggers.append(LOGGERS[name](ctx))
        except BaseException:
            self.close(failed=True)  # the ones already open
            raise

    @classmethod
    def for_job(cls, cfg, start_step: int = 0) -> "MetricsLogger":
        """The loggers of a job spec (``rlcore.config.JobConfig``): its trainer.logger, names and
        modes, and the spec itself as the trackers' config. ``start_step``: the step a resumed run
        continues after (0: fresh)."""
        from omegaconf import OmegaConf

        t = cfg.trainer
        spec = OmegaConf.structured(cfg)
        ctx = LoggerContext(run_dir=t.run_dir, total_steps=t.total_steps, start_step=start_step,
                            project=t.project_name,
                            experiment=t.experiment_name or os.path.basename(os.path.normpath(t.run_dir)),
                            config=flatten(OmegaConf.to_container(spec)), spec_yaml=OmegaConf.to_yaml(spec),
                            wandb_mode=t.wandb_mode, mlflow_tracking_uri=t.mlflow_tracking_uri)
        return cls(ctx, t.logger)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = {key: _scalar(key, value) for key, value in metrics.items()}
        for logger in self.loggers:
            logger.log(step, values)

    def close(self, failed: Optional[bool] = None) -> None:
        """``failed`` None: whether an exception is propagating (close runs in the trainer's finally),
        so a tracker marks a crashed run as failed."""
        if failed is None:
            failed = sys.exc_info()[0] is not None
        errors = []
        for logger in reversed(self.loggers):  # each one closes even if another fails to
            try:
                logger.close(failed)
            except Exception as e:  # noqa: BLE001 - reported below, after the others closed
                errors.append(e)
        self.loggers = []
        if errors and not failed:
            raise errors[0]
        for e in errors if failed else ():  # never masks the run's own error
            print(f"metrics: a logger failed to close: {e}", file=sys.stderr)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close(failed=exc[0] is not None)


class Timer:
    """``with timer("rollout", metrics): ...`` adds the block's wall time to ``timing/rollout_s``
    (also when the block raises, so a failing step still reports where its time went)."""

    def __init__(self, name: str, metrics: MutableMapping[str, float]):
        self.name = name
        self.metrics = metrics
        self._start: Optional[float] = None

    def __enter__(self) -> "Timer":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        # Adds up: a phase that runs several times in a step (dynamic sampling) reports its total.
        key = f"timing/{self.name}_s"
        self.metrics[key] = self.metrics.get(key, 0.0) + time.perf_counter() - self._start


timer = Timer  # the spelling used at call sites: ``with timer("update", metrics):``
