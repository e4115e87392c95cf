"""``tensorboard``: scalars under ``<run_dir>/tensorboard``, through torch's SummaryWriter."""
from __future__ import annotations

import os
from typing import Mapping

from rlcore.loggers.base import LoggerContext


class TensorBoardLogger:
    def __init__(self, ctx: LoggerContext):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when wanted

        # A resumed run redoes the steps after its checkpoint: purge_step hides what the first
        # attempt wrote from there on, so each step shows once.
        self._writer = SummaryWriter(log_dir=os.path.join(ctx.run_dir, "tensorboard"),
                                     purge_step=ctx.start_step + 1 if ctx.start_step > 0 else None)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self, failed: bool = False) -> None:
        self._writer.close()
