"""Pipelined phases (trainer.off_policy_steps) through `rlx train` on the real stack: the quickstart
learns with generation one step ahead, DAPO's dynamic sampling and ReMax's baseline rollouts run in
the producer with validation in between, and a run resumed from a checkpoint (which keeps the batch
queued ahead) equals the uninterrupted run.
The schedule itself (which version makes which batch, syncs never next to a generation) is
tests/test_rollout_queue.py's, without Ray."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from tests.runs import ONE_RANK, train_cli
from rlcore.checkpoint import CONTROLLER, QUEUED, step_dir_name
from rlcore.metrics import is_measurement

pytestmark = pytest.mark.e2e


def _train(spec: str, run_dir, model: str, data: str, *overrides: str) -> list[dict]:
    return train_cli(spec, run_dir, model, data, "trainer.logger=[console,jsonl]", *ONE_RANK, *overrides)


def untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if not is_measurement(k)}


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


SPEC = "yaml_configs/quickstart_cpu.yaml"
STEPS = 30
SAVED = 15  # the one-step-ahead run also saves here (and at its end): the resume test's checkpoint


@pytest.fixture(scope="module")
def ahead_run(tmp_path_factory, tiny_assets):
    """STEPS quickstart steps at off_policy_steps=1, saving after step SAVED: (run_dir, metrics lines)."""
    run_dir = tmp_path_factory.mktemp("ahead") / "run"
    return run_dir, _train("yaml_configs/quickstart_cpu.yaml", run_dir, *tiny_assets, f"trainer.total_steps={STEPS}",
                           "trainer.off_policy_steps=1", f"trainer.save_every={SAVED}")


# The synchronous run of the same spec and overrides (ONE_RANK, STEPS steps, seed 1), measured on a 2-core
# AVX2 box (2026-12-02): mean reward 0.0781, 0.0859, 0.0977, 0.1055, 0.125 over steps 1-5 and 0.375, 0.4414,
# 0.4414, 0.418, 0.4609 over steps 26-30, a gain of 0.329 (45 s of wall time, which this test no longer spends
# on running it again; its steps 1-5 are also the README quickstart table's, TP2). Staleness 0 in a
# synchronous run is tests/test_e2e.py's and tests/test_rollout_queue.py's.
SYNC_REWARD_GAIN = 0.329


def test_one_step_off_policy_quickstart_learns_like_the_synchronous_run(ahead_run):
    _, ahead = ahead_run
    assert [r["step"] for r in ahead] == list(range(1, STEPS + 1))
    # Every trajectory lags the weights it is trained from by at most one version: step k's batch was
    # sampled by version k-2 (step 1's by the start weights), and the update starts from version k-1.
    assert [r["rollout/staleness_max"] for r in ahead] == [0.0] + [1.0] * (STEPS - 1)
    assert [r["rollout/weight_version"] for r in ahead] == [float(max(0, k - 2)) for k in range(1, STEPS + 1)]
    # Learns: the reward rises from the first five steps to the last five by at least half as much as in
    # the synchronous run (SYNC_REWARD_GAIN).
    gain = _mean(ahead[-5:], "reward/mean") - _mean(ahead[:5], "reward/mean")
    assert gain > 0.5 * SYNC_REWARD_GAIN, gain


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


def test_resume_trains_on_the_saved_queued_batch_and_equals_the_uninterrupted_run(tmp_path, tiny_assets, ahead_run):
    model, data = tiny_assets
    per_epoch = pq.read_metadata(data).num_rows // 16  # batches of 16 prompts, the partial one dropped

    def loader_after(draws: int) -> dict:
        return {"epoch": (draws - 1) // per_epoch, "position": ((draws - 1) % per_epoch + 1) * 16}

    run_dir, uninterrupted = ahead_run
    saved = run_dir / "checkpoints" / step_dir_name(SAVED)
    # After step SAVED the producer has sampled batch SAVED + 1 too (by version SAVED - 1): the checkpoint
    # keeps it, and the loader position after it.
    controller = json.loads((saved / CONTROLLER).read_text())
    assert loader_after(SAVED + 1) != loader_after(SAVED)
    assert controller["queued_batches"] == [{"batch": SAVED + 1, "loader_before": loader_after(SAVED)}]
    assert controller["loader"] == loader_after(SAVED + 1) and (saved / QUEUED).is_file()
    resumed = _train(SPEC, tmp_path / "resumed", model, data, f"trainer.total_steps={SAVED + 2}",
                     "trainer.off_policy_steps=1", f"trainer.resume={saved}")
    # Step SAVED + 1 trains on the saved batch, step SAVED + 2 on the one sampled on the restored weights
    # (version SAVED) while it trained: every non-timing metric equals the uninterrupted run's, bitwise.
    want = {r["step"]: untimed(r) for r in uninterrupted}
    assert {r["step"]: untimed(r) for r in resumed} == {step: want[step] for step in (SAVED + 1, SAVED + 2)}
    assert [r["rollout/weight_version"] for r in resumed] == [float(SAVED - 1), float(SAVED)]
