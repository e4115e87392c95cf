"""``jsonl``: ``<run_dir>/metrics.jsonl``, one flushed line per step. Always written (whether or not
trainer.logger lists it): a resume trims it to the checkpoint's step (rlcore/checkpoint.py) and
``rlx report`` draws from it."""
from __future__ import annotations

import json
import os
from typing import Mapping

from rlcore.loggers.base import LoggerContext


class JsonlLogger:
    def __init__(self, ctx: LoggerContext):
        # Append: a resumed run continues the same file.
        self._file = open(os.path.join(ctx.run_dir, "metrics.jsonl"), "a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        # NaN/inf are written as Python's json does (NaN, Infinity): a diverged loss must stay visible.
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self, failed: bool = False) -> None:
        self._file.close()
