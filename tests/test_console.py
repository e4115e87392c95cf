"""A quiet console (rlcore/worker_logs.py): a tiny run's console shows the progress bar, the step lines
and rlx's own summary, not the libraries' start-up noise; that noise, in full, is in run_dir/logs/;
and a run that fails inside a worker still shows the worker's error on the console."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from rlcore.worker_logs import RAY_HARMLESS
from rollout.engine import HARMLESS_WARNINGS
from tests.runs import REPO

SPEC = os.path.join(REPO, "yaml_configs", "quickstart_cpu.yaml")
# What a newcomer should see: rlx's lines. Anything else is counted.
RLX_LINES = [r"^step \d+/\d+ \| ", r"^train: .*step", r": valid \(cpu profile", r"^role\s+pool\s+gpus",
             r"^(actor|reference|rollout|critic)( \(in \w+\))?\s+\w+\s+\d+\s", r"^final step: \{"]
# Other lines allowed: a real warning of some library on some machine may show (it should); today's
# run shows none.
MAX_OTHER_LINES = 3
# Noise that must never reach the console again: the harmless patterns themselves, vLLM's INFO lines
# and progress bar, torch's C++ NUMA notice, Ray's INFO. (A line with Ray's "(Actor pid=N)" prefix is
# not noise by itself: a worker's real warning comes with it. It counts as an other line.)
NOISE = [*HARMLESS_WARNINGS, *RAY_HARMLESS, r"\bINFO\b", r"Loading safetensors checkpoint shards", r"NUMA binding",
         r"FutureWarning", r"Started a local Ray instance"]


def run_cli(run_dir, model: str, data: str, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launch.cli", "train", SPEC, f"model.path={model}", f"data.train_files=[{data}]",
           f"data.val_files=[{data}]", f"trainer.run_dir={run_dir}", "trainer.val_every=0", *overrides]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def console_lines(proc) -> list[str]:
    text = proc.stdout + proc.stderr
    return [line.strip() for line in re.split(r"[\r\n]", text) if line.strip()]  # tqdm redraws with \r


@pytest.mark.e2e
def test_a_short_run_shows_progress_and_keeps_the_full_logs(tracked_short_run):
    """The short run of tests/conftest.py (2 steps, every tracker on: W&B and MLflow keep quiet too)."""
    run_dir, proc = tracked_short_run
    lines = console_lines(proc)
    assert any(re.search(r"^step 2/2 \| ", line) for line in lines)
    assert any(re.search(r"^train: .*2/2", line) for line in lines)  # the progress bar
    other = [line for line in lines if not any(re.search(p, line) for p in RLX_LINES)]
    assert len(other) <= MAX_OTHER_LINES, "\n".join(other)
    noisy = [line for line in lines if any(re.search(p, line) for p in NOISE)]
    assert not noisy, "\n".join(noisy)
    # trainer.save_every=0 (the default): a finished run saves nothing (the checkpoint a preempted run
    # has is the one its signal asked for: tests/test_preemption.py).
    assert not (run_dir / "checkpoints").exists()

    # The full output is in run_dir/logs/: every worker's file, vLLM's start-up lines included.
    logs = run_dir / "logs"
    engine_log = (logs / "rollout_engine0.log").read_text()
    assert "Initializing a V1 LLM engine" in engine_log  # vLLM's INFO start-up line
    assert "Enforce eager set" in engine_log  # a harmless warning: off the console, kept here
    assert "Setting up DistributedDataParallel" in (logs / "actor_rank0.log").read_text()  # megatron's INFO
    # reference.colocate=false here: the reference's own processes log too.
    assert (logs / "actor_rank1.log").stat().st_size > 0 and (logs / "reference_rank0.log").stat().st_size > 0
    assert "Started a local Ray instance" in (logs / "driver.log").read_text()
    assert (logs / "ray").is_dir() and any((logs / "ray").iterdir())  # Ray's session logs, linked


@pytest.mark.e2e
def test_a_worker_error_still_reaches_the_console(tmp_path, tiny_assets):
    model, data = tiny_assets
    broken = tmp_path / "broken-model"
    shutil.copytree(model, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a truncated download: the workers fail to load it
    proc = run_cli(tmp_path / "run", str(broken), data, "trainer.total_steps=1", "data.batch_size=4")
    assert proc.returncode != 0
    assert "SafetensorError" in proc.stderr and "invalid header length" in proc.stderr, proc.stderr[-3000:]
