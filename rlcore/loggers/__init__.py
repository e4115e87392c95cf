"""Where the per-step metrics go: ``trainer.logger`` lists names of this registry. A new logger is one
file here (a class with ``__init__(ctx: LoggerContext)``, ``log(step, metrics)``, ``close(failed)``)
and one line below; ``package`` is the module it needs, checked before a run starts
(``check_loggers``, from rlcore/validate.py) so a missing one is a sentence, not a crash at step 1.
``rlcore.metrics.MetricsLogger`` runs the listed ones together."""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Optional, Sequence

from rlcore.loggers.base import Logger, LoggerContext, flatten
from rlcore.loggers.console import ConsoleLogger
from rlcore.loggers.jsonl import JsonlLogger
from rlcore.loggers.mlflow_logger import MlflowLogger
from rlcore.loggers.tensorboard import TensorBoardLogger
from rlcore.loggers.wandb_logger import WandbLogger
from rlcore.registry import Registry


@dataclasses.dataclass(frozen=True)
class LoggerMeta:
    package: Optional[str] = None  # the module the logger imports (None: only the core install)
    extra: Optional[str] = None  # the setup.py extra that installs it


LOGGERS: Registry[type] = Registry("trainer.logger", meta=LoggerMeta)
LOGGERS.add("console", ConsoleLogger)
LOGGERS.add("jsonl", JsonlLogger)
LOGGERS.add("tensorboard", TensorBoardLogger, package="tensorboard")
LOGGERS.add("wandb", WandbLogger, package="wandb", extra="wandb")
LOGGERS.add("mlflow", MlflowLogger, package="mlflow", extra="mlflow")

WANDB_MODES = ("online", "offline", "disabled")


def package_installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_loggers(names: Sequence[str], wandb_mode: Optional[str] = None) -> None:
    """A ValueError (one sentence naming trainer.logger) for an unknown or repeated name, or a logger
    whose package is not installed; trainer.wandb_mode against wandb's modes."""
    for i, name in enumerate(names):
        LOGGERS.check(name)
        if name in names[:i]:
            raise ValueError(f"trainer.logger lists {name!r} twice")
        package = LOGGERS.meta(name).package
        if package is not None and not package_installed(package):
            extra = LOGGERS.meta(name).extra
            how = f"pip install 'rlx[{extra}]'" if extra else f"pip install {package}"
            raise ValueError(f"trainer.logger lists {name!r}, but the {package} package is not installed: "
                             f"{how}, or drop {name!r} from trainer.logger")
    if wandb_mode is not None and wandb_mode not in WANDB_MODES:
        raise ValueError(f"trainer.wandb_mode={wandb_mode!r} is not one of: {', '.join(WANDB_MODES)} "
                         "(or null: WANDB_MODE from the environment)")


__all__ = ["LOGGERS", "Logger", "LoggerContext", "LoggerMeta", "check_loggers", "flatten", "package_installed"]
