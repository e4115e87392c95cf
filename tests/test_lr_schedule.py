"""The learning-rate schedule: the resolved schedule (rlcore/lr_schedule.py) drives megatron-core's own
OptimizerParamScheduler (built as the engine builds it) over a one-tensor torch parameter group, with
hand-computed lrs per optimizer step; what a resume keeps; the spec's checks. No Ray."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from rlcore.config import JobConfig, OptimConfig, resolved_critic
from rlcore.job import ConfigError, load_job
from rlcore.lr_schedule import LRSchedule, resolve, role_schedule, run_optimizer_steps
from rlcore.validate import check_lr_schedule, validate

# lr 1e-3 -> min_lr 1e-4 over 6 optimizer steps, the first 2 warming up from 0.
BASE = LRSchedule(lr=1e-3, min_lr=1e-4, warmup_init=0.0, warmup_steps=2, decay_steps=6, decay_style="cosine")
# The lr of optimizer steps 1..8 (step k runs at the scheduler's count k-1): warm-up 0, lr/2, then lr at
# the end of the warm-up; cosine: min + (lr-min) * (cos(pi * (k-1-2)/4) + 1) / 2; min_lr past step 7.
EXPECTED = {
    "cosine": [0.0, 5e-4, 1e-3, 1e-4 + 9e-4 * 0.8535533905932737, 5.5e-4, 1e-4 + 9e-4 * 0.14644660940672627,
               1e-4, 1e-4],
    "linear": [0.0, 5e-4, 1e-3, 7.75e-4, 5.5e-4, 3.25e-4, 1e-4, 1e-4],
    "constant": [0.0, 5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3],
}


def _optimizer(schedule: LRSchedule) -> torch.optim.Optimizer:
    # As megatron's param groups: each carries its max_lr/min_lr, which get_lr prefers to the scheduler's.
    return torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(2))], "max_lr": schedule.lr,
                              "min_lr": schedule.min_lr, "default_config": True}], lr=schedule.lr)


def _scheduler(schedule: LRSchedule):
    from megatron_workers.engine import build_lr_scheduler

    return build_lr_scheduler(_optimizer(schedule), schedule, weight_decay=0.0)


def _lrs(scheduler, steps: int) -> list[float]:
    """The lr each of the next ``steps`` optimizer steps runs at, stepping as MegatronEngine.update does."""
    from megatron_workers.engine import current_lr

    out = []
    for _ in range(steps):
        out.append(current_lr(scheduler.optimizer))
        scheduler.step(increment=1)
    return out


@pytest.mark.parametrize("style", sorted(EXPECTED))
def test_megatron_scheduler_follows_the_hand_computed_lrs(style):
    schedule = dataclasses.replace(BASE, decay_style=style, min_lr=BASE.min_lr if style != "constant" else BASE.lr)
    assert _lrs(_scheduler(schedule), 8) == pytest.approx(EXPECTED[style], rel=1e-12, abs=1e-15)
    assert [schedule.lr_at(k) for k in range(1, 9)] == pytest.approx(EXPECTED[style], rel=1e-12, abs=1e-15)


def test_no_warmup_starts_at_lr():
    schedule = dataclasses.replace(BASE, warmup_steps=0, decay_style="linear")
    assert _lrs(_scheduler(schedule), 3) == pytest.approx([1e-3, 1e-3 - 9e-4 / 6, 1e-3 - 2 * 9e-4 / 6])


def _resumed(saved_schedule: LRSchedule, new_schedule: LRSchedule, after: int):
    """A scheduler of ``new_schedule`` loaded from one of ``saved_schedule`` that took ``after`` steps,
    as MegatronEngine.load_checkpoint does (the optimizer's groups restored with the saved values)."""
    from megatron_workers.engine import follow_lr_scheduler

    old = _scheduler(saved_schedule)
    _lrs(old, after)
    new = _scheduler(new_schedule)
    for group in new.optimizer.param_groups:  # the optimizer state of the checkpoint carries its groups
        group["max_lr"], group["min_lr"] = saved_schedule.lr, saved_schedule.min_lr
    new.load_state_dict(old.state_dict())
    follow_lr_scheduler(new)
    return new


def test_resume_continues_the_schedule_exactly():
    assert _lrs(_resumed(BASE, BASE, 3), 5) == pytest.approx(EXPECTED["cosine"][3:], rel=1e-12)


def test_a_changed_spec_wins_on_resume_unless_from_checkpoint():
    longer = dataclasses.replace(BASE, lr=2e-3, decay_steps=10)
    # The spec's schedule, at the checkpoint's step count (3 steps taken: the next runs at count 3).
    assert _lrs(_resumed(BASE, longer, 3), 2) == pytest.approx([longer.lr_at(4), longer.lr_at(5)], rel=1e-12)
    kept = dataclasses.replace(longer, from_checkpoint=True)
    assert _lrs(_resumed(BASE, kept, 3), 2) == pytest.approx(EXPECTED["cosine"][3:5], rel=1e-12)


def test_the_run_counts_optimizer_steps():
    cfg = JobConfig()
    cfg.trainer.total_steps, cfg.data.batch_size = 10, 8
    cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_epochs = 2, 3
    cfg.actor.optim = OptimConfig(lr=1e-3, lr_warmup_ratio=0.1, lr_decay_style="cosine", min_lr=1e-5)
    assert run_optimizer_steps(cfg, cfg.actor) == 10 * 3 * 4
    s = role_schedule(cfg, "actor")
    assert (s.warmup_steps, s.decay_steps, s.min_lr, s.decay_style) == (12, 120, 1e-5, "cosine")
    cfg.critic.ppo_mini_batch_size = 4  # the critic's own split; its epochs are the actor's
    assert run_optimizer_steps(cfg, resolved_critic(cfg)) == 10 * 3 * 2
    assert resolve(OptimConfig(lr=1e-3, lr_decay_steps=50, lr_warmup_steps=5), 120).decay_steps == 50


@pytest.mark.parametrize("overrides, message", [
    (["actor.optim.lr_warmup_steps=2", "actor.optim.lr_warmup_ratio=0.1"],
     "actor.optim.lr_warmup_steps=2 and actor.optim.lr_warmup_ratio=0.1 are two ways"),
    (["actor.optim.lr_decay_style=exponential"], "actor.optim.lr_decay_style='exponential' is not one of"),
    (["actor.optim.lr=1e-6", "actor.optim.min_lr=1e-5"], r"actor.optim.min_lr=1e-05 must be in \[0, actor.optim.lr"),
    (["trainer.total_steps=3", "actor.optim.lr_warmup_steps=3"], "3 warm-up steps must end before the run's 3"),
    (["actor.optim.lr_warmup_ratio=1.5"], r"actor.optim.lr_warmup_ratio=1.5 must be in \[0, 1\)"),
    (["actor.optim.lr_warmup_steps=4", "actor.optim.lr_decay_steps=4"],
     "4 warm-up steps must end before actor.optim.lr_decay_steps=4"),
])
def test_bad_schedules_are_one_sentence_naming_the_key(overrides, message, qwen2_untied):
    with pytest.raises(ConfigError, match=message):
        validate(load_job("yaml_configs/quickstart_cpu.yaml", [f"model.path={qwen2_untied}", *overrides]),
                 require_files=False)


def test_the_critic_schedule_is_checked():
    cfg = JobConfig()
    cfg.critic.optim = OptimConfig(lr=1e-5, min_lr=1e-4, lr_decay_style="linear")
    with pytest.raises(ConfigError, match=r"critic.optim.min_lr=0.0001 must be in \[0, critic.optim.lr=1e-05\]"):
        check_lr_schedule(cfg, "critic")


# --------------------------------------------------------------------------- real stack (e2e)
@pytest.mark.e2e
def test_actor_lr_follows_warmup_cosine_and_a_resume_continues_it(tiny_assets, reference_run):
    """The session's reference run (tests/conftest.py: the small quickstart of tests/runs.py, 4 steps x
    2 optimizer steps, warm-up 2, cosine to min_lr over 8): its actor/lr follows the schedule. The runs
    resumed from its checkpoints report the same lrs: tests/test_checkpoint.py (from step 2 after a
    SIGKILL, from step 3 under TP1 PP2) and tests/test_preemption.py (after a SIGTERM) assert every
    metric, actor/lr among them, equal to this run's."""
    from tests.runs import QUICKSTART, small_quickstart, step_metrics

    cfg = load_job(QUICKSTART, small_quickstart(*tiny_assets, reference_run.run_dir))
    schedule = role_schedule(cfg, "actor")
    assert (schedule.warmup_steps, schedule.decay_steps, schedule.decay_style) == (2, 8, "cosine")
    # actor/lr is the mean over the step's optimizer steps: 2k-1 and 2k.
    expected = [(schedule.lr_at(2 * k - 1) + schedule.lr_at(2 * k)) / 2 for k in range(1, 5)]
    assert expected[0] == pytest.approx(schedule.lr / 4)  # warm-up: 0 then lr/2
    assert expected[1] > expected[2] > expected[3] > schedule.min_lr  # then the cosine decay
    lrs = [m["actor/lr"] for _, m in sorted(step_metrics(reference_run.run_dir).items())]
    assert lrs == pytest.approx(expected, rel=1e-9)
