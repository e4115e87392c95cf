"""``console``: a progress bar and one summary line per step."""
from __future__ import annotations

import math
from typing import Mapping

from tqdm import tqdm

from rlcore.loggers.base import LoggerContext

# What the one-line summary shows, in order: (metric key, label, format).
SUMMARY_FIELDS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("actor/pg_loss", "pg_loss", "{:+.4f}"),
    ("actor/kl_ref", "kl_ref", "{:.4f}"),
    ("rollout/logprob_diff_max", "lp_diff_max", "{:.3g}"),
    ("timing/step_s", "step", "{:.1f}s"),
    ("val/reward_mean", "val_reward", "{:.3f}"),
)


def summary(step: int, total_steps: int, values: Mapping[str, float]) -> str:
    parts = [f"step {step}/{total_steps}"]
    for key, label, fmt in SUMMARY_FIELDS:
        if key in values:
            value = values[key]
            parts.append(f"{label} {fmt.format(value) if math.isfinite(value) else value}")
    return " | ".join(parts)


class ConsoleLogger:
    def __init__(self, ctx: LoggerContext):
        self.total_steps = ctx.total_steps
        self._bar = tqdm(total=ctx.total_steps, desc="train", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        # Set the bar to the step (not +1) so a resumed run starts where it left off.
        self._bar.update(step - self._bar.n)
        tqdm.write(summary(step, self.total_steps, metrics))

    def close(self, failed: bool = False) -> None:
        self._bar.close()
