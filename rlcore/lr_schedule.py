"""The learning-rate schedule of a trainable role, resolved from its ``optim`` section and the run's
length, in optimizer steps.

``megatron_workers`` builds megatron-core's ``OptimizerParamScheduler`` from an ``LRSchedule`` (this
module stays free of megatron). The trainer takes ``ppo_epochs x (data.batch_size /
ppo_mini_batch_size)`` optimizer steps per training step, so a schedule over the whole run needs that
count, which only the job spec knows: the composition root resolves it here and hands it to the role in
its ``RoleSpec``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rlcore.config import JobConfig, OptimConfig

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """What megatron's OptimizerParamScheduler is built from; every count in optimizer steps."""
    lr: float  # the peak (megatron's max_lr)
    min_lr: float
    warmup_init: float  # the lr of the first optimizer step when warmup_steps > 0
    warmup_steps: int
    decay_steps: int  # > warmup_steps; the lr is min_lr from here on (linear, cosine)
    decay_style: str  # constant | linear | cosine
    from_checkpoint: bool = False  # on resume the checkpoint's schedule wins (else this one)

    def lr_at(self, step: int) -> float:
        """The lr optimizer step ``step`` (1-based) runs at: megatron's formulas written out, so the
        expected lrs of a run can be computed without megatron (the e2e test)."""
        k = step - 1  # the scheduler's count of steps already taken
        if self.warmup_steps > 0 and k <= self.warmup_steps:
            return self.warmup_init + (self.lr - self.warmup_init) * k / self.warmup_steps
        if self.decay_style == "constant":
            return self.lr
        if k > self.decay_steps:
            return self.min_lr
        ratio = (k - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        coeff = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)


def optimizer_steps_per_step(cfg: JobConfig, role_cfg) -> int:
    """Optimizer steps of one training step for a role (``role_cfg``: cfg.actor, or
    ``resolved_critic(cfg)``): ppo_epochs passes of batch_size / ppo_mini_batch_size mini-batches."""
    mini = role_cfg.ppo_mini_batch_size or cfg.data.batch_size
    return role_cfg.ppo_epochs * max(1, cfg.data.batch_size // mini)


def run_optimizer_steps(cfg: JobConfig, role_cfg) -> int:
    """The optimizer steps of the whole run for a role."""
    return cfg.trainer.total_steps * optimizer_steps_per_step(cfg, role_cfg)


def warmup_steps(optim: OptimConfig, total: int) -> int:
    if optim.lr_warmup_steps is not None:
        return optim.lr_warmup_steps
    if optim.lr_warmup_ratio is not None:
        return int(optim.lr_warmup_ratio * total)
    return 0


def resolve(optim: OptimConfig, total: int) -> LRSchedule:
    """The schedule of a role whose run has ``total`` optimizer steps (the checks are
    rlcore/validate.py's ``check_lr_schedule``)."""
    return LRSchedule(lr=optim.lr, min_lr=optim.min_lr if optim.lr_decay_style != "constant" else optim.lr,
                      warmup_init=optim.lr_warmup_init, warmup_steps=warmup_steps(optim, total),
                      decay_steps=optim.lr_decay_steps if optim.lr_decay_steps is not None else total,
                      decay_style=optim.lr_decay_style, from_checkpoint=optim.lr_schedule_from_checkpoint)


def role_schedule(cfg: JobConfig, role: str) -> LRSchedule:
    """The resolved schedule of ``role`` ("actor" or "critic") in the job ``cfg``."""
    from rlcore.config import resolved_critic

    role_cfg = cfg.actor if role == "actor" else resolved_critic(cfg)
    return resolve(role_cfg.optim, run_optimizer_steps(cfg, role_cfg))
