"""End to end on the real stack: a Megatron actor group, a vLLM engine, weight resharding, the loop.

What is where (to keep the suite's start-ups few):
- Weight sync after a real update for the tied-embedding PP2 actor (the last stage's lm_head copy
  must follow the first stage's embedding) is tests/test_rollout_weight_sync.py's last test, on that
  module's engines. TP2 and DP2 actors syncing to one, two and TP2 engines are
  tests/test_layout_matrix.py's; a TP2 actor trained and synced every step is the quickstart run
  below (rollout/logprob_diff_max of steps 2-3, sampled from synced weights); that DP2 updates equal
  one process's is tests/test_megatron_layouts.py's.
- One `rlx train` of the quickstart spec serves the run's metrics (steps 1-2, validation, TensorBoard),
  the failure path (its reward function raises in step 3, so the run ends with exit 1 and one line,
  with the finished steps on disk) and what a failed run leaves behind: no process (tests/procs.py)
  and no multiprocessing helper of megatron's checkpoint writer. Runs that end with exit 0 are
  test_algorithms_e2e's, test_checkpoint's and test_slurm's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.procs import ProcessWatch, assert_none_left

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.e2e


def test_quickstart_steps_end_to_end_until_the_reward_function_raises(tmp_path, tiny_assets):
    """`rlx train` on the quickstart spec, its verifier wrapped so that it crashes in step 3.
    Steps 1-2: every metric is there, the first update is on-policy (ratio 1, ppo_kl 0), the engine
    agrees with the trainer, validation ran at steps 0 and 2, TensorBoard files exist. Step 3: the run
    exits 1 with one line naming the step, the function, the dataset row and the cause, the finished
    steps stay in metrics.jsonl, and none of its processes is left (tests/procs.py)."""
    import pyarrow.parquet as pq

    model, data = tiny_assets
    val_rows = pq.read_metadata(data).num_rows
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(
        "from rlcore.reward import numeric_verifier  # the quickstart's own verifier\n"
        "# Validation at step 0 and 2 (one greedy sample per row), steps 1 and 2 (16 prompts x 16 samples).\n"
        f"CALLS_BEFORE_STEP_3 = 2 * {val_rows} + 2 * 16 * 16\n"
        "calls = 0\n"
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls > CALLS_BEFORE_STEP_3:\n"
        "        raise ValueError('verifier crashed on purpose')\n"
        "    return numeric_verifier(data_source, solution_str, ground_truth, extra_info)\n")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "launch.cli", "train", "yaml_configs/quickstart_cpu.yaml",
           f"model.path={model}", f"data.train_files=[{data}]", f"data.val_files=[{data}]",
           f"reward.function={reward_file}:score", f"trainer.run_dir={run_dir}", "trainer.total_steps=3",
           "trainer.val_every=2", "trainer.save_every=1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watch = ProcessWatch(proc.pid)
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 1, stdout[-3000:] + stderr[-6000:]
    # No process outlives the failed run, and megatron's checkpoint writer (it ran after steps 1 and 2
    # in every rank) started no long-lived multiprocessing helper (a Manager, a resource tracker).
    assert (run_dir / "checkpoints" / "step_00000002").is_dir()
    assert_none_left(watch, stdout + stderr)
    helpers = [c for _, c in watch.seen.values() if "multiprocessing" in c]
    assert helpers == [], helpers
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("rlx train: step 3: reward function"), last
    assert "my_reward.py:score" in last and "dataset row" in last
    assert "raised ValueError: verifier crashed on purpose" in last

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]  # step 3 never logged
    assert (run_dir / "report.png").stat().st_size > 0  # the end-of-run report, drawn after the failure too
    train = lines[1:]
    required = ["reward/mean", "response_length/mean", "actor/pg_loss", "actor/ppo_kl", "actor/clip_frac",
                "actor/entropy", "actor/kl_ref", "actor/grad_norm", "rollout/logprob_diff_max",
                "weights/version", "timing/rollout_s", "timing/reward_s", "timing/logprob_s",
                "timing/update_s", "timing/weight_sync_s", "timing/step_s", "weight_sync/load_s",
                "weight_sync/recv_wait_s", "weight_sync/pack_s", "weight_sync/send_wait_s",
                "weight_sync/recv_page_faults"]
    for key in required:
        assert key in train[0], f"metrics.jsonl lacks {key}"
    assert abs(train[0]["actor/ppo_kl"]) < 1e-6
    assert all(0 < x["weight_sync/load_s"] <= x["timing/weight_sync_s"] for x in train)
    assert train[0]["actor/clip_frac"] == 0.0
    assert [x["weights/version"] for x in train] == [1.0, 2.0]
    assert [x["rollout/weight_version"] for x in train] == [0.0, 1.0]  # step 2 sampled from step 1's sync
    assert [x["rollout/staleness_max"] for x in train] == [0.0, 0.0]  # synchronous: no trajectory lags
    assert all(x["rollout/logprob_diff_max"] <= 1e-3 for x in train)  # step 2 sampled from synced weights
    assert "val/reward_mean" in lines[0] and "val/reward_mean" in lines[2]
    assert list((run_dir / "tensorboard").iterdir()), "no TensorBoard event files"
