"""Per-step metrics: a JSON-lines file, TensorBoard scalars, a progress bar with a one-line summary."""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Mapping, MutableMapping, Optional

from tqdm import tqdm

# What the one-line summary shows, in order: (metric key, label, format).
SUMMARY_FIELDS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("actor/pg_loss", "pg_loss", "{:+.4f}"),
    ("actor/kl_ref", "kl_ref", "{:.4f}"),
    ("rollout/logprob_diff_max", "lp_diff_max", "{:.3g}"),
    ("timing/step_s", "step", "{:.1f}s"),
    ("val/reward_mean", "val_reward", "{:.3f}"),
)


def _scalar(key: str, value: Any) -> float:
    """A metric value as a float; tensors from the losses are accepted (0-d or one element)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}")
    return float(value)


class MetricsLogger:
    """Writes every step's metrics to ``<run_dir>/metrics.jsonl`` (one flushed line per step) and,
    optionally, TensorBoard scalars under ``<run_dir>/tensorboard``; advances a progress bar."""

    def __init__(self, run_dir: str, total_steps: int, tensorboard: bool = True):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.total_steps = total_steps
        # Append: a resumed run continues the same file.
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when wanted

            self._writer = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))
        self._bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = {key: _scalar(key, value) for key, value in metrics.items()}
        # NaN/inf are written as Python's json does (NaN, Infinity): a diverged loss must stay visible.
        self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self._jsonl.flush()
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(key, value, global_step=step)
            self._writer.flush()
        # Set the bar to the step (not +1) so a resumed run starts where it left off.
        self._bar.update(step - self._bar.n)
        tqdm.write(self.summary(step, values))

    def summary(self, step: int, values: Mapping[str, float]) -> str:
        parts = [f"step {step}/{self.total_steps}"]
        for key, label, fmt in SUMMARY_FIELDS:
            if key in values:
                value = values[key]
                parts.append(f"{label} {fmt.format(value) if math.isfinite(value) else value}")
        return " | ".join(parts)

    def close(self) -> None:
        self._bar.close()
        if self._writer is not None:
            self._writer.close()
        self._jsonl.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
