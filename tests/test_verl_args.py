"""``rlx show JOB --verl key=value ...``: every verl key launch/verl_args.py maps goes through the real
command line, and both the printed mapping and the resolved spec it prints hold the expected rlx
values; keys that cannot be mapped are named together before anything starts. No Ray."""
from __future__ import annotations

import pytest
import yaml

from launch import cli, verl_args
from launch.verl_args import AR, parse_value, translate
from rlcore.config import TrainerConfig
from rlcore.job import ConfigError
from rlcore.validate import validate

SPEC = "yaml_configs/quickstart_cpu.yaml"
HAS_LOGGER = any(f == "logger" for f in TrainerConfig.__dataclass_fields__)

# (verl overrides, the rlx values they must give). Each group is one command line; together they
# cover every key verl_args reads (test_every_mapped_key_is_covered).
GROUPS = [
    ([f"{AR}.model.path=.cache/tiny-qwen2", "algorithm.adv_estimator=grpo", "data.train_files=[a.parquet,b.parquet]",
      "data.val_files=c.parquet", "data.train_batch_size=16", "data.max_prompt_length=128",
      "data.max_response_length=64", "data.prompt_key=question", "data.shuffle=False", "data.truncation=error",
      "data.val_batch_size=7", "data.return_raw_chat=True", "data.filter_overlong_prompts=True",
      f"{AR}.actor.ppo_mini_batch_size=4", f"{AR}.actor.ppo_micro_batch_size_per_gpu=2", f"{AR}.actor.ppo_epochs=2",
      f"{AR}.actor.optim.lr=2e-6", f"{AR}.actor.optim.lr_warmup_steps=3", f"{AR}.actor.optim.warmup_style=cosine",
      f"{AR}.actor.optim.min_lr_ratio=0.1", f"{AR}.actor.optim.weight_decay=0.01", f"{AR}.actor.optim.clip_grad=0.5",
      f"{AR}.actor.optim.lr_warmup_init=1e-7", f"{AR}.actor.optim.lr_decay_steps=40",
      f"{AR}.actor.optim.use_checkpoint_opt_param_scheduler=True",
      f"{AR}.actor.use_kl_loss=True", f"{AR}.actor.kl_loss_coef=0.01", f"{AR}.actor.kl_loss_type=low_var_kl",
      f"{AR}.actor.entropy_coeff=0.001", f"{AR}.actor.clip_ratio=0.25", f"{AR}.actor.clip_ratio_low=null",
      f"{AR}.actor.clip_ratio_high=0.28",
      f"{AR}.actor.clip_ratio_c=4.0", f"{AR}.actor.loss_agg_mode=seq-mean-token-mean",
      f"{AR}.actor.megatron.tensor_model_parallel_size=1", f"{AR}.actor.megatron.pipeline_model_parallel_size=2",
      f"{AR}.actor.megatron.virtual_pipeline_model_parallel_size=null",
      f"{AR}.actor.megatron.use_distributed_optimizer=True", f"{AR}.actor.megatron.param_offload=True",
      f"{AR}.actor.megatron.grad_offload=True", f"{AR}.actor.megatron.optimizer_offload=True",
      f"{AR}.ref.megatron.tensor_model_parallel_size=1", f"{AR}.ref.megatron.pipeline_model_parallel_size=1",
      f"{AR}.ref.megatron.virtual_pipeline_model_parallel_size=1", f"{AR}.ref.megatron.param_offload=False",
      f"{AR}.ref.log_prob_micro_batch_size_per_gpu=8", f"{AR}.model.use_remove_padding=True",
      f"{AR}.model.enable_gradient_checkpointing=True", f"{AR}.rollout.log_prob_micro_batch_size_per_gpu=4",
      f"{AR}.rollout.n=4", f"{AR}.rollout.temperature=0.9", f"{AR}.rollout.top_p=0.95", f"{AR}.rollout.top_k=50",
      f"{AR}.rollout.tensor_model_parallel_size=2", f"{AR}.rollout.gpu_memory_utilization=0.5",
      f"{AR}.rollout.enforce_eager=False", f"{AR}.rollout.name=vllm", f"{AR}.rollout.mode=sync",
      "algorithm.use_kl_in_reward=True", "algorithm.kl_penalty=kl", "algorithm.kl_ctrl.type=adaptive",
      "algorithm.kl_ctrl.kl_coef=0.002", "algorithm.kl_ctrl.target_kl=0.05", "algorithm.kl_ctrl.horizon=500",
      "algorithm.gamma=0.99", "algorithm.lam=0.95", "algorithm.norm_adv_by_std_in_grpo=False",
      "algorithm.filter_groups.enable=True", "algorithm.filter_groups.max_num_gen_batches=5",
      "reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=16",
      "reward_model.overlong_buffer.penalty_factor=0.5",
      "custom_reward_function.path=my_reward.py", "custom_reward_function.name=score",
      "trainer.n_gpus_per_node=4", "trainer.nnodes=2", "trainer.total_training_steps=20", "trainer.save_freq=-1",
      "trainer.test_freq=5", "trainer.default_local_dir=/ckpt/run1", "trainer.max_actor_ckpt_to_keep=null",
      "trainer.resume_mode=disable", "trainer.val_before_train=True", "trainer.critic_warmup=0",
      "trainer.device=cuda"],
     {"model.path": ".cache/tiny-qwen2", "algorithm.adv_estimator": "grpo",
      "data.train_files": ["a.parquet", "b.parquet"], "data.val_files": ["c.parquet"], "data.batch_size": 16,
      "data.max_prompt_length": 128, "rollout.max_response_length": 64, "data.prompt_key": "question",
      "data.shuffle": False, "actor.ppo_mini_batch_size": 4, "actor.micro_batch_size": 2, "actor.ppo_epochs": 2,
      "actor.optim.lr": 2e-6,
      # 16 / 4 mini-batches x 2 epochs = 8 optimizer steps a training step
      "actor.optim.lr_warmup_steps": 24, "actor.optim.lr_decay_style": "cosine", "actor.optim.min_lr": 2e-7,
      "actor.optim.weight_decay": 0.01, "actor.optim.clip_grad": 0.5, "actor.optim.lr_warmup_init": 1e-7,
      "actor.optim.lr_decay_steps": 320, "actor.optim.lr_schedule_from_checkpoint": True,
      "actor.loss.kl_coeff": 0.01, "actor.loss.kl_estimator": "k3", "actor.loss.entropy_coeff": 0.001,
      "actor.loss.clip_ratio_low": 0.25, "actor.loss.clip_ratio_high": 0.28, "actor.loss.clip_ratio_c": 4.0,
      "actor.loss.policy_loss": "dual_clip", "actor.loss_agg_mode": "seq-mean-token-mean", "actor.tp": 1,
      "actor.pp": 2, "actor.vpp": 1, "actor.optim.use_distributed_optimizer": True, "reference.tp": 1,
      "reference.pp": 1, "reference.vpp": 1, "reference.micro_batch_size": 8, "rollout.n": 4,
      "rollout.temperature": 0.9, "rollout.top_p": 0.95, "rollout.top_k": 50, "rollout.tp": 2,
      "rollout.gpu_memory_utilization": 0.5, "rollout.enforce_eager": False, "algorithm.kl_in_reward": True,
      "algorithm.kl_penalty": "k1", "algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.kl_coef": 0.002,
      "algorithm.kl_ctrl.target_kl": 0.05, "algorithm.kl_ctrl.horizon": 500, "algorithm.gamma": 0.99,
      "algorithm.lam": 0.95, "algorithm.norm_adv_by_std": False, "algorithm.dynamic_sampling.enable": True,
      "algorithm.dynamic_sampling.max_gen_batches": 5, "algorithm.overlong_buffer.enable": True,
      "algorithm.overlong_buffer.len": 16, "algorithm.overlong_buffer.penalty_factor": 0.5,
      "reward.function": "my_reward.py:score",
      # 8 GPUs in two pools of 4; engines = 4 / rollout tp 2
      "resources.pools": {"actor": 4, "rollout": 4}, "rollout.engines": 2, "resources.gpus_per_node": 4,
      "resources.nodes": 2, "actor.pool": "actor", "rollout.pool": "rollout", "critic.pool": "actor",
      "reference.pool": "actor", "trainer.total_steps": 20, "trainer.save_every": 0, "trainer.val_every": 5,
      "trainer.checkpoint_dir": "/ckpt/run1", "trainer.keep_last": 0, "trainer.resume": "never",
      "resources.device": "gpu"}),
    # The critic, the other policy losses, a warm-up ratio, token budgets, resume from a path.
    (["algorithm.adv_estimator=gae", "data.train_batch_size=8", "critic.model.path=/models/critic",
      "critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size_per_gpu=4", "critic.ppo_epochs=3",
      "critic.cliprange_value=0.2", "critic.loss_agg_mode=token-mean", "critic.megatron.tensor_model_parallel_size=2",
      "critic.megatron.pipeline_model_parallel_size=1", "critic.megatron.virtual_pipeline_model_parallel_size=1",
      "critic.megatron.param_offload=True", "critic.optim.lr=1e-5", "critic.optim.lr_warmup_steps=-1",
      "critic.optim.lr_warmup_steps_ratio=0.1", "critic.optim.lr_decay_style=linear", "critic.optim.min_lr=1e-6",
      "critic.optim.lr_decay_steps=null", "critic.optim.weight_decay=0.0", "critic.optim.clip_grad=2.0",
      "critic.optim.lr_warmup_init=0.0", "critic.optim.lr_scheduler_type=constant",
      "critic.optim.use_checkpoint_opt_param_scheduler=False", "critic.optim.warmup_style=cosine",
      "critic.optim.min_lr_ratio=0.5",
      f"{AR}.actor.policy_loss.loss_mode=geo_mean", f"{AR}.actor.policy_loss.clip_cov_ratio=0.001",
      f"{AR}.actor.policy_loss.clip_cov_lb=0.5", f"{AR}.actor.policy_loss.clip_cov_ub=4.0",
      f"{AR}.actor.policy_loss.kl_cov_ratio=0.002", f"{AR}.actor.policy_loss.ppo_kl_coef=0.2",
      f"{AR}.actor.clip_ratio_low=0.3", f"{AR}.actor.kl_loss_coef=0.5",
      f"{AR}.actor.optim.lr_warmup_steps_ratio=0.25", f"{AR}.actor.optim.lr_decay_style=linear",
      f"{AR}.actor.optim.lr_scheduler_type=cosine", f"{AR}.actor.optim.min_lr=1e-8",
      f"{AR}.actor.use_dynamic_bsz=True", f"{AR}.actor.ppo_max_token_len_per_gpu=4096",
      f"{AR}.rollout.response_length=96", "trainer.resume_mode=resume_path", "trainer.resume_from_path=/ckpt/step_4",
      "trainer.max_actor_ckpt_to_keep=2", "trainer.save_freq=10", "trainer.test_freq=-1"],
     {"algorithm.adv_estimator": "gae", "critic.model_path": "/models/critic", "critic.ppo_mini_batch_size": 2,
      "critic.micro_batch_size": 4, "critic.ppo_epochs": 3, "critic.loss.cliprange_value": 0.2,
      "critic.loss_agg_mode": "token-mean", "critic.tp": 2, "critic.pp": 1, "critic.vpp": 1, "critic.optim.lr": 1e-5,
      "critic.optim.lr_warmup_steps": None, "critic.optim.lr_warmup_ratio": 0.1,
      "critic.optim.lr_decay_style": "cosine", "critic.optim.min_lr": 5e-6, "critic.optim.lr_decay_steps": None,
      "critic.optim.weight_decay": 0.0, "critic.optim.clip_grad": 2.0, "critic.optim.lr_warmup_init": 0.0,
      "critic.optim.lr_schedule_from_checkpoint": False,
      "actor.loss.policy_loss": "gmpo", "actor.loss.clip_cov_ratio": 0.001, "actor.loss.clip_cov_lb": 0.5,
      "actor.loss.clip_cov_ub": 4.0, "actor.loss.kl_cov_ratio": 0.002, "actor.loss.kl_cov_coef": 0.2,
      "actor.loss.clip_ratio_low": 0.3,
      "actor.loss.kl_coeff": 0.0,  # kl_loss_coef without use_kl_loss=True: verl has no KL loss
      "actor.optim.lr_warmup_ratio": 0.25, "actor.optim.lr_decay_style": "cosine", "actor.optim.min_lr": 1e-8,
      "actor.max_tokens_per_micro_batch": 4096, "rollout.max_response_length": 96,
      "trainer.resume": "/ckpt/step_4", "trainer.keep_last": 2, "trainer.save_every": 10, "trainer.val_every": 0}),
]


