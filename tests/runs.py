"""`rlx train` as a user runs it, for the e2e tests: a subprocess on a job spec with the tiny model
and data, its metrics.jsonl read back; and the small quickstart that interrupted runs are compared with."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rlcore.metrics import is_measurement

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = "yaml_configs/quickstart_cpu.yaml"
# The small quickstart run (8 prompts x 8 samples, 4 steps, no validation) that the checkpoint,
# preemption and Slurm tests interrupt and compare with one uninterrupted run (conftest.py reference_run):
# 2 optimizer steps a step (mini-batches of 4 prompts) under a warm-up + cosine lr schedule, so that
# every resume must continue the optimizer and the schedule exactly (tests/test_lr_schedule.py reads its
# lrs). lr_decay_steps is the 4-step run's 8, given so that a shorter run has the same lrs.
SMALL_STEPS = 4
# The quickstart with its actor and its reference on one rank each (TP1, a 1-GPU actor pool): two
# Megatron processes fewer to start (a one-step run: 33 CPU-s instead of 55), for the tests whose
# subject is not the layout (test_e2e, test_console and the interrupted runs keep the quickstart's TP2).
ONE_RANK = ("resources.pools.actor=1", "actor.tp=1")
SMALL_SCHEDULE = ["actor.ppo_mini_batch_size=4", "actor.micro_batch_size=32", "actor.optim.lr_warmup_steps=2",
                  "actor.optim.lr_decay_style=cosine", "actor.optim.min_lr=1e-4", "actor.optim.lr_decay_steps=8"]


def train_cli(spec: str, run_dir, model: str, data: str, *overrides: str) -> list[dict]:
    """Runs ``rlx train spec`` with ``model`` and ``data`` into ``run_dir`` (validation off) and returns
    its metrics lines; a failed run fails the test with the end of its output."""
    cmd = [sys.executable, "-m", "launch.cli", "train", spec, f"model.path={model}",
           f"data.train_files=[{data}]", f"data.val_files=[{data}]", f"trainer.run_dir={run_dir}",
           "trainer.val_every=0", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def small_quickstart(model: str, data: str, run_dir, *extra: str, steps: int = SMALL_STEPS) -> list[str]:
    """The overrides of the small quickstart run (its steps, then ``extra``)."""
    return [f"model.path={model}", f"data.train_files=[{data}]", "data.val_files=[]", "data.batch_size=8",
            "rollout.n=8", f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}", "trainer.val_every=0",
            "trainer.logger=[console,jsonl]", *SMALL_SCHEDULE, *extra]


def small_quickstart_cmd(model: str, data: str, run_dir, *extra: str, steps: int = SMALL_STEPS) -> list[str]:
    return [sys.executable, "-m", "launch.cli", "train", QUICKSTART,
            *small_quickstart(model, data, run_dir, *extra, steps=steps)]


def step_metrics(run_dir) -> dict[int, dict]:
    """metrics.jsonl by step, without the measurements (timings, page faults: they differ from run to
    run); no step twice."""
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"a step is logged twice: {steps}"
    return {r["step"]: {k: v for k, v in r.items() if not is_measurement(k)} for r in rows}


@dataclass
class WatchedRun:
    """A finished `rlx train` whose processes were watched (tests/procs.py): where it ran, its output,
    whether the watch saw its Ray, and which of its processes were still alive 30 s after it ended."""
    run_dir: Path
    log: Path
    saw_raylet: bool
    left: list[tuple[int, str]]


@dataclass
class InterruptedRun:
    """The small quickstart interrupted twice in one run_dir (conftest.py interrupted_run), with every
    process watched: SIGTERMed twice after step 1 with no periodic checkpoints (it saves the step it
    finished, ``stopped_after``, and exits 75), rerun with a checkpoint every step and SIGKILLed (the
    driver alone) in the step after its first checkpoint, rerun again to the end. Each leg's exit
    status, output and the processes still alive 30 s after it ended (GRACE_S); the checkpoints and
    logged steps left after the SIGTERM and after the SIGKILL."""
    run_dir: Path
    stopped_code: int
    stopped_log: str
    stopped_after: int
    checkpoints_after_stop: list[str]
    latest_after_stop: str
    stopped_left: list[tuple[int, str]]
    killed_code: int
    killed_log: str
    killed_markers: set[str]
    killed_saw_raylet: bool
    killed_left: list[tuple[int, str]]
    logged_before_kill: int
    resumed: subprocess.CompletedProcess
