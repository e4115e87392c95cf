"""Pipelined phases (trainer.off_policy_steps) through `rlx train` on the real stack: the quickstart
learns with generation one step ahead, DAPO's dynamic sampling and ReMax's baseline rollouts run in
the producer with validation in between, and a resumed run regenerates its queued batch.
The schedule itself (which version makes which batch, syncs never next to a generation) is
tests/test_rollout_queue.py's, without Ray."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from launch.assets import make_addition_data, make_tiny_model
from rlcore.checkpoint import CONTROLLER, step_dir_name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipelined")
    return make_tiny_model(str(root / "model")), make_addition_data(str(root / "data"))


def _train(spec: str, run_dir, model: str, data: str, *overrides: str) -> list[dict]:
    cmd = [sys.executable, "-m", "launch.cli", "train", spec, f"model.path={model}",
           f"data.train_files=[{data}]", f"data.val_files=[{data}]", f"trainer.run_dir={run_dir}",
           "trainer.val_every=0", "trainer.tensorboard=false", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def test_one_step_off_policy_quickstart_learns_like_the_synchronous_run(tmp_path, tiny_assets):
    steps = ["trainer.total_steps=30"]
    sync = _train("yaml_configs/quickstart_cpu.yaml", tmp_path / "sync", *tiny_assets, *steps)
    ahead = _train("yaml_configs/quickstart_cpu.yaml", tmp_path / "ahead", *tiny_assets, *steps,
                   "trainer.off_policy_steps=1")
    assert [r["step"] for r in ahead] == list(range(1, 31))
    # Every trajectory lags the weights it is trained from by at most one version: step k's batch was
    # sampled by version k-2 (step 1's by the start weights), and the update starts from version k-1.
    assert [r["rollout/staleness_max"] for r in ahead] == [0.0] + [1.0] * 29
    assert [r["rollout/weight_version"] for r in ahead] == [float(max(0, k - 2)) for k in range(1, 31)]
    assert all(r["rollout/staleness_max"] == 0.0 for r in sync)
    # Learns: the reward rises by at least half as much as in the synchronous run (measured: 0.25 and
    # 0.33 from the first five steps to the last five).
    gain = {name: _mean(rows[-5:], "reward/mean") - _mean(rows[:5], "reward/mean")
            for name, rows in (("sync", sync), ("ahead", ahead))}
    assert gain["sync"] > 0.2, gain
    assert gain["ahead"] > 0.5 * gain["sync"], gain


def test_dynamic_sampling_and_remax_baselines_run_two_steps_ahead_with_validation(tmp_path, tiny_assets):
    rows = _train("yaml_configs/dapo_quickstart_cpu.yaml", tmp_path / "run", *tiny_assets,
                  "trainer.total_steps=5", "trainer.val_every=2", "trainer.off_policy_steps=2",
                  "algorithm.adv_estimator=remax", "actor.loss.rollout_correction=tis")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert all("val/reward_mean" in rows[k] for k in (0, 2, 4))
    train = rows[1:]
    assert [r["rollout/weight_version"] for r in train] == [0.0, 0.0, 0.0, 1.0, 2.0]  # max(0, k - 3)
    assert [r["rollout/staleness_max"] for r in train] == [0.0, 1.0, 2.0, 2.0, 2.0]
    for r in train:  # the producer's own metrics reach the step that trains on its batch
        assert 1 <= r["dynamic_sampling/gen_batches"] <= 8
        assert "reward/greedy_baseline_mean" in r and "timing/baseline_rollout_s" in r
        assert "actor/tis_ratio_mean" in r  # the rollout correction sees the version gap


def test_resume_regenerates_the_queued_batch_from_the_saved_loader_position(tmp_path, tiny_assets):
    model, data = tiny_assets
    per_epoch = pq.read_metadata(data).num_rows // 16  # batches of 16 prompts, the partial one dropped

    def loader_after(draws: int) -> dict:
        return {"epoch": (draws - 1) // per_epoch, "position": ((draws - 1) % per_epoch + 1) * 16}

    run_dir = tmp_path / "run"
    common = ["trainer.off_policy_steps=1", "trainer.save_every=2"]
    _train("yaml_configs/quickstart_cpu.yaml", run_dir, model, data, "trainer.total_steps=4", *common)
    # After step 4 the producer has drawn batch 5 too; the checkpoint keeps the position before it.
    controller = json.loads((run_dir / "checkpoints" / step_dir_name(4) / CONTROLLER).read_text())
    assert loader_after(5) != loader_after(4)
    assert controller["loader"] == loader_after(4)
    resumed = _train("yaml_configs/quickstart_cpu.yaml", run_dir, model, data, "trainer.total_steps=6", *common)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    # Batch 5 is regenerated by the restored weights (version 4): lag 0, then one step ahead again.
    assert [r["rollout/weight_version"] for r in resumed[4:]] == [4.0, 4.0]
    assert [r["rollout/staleness_max"] for r in resumed[4:]] == [0.0, 1.0]
