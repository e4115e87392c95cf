"""Every advantage estimator, policy loss, aggregation mode and rollout correction through the real
loop (Megatron actor + reference, vLLM engine), and the PPO and DAPO job specs end to end.

The variants and the dynamic-sampling failure share one in-process Trainer (one start-up); the PPO and
DAPO specs run as `rlx train`. That `rlx train` turns such a failure into exit 1 and one line is
tests/test_e2e.py's (a reward function that raises: the same handler)."""
from __future__ import annotations

import math

import pytest

from rlcore.job import load_job
from rlcore.validate import validate
from tests.runs import ONE_RANK, train_cli

pytestmark = pytest.mark.e2e


def _train(spec: str, tmp_path, model: str, data: str, *overrides: str) -> list[dict]:
    return train_cli(spec, tmp_path / "run", model, data, *overrides)


def test_ppo_quickstart_steps_train_the_critic(tmp_path, tiny_assets):
    """The PPO spec (GAE, critic on its own pool, KL in the reward) for two steps of 4 samples per
    prompt: the critic's metrics and timings are reported, and the engine still agrees with the actor."""
    steps = _train("yaml_configs/ppo_quickstart_cpu.yaml", tmp_path, *tiny_assets, "trainer.total_steps=2",
                   "rollout.n=4", "actor.micro_batch_size=32", "critic.micro_batch_size=32")
    assert [x["step"] for x in steps] == [1, 2]
    for key in ("critic/vf_loss", "critic/vf_explained_var", "critic/grad_norm", "critic/vf_clipfrac",
                "timing/values_s", "timing/critic_update_s", "actor/reward_kl_penalty", "actor/pg_loss"):
        assert all(math.isfinite(x[key]) for x in steps), key
    assert all(x["rollout/logprob_diff_max"] <= 1e-3 for x in steps)
    # Two mini-batches per step (ppo_mini_batch_size 8 of 16 prompts): the second is off-policy.
    assert steps[0]["actor/ppo_kl"] != 0.0


def test_dapo_spec_fills_the_batch_with_groups_that_carry_signal(tmp_path, tiny_assets):
    steps = _train("yaml_configs/dapo_quickstart_cpu.yaml", tmp_path, *tiny_assets, "trainer.total_steps=2", *ONE_RANK)
    for x in steps:
        assert 1 <= x["dynamic_sampling/gen_batches"] <= 8
        assert x["reward/overlong_penalty_mean"] <= 0.0
        # Only groups with both successes and failures are trained on: their GRPO advantages are not all 0.
        assert x["advantages/abs_mean"] > 0.1
        assert "actor/kl_ref" not in x  # kl_coeff 0: no reference model at all


@pytest.fixture(scope="module")
def quickstart_trainer(tiny_assets):
    """The quickstart spec, smaller (4 prompts x 4 samples, the actor on one rank: the subject is the
    losses, not the layout), as one in-process Trainer: each test changes its settings for a step and
    puts them back."""
    import ray

    from launch.compose import build_trainer

    model, data = tiny_assets
    cfg = load_job("yaml_configs/quickstart_cpu.yaml", [
        f"model.path={model}", f"data.train_files=[{data}]", "data.val_files=[]", "trainer.val_every=0",
        "trainer.logger=[console,jsonl]", "data.batch_size=4", "rollout.n=4", "actor.micro_batch_size=8", *ONE_RANK])
    trainer = None
    try:
        trainer = build_trainer(cfg, validate(cfg))
        yield trainer
    finally:
        if trainer is not None:
            trainer.shutdown()
        ray.shutdown()


