"""What every logger gets and keeps: the run's context, and the small file in the run dir through
which an external tracker (wandb, mlflow) continues the same run after a resume."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Optional, Protocol


@dataclasses.dataclass
class LoggerContext:
    run_dir: str
    total_steps: int
    start_step: int = 0  # the step a resumed run continues after; 0: a fresh start
    project: str = "rlx"  # trainer.project_name
    experiment: str = "default"  # trainer.experiment_name (default: the run dir's folder name)
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # the resolved job spec, flattened
    spec_yaml: str = ""  # the same spec as YAML (an artifact where the tracker keeps files)
    wandb_mode: Optional[str] = None  # trainer.wandb_mode
    mlflow_tracking_uri: Optional[str] = None  # trainer.mlflow_tracking_uri


class Logger(Protocol):
    """One destination of the per-step metrics. ``log`` gets plain floats (NaN/inf included);
    ``close(failed)`` says whether the run ended with an error."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"actor": {"tp": 1}}`` -> ``{"actor.tp": 1}``: the dotted keys the job spec's overrides use."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


class RunRecord:
    """``<run_dir>/<name>_run.json``: the tracker's run id and the last step it holds. A resumed run
    (start_step > 0) continues that run and skips the steps it already holds, so no step appears
    twice; a fresh start begins a new run and overwrites the record."""

    def __init__(self, run_dir: str, name: str, start_step: int):
        self.path = os.path.join(run_dir, f"{name}_run.json")
        self.run_id: Optional[str] = None
        self.last_step = -1
        if start_step > 0 and os.path.isfile(self.path):
            with open(self.path) as f:
                saved = json.load(f)
            self.run_id, self.last_step = saved["id"], int(saved["last_step"])

    def holds(self, step: int) -> bool:
        return step <= self.last_step

    def save(self, run_id: str, last_step: Optional[int] = None) -> None:
        self.run_id = run_id
        if last_step is not None:
            self.last_step = last_step
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"id": self.run_id, "last_step": self.last_step}, f)
        os.replace(tmp, self.path)  # a kill mid-write leaves the previous record
