"""End to end on the real stack: a Megatron actor group, a vLLM engine, weight resharding, the loop.

What is where (to keep the suite's start-ups few):
- Weight sync after a real update, here for the tied-embedding PP2 actor only (the last stage's
  lm_head copy must follow the first stage's embedding). TP2 and DP2 actors syncing to one, two and
  TP2 engines are tests/test_layout_matrix.py's; a TP2 actor trained and synced every step is the
  quickstart run below (rollout/logprob_diff_max of steps 2-3, sampled from synced weights);
  that DP2 updates equal one process's is tests/test_megatron_layouts.py's.
- One `rlx train` of the quickstart spec serves both the run's metrics (steps 1-2, validation, TensorBoard)
  and the failure path: its reward function raises in step 3, so the run ends with exit 1 and one
  line, with the finished steps on disk. Runs that end with exit 0 are test_algorithms_e2e's,
  test_checkpoint's and test_slurm's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from launch.assets import make_addition_data, make_tiny_model
from rlcore.algos import LossConfig, loss_weights
from rlcore.batch import Batch
from rlcore.config import OptimConfig, RolloutConfig
from rlcore.weight_sync import checksum, connect_weight_sync, sync_weights

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def split_pools(ray_pools):
    """The quickstart's shape: a 2-GPU actor pool and a 1-GPU rollout pool (logical GPUs)."""
    return ray_pools({"actor": 2, "rollout": 1}, {"actor": "actor", "rollout": "rollout"})


def _fixed_batch(vocab: int, n: int = 8, seq: int = 12, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, vocab, (n, seq), generator=g)
    response_mask = torch.zeros(n, seq)
    response_mask[:, 5:] = 1.0
    return Batch(input_ids=input_ids, attention_mask=torch.ones(n, seq, dtype=torch.long),
                 response_mask=response_mask)


def test_weight_sync_makes_vllm_match_the_trained_tied_pp2_actor(split_pools, tmp_path):
    from megatron_workers import MegatronGroup
    from rlcore.roles import RoleSpec
    from rollout import RolloutPool

    model = make_tiny_model(str(tmp_path / "model"), tie_word_embeddings=True, seed=3)
    pools = split_pools
    actor = MegatronGroup(RoleSpec("actor", model, tp=1, pp=2, dp=1, micro_batch_size=4, profile="cpu",
                                   dtype="float32", seed=0, optim=OptimConfig(lr=0.05, clip_grad=0.0)),
                          pools.placement("actor"))
    rollout = RolloutPool(model, RolloutConfig(kv_cache_gb=0.25, max_response_length=4),
                          pools.placement("rollout"), "cpu", "float32", seed=0)
    try:
        connect_weight_sync(actor, rollout, 1, bucket_bytes=256 * 1024, wire_dtype="float32")
        batch = _fixed_batch(vocab=16)
        seqs = batch["input_ids"].tolist()
        mask = torch.zeros_like(batch["response_mask"]).bool()
        mask[:, 1:] = True  # every position that has a prefix
        every_position = Batch(input_ids=batch["input_ids"])  # no response mask: every output is computed

        before = torch.tensor(rollout.prompt_logprobs(seqs))
        assert (before - actor.forward(every_position)["logprobs"])[mask].abs().max() < 1e-3, "same checkpoint must agree"

        # A large step so the new weights are far from the engine's.
        batch["old_logprobs"] = actor.forward(batch)["logprobs"]
        batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(1))
        batch["loss_weights"] = loss_weights(batch["response_mask"], "token-mean", norm_length=7)
        actor.update(batch, LossConfig(kl_coeff=0.0))
        trained = actor.forward(every_position)["logprobs"]
        stale = torch.tensor(rollout.prompt_logprobs(seqs))
        assert (stale - trained)[mask].abs().max() > 1e-2, "the update should move the log-probs"

        sync_weights(actor, rollout, version=1)
        synced = torch.tensor(rollout.prompt_logprobs(seqs))
        assert (synced - trained)[mask].abs().max() <= 1e-3
        # And the weights themselves: every HF tensor the engine holds equals the trainer's.
        expected = checksum(list(actor.hf_state_dict().items()))
        (engine_sums,) = rollout.weight_checksums()
        for name, value in expected.items():
            assert engine_sums[name] == pytest.approx(value, rel=1e-9, abs=1e-9), name
        trajs = rollout.generate([seqs[0][:5]], n=2, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=2)
        assert {t.weight_version for t in trajs} == {1}
    finally:
        rollout.shutdown()
        actor.shutdown()


def test_quickstart_steps_end_to_end_until_the_reward_function_raises(tmp_path):
    """`rlx train` on the quickstart spec, its verifier wrapped so that it crashes in step 3.
    Steps 1-2: every metric is there, the first update is on-policy (ratio 1, ppo_kl 0), the engine
    agrees with the trainer, validation ran at steps 0 and 2, TensorBoard files exist. Step 3: the run
    exits 1 with one line naming the step, the function, the dataset row and the cause, and the
    finished steps stay in metrics.jsonl."""
    import pyarrow.parquet as pq

    model = make_tiny_model(str(tmp_path / "model"))
    data = make_addition_data(str(tmp_path / "data"))
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
           "trainer.val_every=2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-6000:]
    last = proc.stderr.strip().splitlines()[-1]
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
                "timing/update_s", "timing/weight_sync_s", "timing/step_s"]
    for key in required:
        assert key in train[0], f"metrics.jsonl lacks {key}"
    assert abs(train[0]["actor/ppo_kl"]) < 1e-6
    assert train[0]["actor/clip_frac"] == 0.0
    assert [x["weights/version"] for x in train] == [1.0, 2.0]
    assert [x["rollout/weight_version"] for x in train] == [0.0, 1.0]  # step 2 sampled from step 1's sync
    assert all(x["rollout/logprob_diff_max"] <= 1e-3 for x in train)  # step 2 sampled from synced weights
    assert "val/reward_mean" in lines[0] and "val/reward_mean" in lines[2]
    assert list((run_dir / "tensorboard").iterdir()), "no TensorBoard event files"