def test_every_estimator_loss_and_agg_mode_runs_a_step(quickstart_trainer):
    """One real step per option, all on one Ray cluster: estimators (remax generates its greedy
    baseline), policy losses, aggregation modes, rollout corrections, the in-reward KL, the rollout's
    log-probs as the old ones, and several PPO epochs over mini-batches."""
    trainer = quickstart_trainer
    variants = [
        {"algorithm.adv_estimator": "drgrpo", "actor.loss_agg_mode": "seq-mean-token-sum-norm"},
        {"algorithm.adv_estimator": "rloo", "actor.loss_agg_mode": "seq-mean-token-mean"},
        {"algorithm.adv_estimator": "reinforce_plus_plus", "algorithm.kl_in_reward": True},
        {"algorithm.adv_estimator": "reinforce_plus_plus_baseline", "actor.loss_agg_mode": "seq-mean-token-sum"},
        {"algorithm.adv_estimator": "remax"},
        {"actor.loss.policy_loss": "dual_clip"},
        {"actor.loss.policy_loss": "gspo", "actor.loss.clip_ratio_low": 3e-4, "actor.loss.clip_ratio_high": 4e-4},
        {"actor.loss.policy_loss": "cispo", "actor.loss.clip_ratio_high": 2.0},
        {"actor.loss.policy_loss": "gmpo", "actor.loss.clip_ratio_low": 0.4, "actor.loss.clip_ratio_high": 0.4},
        {"actor.loss.policy_loss": "sapo"},
        {"actor.loss.policy_loss": "gpg"},
        {"actor.loss.policy_loss": "clip_cov"},
        {"actor.loss.policy_loss": "kl_cov"},
        {"actor.loss.rollout_correction": "tis"},
        {"actor.loss.rollout_correction": "icepop"},
        {"actor.loss.rollout_correction": "seq_mask"},
        {"actor.use_rollout_logprobs": True},
        {"actor.ppo_epochs": 2, "actor.ppo_mini_batch_size": 2},
    ]

    def put(cfg, key, value):
        *sections, name = key.split(".")
        for section in sections:
            cfg = getattr(cfg, section)
        setattr(cfg, name, value)

    def get(cfg, key):
        for part in key.split("."):
            cfg = getattr(cfg, part)
        return cfg

    first = trainer.version + 1
    for step, variant in enumerate(variants, start=first):
        for key, value in variant.items():
            put(trainer.cfg, key, value)
        if "algorithm.kl_in_reward" in variant:
            from rlcore.algos import kl_controller

            trainer.kl_ctrl = kl_controller("fixed", 0.01, 0.1, 1000)
        m = trainer.train_step(step)  # it reads the loss knobs from trainer.cfg every step
        assert all(math.isfinite(v) for v in m.values()), (variant, m)
        assert m["weights/version"] == step
        assert m["rollout/logprob_diff_max"] <= 1e-3, variant
        if "actor.loss.rollout_correction" in variant:
            assert "actor/tis_ratio_mean" in m
        if variant.get("algorithm.adv_estimator") == "remax":
            assert "reward/greedy_baseline_mean" in m
        if "algorithm.kl_in_reward" in variant:
            assert m["actor/reward_kl_coef"] == 0.01
        # Restore the quickstart's settings for the next variant.
        defaults = load_job("yaml_configs/quickstart_cpu.yaml", [])
        for key in variant:
            put(trainer.cfg, key, get(defaults, key))
        trainer.kl_ctrl = None


def test_dynamic_sampling_that_cannot_fill_a_batch_stops_with_one_line(quickstart_trainer):
    """A verifier that gives every sample the same score leaves no group with signal: after
    max_gen_batches rounds the step stops with one sentence naming the step, the key and what to
    change (the SamplingError `rlx train` prints as its last line, exit 1)."""
    from rlcore.trainer import SamplingError

    trainer = quickstart_trainer
    ds, reward_fn = trainer.cfg.algorithm.dynamic_sampling, trainer.reward_fn
    saved = ds.enable, ds.max_gen_batches
    assert not trainer.cfg.algorithm.overlong_buffer.enable  # its length penalty would make the scores differ
    ds.enable, ds.max_gen_batches = True, 2
    trainer.reward_fn = lambda data_source, solution_str, ground_truth, extra_info: 1.0
    step = trainer.version + 1
    try:
        with pytest.raises(SamplingError) as info:
            trainer.train_step(step)
    finally:
        (ds.enable, ds.max_gen_batches), trainer.reward_fn = saved, reward_fn
    message = str(info.value)
    assert message.startswith(f"step {step}: dynamic sampling kept 0 of the data.batch_size=4 prompts"), message
    assert "algorithm.dynamic_sampling.max_gen_batches=2" in message
    assert len(message.splitlines()) == 1
    assert trainer.version == step - 1  # nothing was trained or synced