def _dig(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def _show(capsys, *verl: str) -> tuple[dict[str, str], dict]:
    """``rlx show SPEC --verl ...``: the printed mapping (verl key -> its line) and the resolved spec."""
    assert cli.main(["show", SPEC, "--verl", *verl]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "verl key -> rlx key(s)"
    mapping_lines = [line for line in lines[1:] if line.startswith("  ") and " -> " in line]
    spec = yaml.safe_load("\n".join(lines[1 + len(mapping_lines):]))
    mapping = {line.strip().split(" -> ")[0].split("=")[0]: line for line in mapping_lines}
    return mapping, spec


@pytest.mark.parametrize("verl, expected", GROUPS, ids=["actor-rollout-trainer", "critic-losses-resume"])
def test_every_mapped_key_round_trips_through_show(capsys, verl, expected):
    mapping, spec = _show(capsys, *verl)
    for item in verl:
        assert item.split("=")[0] in mapping, f"{item} is not in the printed mapping"
    for key, value in expected.items():
        assert _dig(spec, key) == (pytest.approx(value) if isinstance(value, float) else value), key
    cfg, _ = translate(SPEC, verl)
    for key, value in expected.items():
        got = cfg
        for part in key.split("."):
            got = got[part] if isinstance(got, dict) else getattr(got, part)
        assert got == (pytest.approx(value) if isinstance(value, float) else value), key


def test_the_printed_mapping_names_the_rlx_keys_and_the_translations(capsys):
    mapping, _ = _show(capsys, f"{AR}.actor.optim.lr_warmup_steps=3", "data.train_batch_size=16",
                       f"{AR}.actor.ppo_mini_batch_size=4", f"{AR}.actor.policy_loss.loss_mode=vanilla")
    assert "-> actor.optim.lr_warmup_steps=12  # verl counts training steps; x4 optimizer steps" in \
        mapping[f"{AR}.actor.optim.lr_warmup_steps"]
    assert '-> actor.loss.policy_loss="dual_clip"  # verl\'s vanilla has the dual clip built in' in \
        mapping[f"{AR}.actor.policy_loss.loss_mode"]
    assert "actor.loss.kl_coeff=0.0" in mapping["(verl defaults)"]  # no use_kl_loss: no KL loss


def test_total_epochs_counts_the_dataset(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join('{"prompt": [{"role": "user", "content": "1+1?"}], "ground_truth": "2"}\n'
                            for _ in range(10)))
    cfg, rows = translate(SPEC, [f"data.train_files=[{data}]", "data.train_batch_size=4", "trainer.total_epochs=3"])
    assert cfg.trainer.total_steps == 3 * (10 // 4)  # verl drops the last partial batch of an epoch
    assert "10 prompts // 4 a step x 3 epochs" in next(r.note for r in rows if r.verl_key == "trainer.total_epochs")
    cfg, _ = translate(SPEC, ["trainer.total_epochs=3", "trainer.total_training_steps=7"])
    assert cfg.trainer.total_steps == 7  # as in verl, total_training_steps wins
    with pytest.raises(ConfigError, match=r"trainer.total_epochs=3 \(the steps need the dataset's size"):
        translate(SPEC, ["data.train_files=[/no/such.parquet]", "trainer.total_epochs=3"])


def test_unmappable_keys_are_named_together_before_anything_starts(capsys):
    code = cli.main(["train", SPEC, "--verl", "trainer.nnodes=1",
                     "actor_rollout_ref.actor.fsdp_config.param_offload=True",
                     "algorithm.kl_penalty=full", "trainer.critic_warmup=5", f"{AR}.rollout.name=sglang"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("rlx train: --verl: 4 verl key(s) have no rlx mapping: ")
    for named in ("actor_rollout_ref.actor.fsdp_config.param_offload=True (no rlx counterpart)",
                  "algorithm.kl_penalty='full' (kl_penalty 'full' has no rlx counterpart",
                  "trainer.critic_warmup=5", f"{AR}.rollout.name='sglang'"):
        assert named in err


def test_resume_from_path_counts_only_with_resume_path():
    cfg, _ = translate(SPEC, ["trainer.resume_mode=auto", "trainer.resume_from_path=/ckpt/step_4"])
    assert cfg.trainer.resume == "auto"  # verl's auto looks in default_local_dir, whatever the path says


def test_odd_gpu_counts_cannot_split_into_two_pools():
    with pytest.raises(ConfigError, match=r"trainer.n_gpus_per_node x trainer.nnodes=3 \(rlx splits"):
        translate(SPEC, ["trainer.n_gpus_per_node=3"])


def test_loggers_and_run_names():
    verl = ["trainer.logger=['console','wandb']", "trainer.project_name=proj", "trainer.experiment_name=exp1"]
    if HAS_LOGGER:
        cfg, _ = translate(SPEC, verl)
        assert (cfg.trainer.logger, cfg.trainer.project_name, cfg.trainer.experiment_name) == \
            (["console", "wandb"], "proj", "exp1")
    else:  # before trainer.logger exists, these are named as unmappable
        with pytest.raises(ConfigError, match="trainer.logger=.*trainer.project_name=.*trainer.experiment_name="):
            translate(SPEC, verl)


def test_a_translated_quickstart_validates(tiny_assets):
    model, data = tiny_assets  # a clean clone has no .cache: the spec's model and data are built here
    cfg, _ = translate(SPEC, [f"{AR}.model.path={model}", f"data.train_files=['{data}']", f"data.val_files=['{data}']",
                              "data.train_batch_size=4", f"{AR}.rollout.n=4", f"{AR}.actor.ppo_mini_batch_size=2",
                              f"{AR}.actor.optim.lr_warmup_steps=1", f"{AR}.actor.optim.lr_decay_style=cosine",
                              f"{AR}.actor.ppo_micro_batch_size_per_gpu=4", "trainer.total_training_steps=2"])
    validate(cfg, require_files=False)
    assert cfg.actor.optim.lr_warmup_steps == 2  # 2 mini-batches a step


def test_hydra_values():
    assert parse_value("['a', 'b']") == ["a", "b"]
    assert parse_value("1e-6") == 1e-6 and parse_value("True") is True and parse_value("null") is None
    assert parse_value("'error'") == "error" and parse_value("256") == 256 and parse_value("[]") == []


def test_every_mapped_key_is_covered():
    covered = {item.split("=")[0] for verl, _ in GROUPS for item in verl}
    covered |= {"trainer.total_epochs", "trainer.logger", "trainer.project_name", "trainer.experiment_name"}
    assert set(verl_args.mapped_keys()) - covered == set()



def test_submit_verl_submits_the_translated_spec(tmp_path, capsys, tiny_assets):
    """--dry-run: the script runs `rlx train` on the translated spec, which loads back as the same job."""
    from omegaconf import OmegaConf

    from rlcore.job import load_job

    model, data = tiny_assets
    base = OmegaConf.load(SPEC)
    base.trainer.run_dir = str(tmp_path / "run")
    base.model.path, base.data.train_files, base.data.val_files = model, [data], [data]
    OmegaConf.save(base, tmp_path / "base.yaml")
    verl = [f"{AR}.rollout.n=4", "data.train_batch_size=4", f"{AR}.actor.ppo_micro_batch_size_per_gpu=4",
            f"{AR}.actor.optim.lr_warmup_steps=1"]
    code = cli.main(["submit", str(tmp_path / "base.yaml"), "--nodes", "1", "--gpus-per-node", "3",
                     "--log-dir", str(tmp_path / "slurm"), "--dry-run", "--verl", *verl])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, captured.err
    spec_path = str(tmp_path / "run" / "verl_job.yaml")
    assert f"the translated spec: {spec_path}" in out
    script = next((tmp_path / "slurm").glob("*.sbatch")).read_text()
    job_args = next(line for line in script.splitlines() if line.startswith("[ $# -eq 0 ] && set --"))
    assert spec_path in job_args and "rollout.n" not in job_args  # the resolved spec, no verl keys
    assert load_job(spec_path, []) == translate(str(tmp_path / "base.yaml"), verl)[0]
