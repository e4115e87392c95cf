"""Non-finite updates: what the run does when an actor or critic update has a NaN/inf loss or
gradient norm (``trainer.on_nonfinite``).

The Megatron engines never apply such an update (megatron_workers/engine.py ``_check_finite``: the
check runs before the optimizer step, on every rank of the role); they report it as
``<role>/update_skipped``. This module is the controller's side:

- ``stop`` (the default): the run ends with one sentence naming the step, the role and the first
  non-finite metric (``NonFiniteError``); every earlier step is in metrics.jsonl and the last
  checkpoint is untouched.
- ``skip``: that optimizer step is dropped (weights, Adam's moments and step count, and the lr
  schedule unchanged) and the run goes on; ``<role>/skipped_steps`` counts the dropped optimizer
  steps of the run so far, and the step's metrics are logged with their non-finite values. The weight
  sync after the step still runs and bumps the weight version: a version names "the weights after step
  k", applied or not, so trajectories' ``weight_version`` and the staleness metrics keep their meaning
  (the engines receive the same weights again).

In both cases the offending mini-batch is saved as ``run_dir/debug/step_<k>_<role>.pt``:
``torch.load(path)`` gives ``{"step", "role", "first_bad", "metrics", "batch": {name: tensor}}``.
"""
from __future__ import annotations

import math
import os

import torch

from rlcore.faults import RunStopped

POLICIES = ("stop", "skip")
# Test-only: poison the actor's batch (advantages set to NaN) at this step, so the tests can drive a
# real non-finite update through the engines. Never set it in a real run.
POISON_ENV = "RLX_TEST_POISON_STEP"


class NonFiniteError(RunStopped):
    """An update had a NaN/inf loss or gradient norm under trainer.on_nonfinite=stop."""


def first_nonfinite(metrics: dict[str, float], role: str) -> str | None:
    """The first non-finite metric of ``role``'s update: its loss terms in the order the head reported
    them, then the total loss, then the gradient norm (the term names the cause best)."""
    loss, norm = f"{role}/loss", f"{role}/grad_norm"
    ordered = [k for k in metrics if k.startswith(f"{role}/") and k not in (loss, norm)] + [loss, norm]
    for key in ordered:
        if key in metrics and not math.isfinite(metrics[key]):
            return key
    return None


class NonFiniteGuard:
    """Applies ``trainer.on_nonfinite`` to each optimizer step's result; keeps the run's counts."""

    def __init__(self, policy: str, run_dir: str, roles: dict):
        if policy not in POLICIES:
            raise ValueError(f"trainer.on_nonfinite={policy!r} is not one of: {', '.join(POLICIES)}")
        self.policy, self.run_dir = policy, run_dir
        self.names = {id(role): name for name, role in roles.items()}  # role object -> "actor" | "critic"
        self.skipped = {name: 0 for name in roles}
        self.step = 0

    def start(self, step: int) -> None:
        self.step = step

    def poison_for_test(self, role, batch) -> None:
        """The test-only hook (``RLX_TEST_POISON_STEP``): NaN advantages in the actor's batch."""
        if self.names.get(id(role)) == "actor" and os.environ.get(POISON_ENV) == str(self.step):
            batch["advantages"] = torch.full_like(batch["advantages"], float("nan"))

    def check(self, role, batch, metrics: dict[str, float]) -> None:
        """After one optimizer step of ``role`` on ``batch``: nothing if it was finite; else the batch
        is dumped, then the run stops (NonFiniteError) or the skip is counted."""
        name = self.names.get(id(role))
        if name is None or not metrics.get(f"{name}/update_skipped"):
            return
        bad = first_nonfinite(metrics, name) or f"{name}/update_skipped"
        path = self.dump(name, batch, metrics, bad)
        if self.policy == "stop":
            raise NonFiniteError(
                f"step {self.step}: {name} update: {bad} is {metrics.get(bad)} (the update was not applied; "
                f"its batch is in {path}; trainer.on_nonfinite=stop, or skip to drop such updates and go on)")
        self.skipped[name] += 1

    def metrics(self) -> dict[str, float]:
        """``<role>/skipped_steps``: optimizer steps dropped in this run so far (this process; a resumed
        run counts from its restart)."""
        return {f"{name}/skipped_steps": float(n) for name, n in self.skipped.items()}

    def dump(self, name: str, batch, metrics: dict[str, float], bad: str) -> str:
        folder = os.path.join(self.run_dir, "debug")
        os.makedirs(folder, exist_ok=True)
        path, i = os.path.join(folder, f"step_{self.step}_{name}.pt"), 1
        while os.path.exists(path):  # a later bad mini-batch of the same step
            i += 1
            path = os.path.join(folder, f"step_{self.step}_{name}_{i}.pt")
        torch.save({"step": self.step, "role": name, "first_bad": bad, "metrics": dict(metrics),
                    "batch": {k: v.detach().cpu() for k, v in batch.items()}}, path)
        return path
