"""load_job and validate: a good spec resolves to its layout; every bad input is a ConfigError whose
message names the key (and the file) and what was expected."""
import json

import pytest
import torch

from rlcore.config import JobConfig
from rlcore.job import ConfigError, load_job
from rlcore.layout import RoleLayout, RolloutLayout
from rlcore.validate import JobLayout, validate

# A small Llama-shaped model: head_dim 64 (supported by the vLLM CPU kernel), 2 KV groups.
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "intermediate_size": 512,
    "vocab_size": 128,
    "max_position_embeddings": 1024,
}


def make_model(folder, **changes):
    folder.mkdir(parents=True, exist_ok=True)
    config = {**MODEL_CONFIG, **changes}
    config = {k: v for k, v in config.items() if v is not None}  # a None change removes the key
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.fixture
def files(tmp_path):
    """A valid model folder and data files; validate only checks that the files exist."""
    model = make_model(tmp_path / "model")
    train = tmp_path / "train.jsonl"
    train.write_text("{}\n")
    val = tmp_path / "val.parquet"
    val.write_bytes(b"")
    return {"model": model, "train": train, "val": val, "tmp": tmp_path}


def base_overrides(files):
    # Default pools: actor 2 GPUs, rollout 1. Batch: 8 prompts x 8 samples = 64 = 8 x (dp 2 x mbs 4).
    return [f"model.path={files['model']}", f"data.train_files=[{files['train']}]",
            f"data.val_files=[{files['val']}]", "resources.device=cpu"]


def job(files, *overrides) -> JobConfig:
    return load_job(None, base_overrides(files) + list(overrides))


def validate_error(files, *overrides) -> str:
    cfg = job(files, *overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    return str(info.value)


def load_error(path, *overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_job(str(path) if path is not None else None, list(overrides))
    return str(info.value)


def assert_in(message: str, *parts: str) -> None:
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


# ------------------------------------------------------------------------------------- load_job
def test_load_job_merges_file_then_overrides_into_a_real_jobconfig(files):
    spec = files["tmp"] / "job.yaml"
    spec.write_text(f"model:\n  path: {files['model']}\nactor:\n  tp: 2\n  micro_batch_size: 2\n"
                    "resources:\n  pools: {{actor: 4, rollout: 1}}\n".replace("{{", "{").replace("}}", "}"))
    cfg = load_job(str(spec), ["actor.tp=1", "data.train_files=[a.jsonl,b.parquet]"])
    assert isinstance(cfg, JobConfig)
    assert cfg.model.path == str(files["model"])
    assert cfg.actor.tp == 1  # the override wins over the file
    assert cfg.actor.micro_batch_size == 2  # from the file
    assert cfg.actor.pp == 1  # the schema default
    assert cfg.resources.pools == {"actor": 4, "rollout": 1}
    assert cfg.data.train_files == ["a.jsonl", "b.parquet"]


@pytest.mark.parametrize("old, new", [("actor.kl_coeff", "actor.loss.kl_coeff"),
                                      ("actor.clip_ratio_high", "actor.loss.clip_ratio_high"),
                                      ("actor.rollout_correction", "actor.loss.rollout_correction"),
                                      ("critic.cliprange_value", "critic.loss.cliprange_value")])
def test_keys_that_moved_into_a_loss_section_name_their_new_place(tmp_path, old, new):
    section, name = old.split(".")
    spec = tmp_path / "job.yaml"
    spec.write_text(f"model:\n  path: /m\n{section}:\n  tp: 1\n  {name}: 0.1\n")
    message = load_error(spec)
    assert message == f"job file {spec} (line 5): {old} moved to {new}"
    assert load_error(None, "model.path=/m", f"{old}=0.1") == f"override '{old}=0.1': {old} moved to {new}"


def test_the_loss_sections_are_the_loss_dataclasses():
    from rlcore.algos import CriticLossConfig, LossConfig

    cfg = load_job(None, ["model.path=/m", "actor.loss.clip_ratio_high=0.28"])
    assert type(cfg.actor.loss) is LossConfig and type(cfg.critic.loss) is CriticLossConfig
    assert cfg.actor.loss == LossConfig(clip_ratio_high=0.28)
    assert cfg.actor.loss.kl_coeff == 0.001  # one default, the user-facing one


def test_missing_job_file(tmp_path):
    assert_in(load_error(tmp_path / "nope.yaml"), "job file", "nope.yaml", "not found")


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("model:\n  path: /m\nactor:\n  tp: 2\n   pp: 3\n")
    assert_in(load_error(spec), "bad.yaml", "not valid YAML", "line 5")


def test_yaml_that_is_not_a_mapping(tmp_path):
    spec = tmp_path / "list.yaml"
    spec.write_text("- a\n- b\n")
    assert_in(load_error(spec), "list.yaml", "must be a mapping", "got a list")


def test_unknown_key_in_file_names_path_line_and_suggestion(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("model:\n  path: /m\nactor:\n  optim:\n    lrr: 0.1\n")
    assert_in(load_error(spec), "job.yaml", "line 5", "unknown key actor.optim.lrr", "Did you mean", "'lr'")


def test_unknown_key_in_override_names_the_override_and_suggestion():
    assert_in(load_error(None, "model.path=/m", "actor.tpp=2"),
              "override 'actor.tpp=2'", "unknown key actor.tpp", "Did you mean", "'tp'")
    assert_in(load_error(None, "modle.path=/m"), "unknown key modle", "'model'")


@pytest.mark.parametrize("override, expected", [
    ("actor.tp=abc", "actor.tp='abc' has the wrong type, expected an integer"),
    ("rollout.n=2.5", "rollout.n=2.5 has the wrong type, expected an integer"),
    ("actor.loss.kl_coeff=x", "actor.loss.kl_coeff='x' has the wrong type, expected a number"),
    ("data.shuffle=maybe", "data.shuffle='maybe' has the wrong type, expected a boolean"),
    ("data.train_files=a.jsonl", "data.train_files='a.jsonl' has the wrong type, expected a list of strings"),
    ("resources.pools.actor=two", "resources.pools.actor='two' has the wrong type, expected an integer"),
    ("actor=3", "actor=3 has the wrong type, expected a mapping (section ActorConfig)"),
])
def test_wrong_type_in_override_names_key_value_and_expected_type(override, expected):
    assert_in(load_error(None, "model.path=/m", override), f"override {override!r}", expected)


def test_wrong_type_in_file_names_file_and_line(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("model:\n  path: /m\nrollout:\n  n: many\n")
    assert_in(load_error(spec), "job.yaml (line 4)", "rollout.n='many'", "expected an integer")


def test_override_without_equals_sign():
    assert_in(load_error(None, "model.path=/m", "actor.tp"), "override 'actor.tp'", "key.sub=value")


def test_override_with_invalid_yaml_value():
    assert_in(load_error(None, "model.path=/m", "actor.tp=[1"), "override 'actor.tp=[1'", "not valid YAML")


def test_missing_mandatory_model_path():
    assert_in(load_error(None, "actor.tp=1"), "model.path is required but not set")


# ------------------------------------------------------------------------------------- validate
def test_valid_spec_resolves_the_layout(files):
    layout = validate(job(files))
    assert layout == JobLayout(
        actor=RoleLayout(pool="actor", gpus=2, tp=1, pp=1, dp=2),
        reference=RoleLayout(pool="actor", gpus=2, tp=1, pp=1, dp=2, host="actor"),  # the actor's, in its processes
        rollout=RolloutLayout(pool="rollout", gpus=1, engines=1, tp=1),
        device="cpu", total_gpus=3, dtype="float32")


def test_reference_only_when_kl_coeff_positive(files):
    # With no KL term the reference settings are not used, so they are not checked either.
    layout = validate(job(files, "actor.loss.kl_coeff=0", "reference.pool=nowhere"))
    assert layout.reference is None


def test_reference_layout_overrides(files):
    layout = validate(job(files, "resources.pools={actor: 2, ref: 4, rollout: 1}", "reference.pool=ref",
                          "reference.tp=2", "reference.micro_batch_size=2"))
    assert layout.reference == RoleLayout(pool="ref", gpus=4, tp=2, pp=1, dp=2)  # not the actor's: its own processes


def test_the_reference_goes_into_the_actor_processes_when_it_has_the_actors_layout(files):
    """reference.colocate: null (default) hosts it in the actor's ranks whenever its pool, tp, pp and
    vpp are the actor's; false never; true requires it, naming what differs."""
    assert validate(job(files, "reference.micro_batch_size=1")).reference.host == "actor"  # its own micro-batches
    assert validate(job(files, "reference.colocate=false")).reference.host is None
    assert validate(job(files, "reference.colocate=true")).reference.host == "actor"
    assert validate(job(files, "reference.tp=2")).reference.host is None
    assert_in(validate_error(files, "reference.colocate=true", "reference.tp=2"),
              "reference.colocate=true puts the reference in the actor's processes",
              "reference.tp=2 (actor.tp=1)", "set reference.colocate=false")
    with pytest.raises(ConfigError, match=r"reference.colocate='maybe' has the wrong type, expected a boolean"):
        job(files, "reference.colocate=maybe")


def test_device_auto_resolves_from_torch(files):
    layout = validate(job(files, "resources.device=auto"))
    assert layout.device == ("gpu" if torch.cuda.is_available() else "cpu")


def test_gpu_profile_allows_rollout_tp_and_any_head_dim(files):
    make_model(files["model"], hidden_size=4 * 48)  # head_dim 48: no CPU kernel for it
    layout = validate(job(files, "resources.device=gpu", "resources.pools={actor: 2, rollout: 4}",
                          "rollout.tp=2", "rollout.engines=2"))
    assert layout.rollout == RolloutLayout(pool="rollout", gpus=4, engines=2, tp=2)
    assert layout.device == "gpu"
    assert layout.dtype == "bfloat16"  # auto on the gpu profile


# model folder
def test_model_path_not_a_folder(files):
    assert_in(validate_error(files, f"model.path={files['tmp'] / 'missing'}"), "model.path=", "is not a folder")


def test_model_without_config_json(files):
    (files["model"] / "config.json").unlink()
    assert_in(validate_error(files), "model.path=", "has no config.json")


def test_model_without_safetensors(files):
    (files["model"] / "model.safetensors").unlink()
    assert_in(validate_error(files), "model.path=", "no *.safetensors")


def test_model_config_not_json(files):
    (files["model"] / "config.json").write_text("{not json")
    assert_in(validate_error(files), "config.json", "not valid JSON")


def test_model_config_missing_a_key(files):
    make_model(files["model"], num_hidden_layers=None)
    assert_in(validate_error(files), "config.json", "'num_hidden_layers'")


def test_model_hidden_size_not_a_multiple_of_heads(files):
    make_model(files["model"], hidden_size=258)
    assert_in(validate_error(files), "hidden_size=258", "num_attention_heads=4")


def test_model_dtype(files):
    assert_in(validate_error(files, "model.dtype=float16"), "model.dtype='float16'", "auto, float32, bfloat16")


def test_cpu_profile_runs_in_float32_only(files):
    assert_in(validate_error(files, "model.dtype=bfloat16"), "model.dtype='bfloat16'", "float32 only")
    assert validate(job(files, "model.dtype=float32")).dtype == "float32"


def test_resources_device(files):
    assert_in(validate_error(files, "resources.device=tpu"), "resources.device='tpu'", "auto, cpu, gpu")


def test_resources_host_malloc_reaches_every_megatron_role(files):
    from launch.compose import role_spec

    assert_in(validate_error(files, "resources.host_malloc=jemalloc"), "resources.host_malloc='jemalloc'",
              "glibc, keep")
    layout = validate(job(files))
    assert layout.host_malloc == "glibc"  # the default: glibc's own settings
    layout = validate(job(files, "resources.host_malloc=keep"))
    spec = role_spec("actor", layout.actor, layout, files["model"], 2, 1)
    assert layout.host_malloc == spec.host_malloc == "keep"


def test_resources_host_hugepages_reaches_every_megatron_role(files):
    from launch.compose import role_spec

    with pytest.raises(ConfigError) as refused:
        job(files, "resources.host_hugepages=sometimes")
    assert_in(str(refused.value), "resources.host_hugepages", "'sometimes'")
    layout = validate(job(files))
    assert layout.host_hugepages is False and role_spec("actor", layout.actor, layout, files["model"], 2, 1).host_hugepages is False
    layout = validate(job(files, "resources.host_hugepages=true"))
    assert role_spec("actor", layout.actor, layout, files["model"], 2, 1).host_hugepages is True


# pools and layouts
def test_role_pool_must_exist(files):
    assert_in(validate_error(files, "actor.pool=big"), "actor.pool='big'", "not a pool", "actor, rollout")
    assert_in(validate_error(files, "reference.pool=ref"), "reference.pool='ref'", "not a pool")
    assert_in(validate_error(files, "rollout.pool=gen"), "rollout.pool='gen'", "not a pool")


def test_pool_size_must_be_at_least_one(files):
    assert_in(validate_error(files, "resources.pools.actor=0"), "resources.pools.actor=0", ">= 1")


def test_actor_and_rollout_on_one_pool_is_not_supported(files):
    assert_in(validate_error(files, "actor.pool=rollout"),
              "colocating actor and rollout on one pool is not supported yet")


def test_actor_tp_pp_must_divide_pool(files):
    assert_in(validate_error(files, "resources.pools.actor=3", "actor.tp=2"),
              "actor.tp*actor.pp=2*1=2", "does not divide the 3 GPUs", "resources.pools.actor=3")


def test_actor_tp_must_divide_attention_heads(files):
    message = validate_error(files, "resources.pools.actor=3", "actor.tp=3", "data.batch_size=3",
                             "rollout.n=4")
    assert_in(message, "actor.tp=3 does not divide the model's 4 attention heads",
              "config.json: num_attention_heads")


def test_actor_tp_must_divide_kv_heads(files):
    make_model(files["model"], num_attention_heads=8, hidden_size=512, num_key_value_heads=2)
    assert_in(validate_error(files, "resources.pools.actor=4", "actor.tp=4"),
              "actor.tp=4 does not divide the model's 2 key-value heads", "num_key_value_heads")


def test_actor_tp_must_divide_intermediate_size(files):
    # Heads, KV heads and vocabulary divide by 2; the MLP's 510 columns would not split over TP=4.
    make_model(files["model"], num_attention_heads=8, hidden_size=512, num_key_value_heads=4, intermediate_size=510)
    assert_in(validate_error(files, "resources.pools.actor=4", "actor.tp=4"),
              "actor.tp=4 does not divide the model's intermediate_size=510", "config.json: intermediate_size")


def test_what_the_megatron_model_cannot_reproduce_is_refused_here(files):
    make_model(files["model"], hidden_act="gelu")
    assert_in(validate_error(files), "config.json: hidden_act 'gelu' is not supported")
    make_model(files["model"], rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert_in(validate_error(files), "config.json: RoPE type 'yarn' is not supported")
    make_model(files["model"], architectures=["GPT2LMHeadModel"])
    assert_in(validate_error(files), "architectures ['GPT2LMHeadModel'] are not supported")


def test_actor_tp_must_divide_vocab(files):
    make_model(files["model"], vocab_size=129)
    assert_in(validate_error(files, "actor.tp=2"),
              "actor.tp=2 does not divide the model's vocabulary of 129 tokens", "vocab_size")


def test_actor_pp_must_divide_layers(files):
    assert_in(validate_error(files, "resources.pools.actor=4", "actor.pp=4"),
              "actor.pp=4 does not divide the model's 2 layers", "num_hidden_layers")


def test_reference_checks_name_reference_keys(files):
    message = validate_error(files, "resources.pools={actor: 2, ref: 3, rollout: 1}", "reference.pool=ref",
                             "reference.tp=3")
    assert_in(message, "reference.tp=3 does not divide the model's 4 attention heads")


def test_reference_batch_split_says_the_value_is_the_actors_default(files):
    # ref pool: dp 3 x the actor's micro_batch_size 4 = 12 does not divide 64 sequences.
    message = validate_error(files, "resources.pools={actor: 2, ref: 3, rollout: 1}", "reference.pool=ref")
    assert_in(message, "for the reference", "dp=3", "reference.micro_batch_size (the actor's, by default)=4")


def test_batch_must_split_into_equal_micro_batches(files):
    message = validate_error(files, "data.batch_size=3", "rollout.n=2")
    assert_in(message, "data.batch_size*rollout.n=3*2=6", "for the actor", "dp=2", "actor.micro_batch_size=4")


def test_rollout_engines_times_tp_must_equal_pool(files):
    assert_in(validate_error(files, "rollout.engines=2"),
              "rollout.engines*rollout.tp=2*1=2 does not equal the 1 GPUs of pool 'rollout'")


def test_rollout_tp_on_cpu(files):
    layout = validate(job(files, "resources.pools.rollout=2", "rollout.tp=2"))
    assert layout.rollout == RolloutLayout(pool="rollout", gpus=2, engines=1, tp=2)
    assert_in(validate_error(files, "resources.pools.rollout=3", "rollout.tp=3"),
              "rollout.tp=3 does not divide the model's 4 attention heads")


def test_rollout_tp_must_divide_heads_on_gpu(files):
    assert_in(validate_error(files, "resources.device=gpu", "resources.pools.rollout=3", "rollout.tp=3"),
              "rollout.tp=3 does not divide the model's 4 attention heads")


def test_cpu_head_dim_must_have_a_vllm_kernel(files):
    make_model(files["model"], hidden_size=4 * 48)
    assert_in(validate_error(files), "head_dim=48", "vLLM CPU attention kernel", "64")


def test_explicit_head_dim_wins_over_hidden_size(files):
    make_model(files["model"], head_dim=40)
    assert_in(validate_error(files), "head_dim=40")


# data
def test_train_files_must_be_given(files):
    assert_in(validate_error(files, "data.train_files=[]"), "data.train_files is empty")


def test_train_file_must_exist(files):
    assert_in(validate_error(files, f"data.train_files=[{files['tmp'] / 'gone.parquet'}]"),
              "data.train_files[0]=", "gone.parquet not found")


def test_train_file_suffix(files):
    csv = files["tmp"] / "train.csv"
    csv.write_text("")
    assert_in(validate_error(files, f"data.train_files=[{csv}]"), "data.train_files[0]=",
              "must end in .parquet or .jsonl")


def test_val_files_are_checked_too(files):
    assert_in(validate_error(files, f"data.val_files=[{files['val']},{files['tmp'] / 'v2.jsonl'}]"),
              "data.val_files[1]=", "v2.jsonl not found")


def test_prompt_plus_response_must_fit_the_context(files):
    message = validate_error(files, "data.max_prompt_length=1000", "rollout.max_response_length=100")
    assert_in(message, "data.max_prompt_length+rollout.max_response_length=1000+100=1100",
              "max_position_embeddings=1024")


# algorithm and names
def test_grpo_needs_groups_of_two(files):
    assert_in(validate_error(files, "rollout.n=1"), "rollout.n=1", "adv_estimator=grpo", "at least 2")


@pytest.mark.parametrize("override, expected", [
    ("algorithm.adv_estimator=gae2", "algorithm.adv_estimator='gae2' is not one of: gae, grpo, drgrpo, rloo, "
     "reinforce_plus_plus, reinforce_plus_plus_baseline, remax"),
    ("actor.loss.policy_loss=dpo", "actor.loss.policy_loss='dpo' is not one of: vanilla, dual_clip, gspo, cispo, "
     "gmpo, sapo, gpg, clip_cov, kl_cov"),
    ("actor.loss.kl_estimator=k4", "actor.loss.kl_estimator='k4' is not one of: k1, k2, k3"),
    ("rollout.weight_transport=tcp", "rollout.weight_transport='tcp' is not one of: auto, shm, broadcast"),
    ("actor.loss_agg_mode=seq-mean", "actor.loss_agg_mode='seq-mean' is not one of: token-mean, seq-mean-token-sum, "
     "seq-mean-token-mean, seq-mean-token-sum-norm"),
    ("critic.loss_agg_mode=seq-mean", "critic.loss_agg_mode='seq-mean' is not one of: token-mean, "
     "seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm"),
    ("actor.loss.rollout_correction=is",
     "actor.loss.rollout_correction='is' is not one of: none, tis, icepop, seq_mask"),
    ("algorithm.kl_penalty=kl", "algorithm.kl_penalty='kl' is not one of: k1, k2, k3"),
    ("algorithm.kl_ctrl.type=pid", "algorithm.kl_ctrl.type='pid' is not one of: fixed, adaptive"),
])
def test_names_list_the_valid_choices(files, override, expected):
    assert_in(validate_error(files, override), expected)


@pytest.mark.parametrize("estimator", ["rloo", "drgrpo", "reinforce_plus_plus_baseline"])
def test_group_baselines_need_groups_of_two(files, estimator):
    assert_in(validate_error(files, "rollout.n=1", f"algorithm.adv_estimator={estimator}"),
              "rollout.n=1", f"adv_estimator={estimator}", "at least 2")


def test_estimators_without_groups_accept_one_sample(files):
    validate(job(files, "rollout.n=1", "actor.micro_batch_size=4", "algorithm.adv_estimator=reinforce_plus_plus"))


def test_dynamic_sampling_needs_groups(files):
    assert_in(validate_error(files, "rollout.n=1", "algorithm.adv_estimator=remax",
                             "algorithm.dynamic_sampling.enable=true"),
              "algorithm.dynamic_sampling.enable=true", "rollout.n >= 2")


def test_reference_for_kl_in_reward(files):
    layout = validate(job(files, "actor.loss.kl_coeff=0", "algorithm.kl_in_reward=true"))
    assert layout.reference == RoleLayout(pool="actor", gpus=2, tp=1, pp=1, dp=2, host="actor")


def test_ppo_mini_batch_size_must_divide_the_batch(files):
    assert_in(validate_error(files, "actor.ppo_mini_batch_size=3"),
              "actor.ppo_mini_batch_size=3 does not divide data.batch_size=8")
    validate(job(files, "actor.ppo_mini_batch_size=4", "actor.ppo_epochs=2"))


def test_ppo_mini_batch_must_split_into_micro_batches(files):
    # 2 prompts x 2 samples = 4 sequences per optimizer step, but dp 2 x micro-batch 4 = 8 per round.
    assert_in(validate_error(files, "rollout.n=2", "actor.ppo_mini_batch_size=2"),
              "actor.ppo_mini_batch_size*rollout.n=2*2=4", "dp=2 x actor.micro_batch_size=4 = 8")


@pytest.mark.parametrize("overrides, expected", [
    (["actor.loss.policy_loss=dual_clip", "actor.loss.clip_ratio_c=1.0"],
     "actor.loss.clip_ratio_c=1.0 must be above 1"),
    (["actor.loss.rollout_correction=icepop", "actor.loss.rollout_is_threshold_low=3"],
     "actor.loss.rollout_is_threshold_low=3.0 must be below actor.loss.rollout_is_threshold=2.0"),
    (["actor.loss.rollout_correction=tis", "actor.use_rollout_logprobs=true"], "actor.use_rollout_logprobs=true"),
    (["algorithm.gamma=1.5"], "algorithm.gamma=1.5 must be in [0, 1]"),
    (["algorithm.lam=-0.1"], "algorithm.lam=-0.1 must be in [0, 1]"),
    (["algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=300"],
     "algorithm.overlong_buffer.len=300 exceeds rollout.max_response_length=256"),
    (["algorithm.kl_ctrl.kl_coef=-1"], "algorithm.kl_ctrl.kl_coef=-1.0 must not be negative"),
    (["actor.loss.entropy_coeff=-0.01"], "actor.loss.entropy_coeff=-0.01 must not be negative"),
    (["actor.loss.policy_loss=sapo", "actor.loss.sapo_tau_neg=0"],
     "actor.loss.sapo_tau_neg=0.0 must be positive for actor.loss.policy_loss=sapo"),
    (["actor.loss.policy_loss=clip_cov", "actor.loss.clip_cov_ratio=1.5"],
     "actor.loss.clip_cov_ratio=1.5 must be in (0, 1]"),
    (["actor.loss.policy_loss=clip_cov", "actor.loss.clip_cov_lb=5"],
     "actor.loss.clip_cov_lb=5.0 must be below actor.loss.clip_cov_ub=5.0"),
    (["actor.loss.policy_loss=kl_cov", "actor.loss.kl_cov_ratio=0"], "actor.loss.kl_cov_ratio=0.0 must be in (0, 1]"),
    (["actor.loss.policy_loss=kl_cov", "actor.loss.kl_cov_coef=-1"],
     "actor.loss.kl_cov_coef=-1.0 must not be negative for actor.loss.policy_loss=kl_cov"),
])
def test_algorithm_knob_ranges(files, overrides, expected):
    assert_in(validate_error(files, *overrides), expected)


def test_reward_function_must_resolve(files):
    assert_in(validate_error(files, "reward.function=no_such_module_xyz:score"),
              "reward.function='no_such_module_xyz:score'", "cannot import module")


@pytest.mark.parametrize("override, key", [
    ("trainer.total_steps=0", "trainer.total_steps=0"),
    ("data.batch_size=0", "data.batch_size=0"),
    ("rollout.n=0", "rollout.n=0"),
    ("actor.micro_batch_size=0", "actor.micro_batch_size=0"),
    ("reference.micro_batch_size=-1", "reference.micro_batch_size=-1"),
    ("rollout.max_response_length=0", "rollout.max_response_length=0"),
    ("actor.optim.lr=0", "actor.optim.lr=0.0"),
    ("rollout.temperature=0", "rollout.temperature=0.0"),
    ("rollout.bucket_mb=0", "rollout.bucket_mb=0"),
    ("actor.tp=0", "actor.tp=0"),
    ("actor.ppo_epochs=0", "actor.ppo_epochs=0"),
    ("actor.ppo_mini_batch_size=0", "actor.ppo_mini_batch_size=0"),
    ("actor.loss.rollout_is_threshold=0", "actor.loss.rollout_is_threshold=0.0"),
    ("algorithm.dynamic_sampling.max_gen_batches=0", "algorithm.dynamic_sampling.max_gen_batches=0"),
    ("algorithm.kl_ctrl.type=adaptive algorithm.kl_ctrl.target_kl=0", "algorithm.kl_ctrl.target_kl=0.0"),
])
def test_values_that_must_be_positive(files, override, key):
    assert_in(validate_error(files, *override.split()), key, "must be positive")


@pytest.mark.parametrize("top_p", ["0", "1.5"])
def test_top_p_range(files, top_p):
    assert_in(validate_error(files, f"rollout.top_p={top_p}"), "rollout.top_p=", "must be in (0, 1]")


def test_negative_kl_coeff(files):
    assert_in(validate_error(files, "actor.loss.kl_coeff=-0.1"), "actor.loss.kl_coeff=-0.1", "must not be negative")


# ------------------------------------------------------------------------------------------ critic
CRITIC_POOLS = "resources.pools={actor: 2, rollout: 1, critic: 2}"


def test_critic_only_for_estimators_that_need_values(files):
    assert validate(job(files)).critic is None  # grpo: the critic: section is ignored
    assert validate(job(files, "critic.pool=nowhere", "critic.tp=3")).critic is None
    layout = validate(job(files, "algorithm.adv_estimator=gae", CRITIC_POOLS))
    assert layout.critic == RoleLayout(pool="critic", gpus=2, tp=1, pp=1, dp=2)


def test_critic_defaults():
    cfg = load_job(None, ["model.path=x"])
    assert (cfg.critic.pool, cfg.critic.model_path, cfg.critic.tp, cfg.critic.pp) == ("critic", None, 1, 1)
    assert cfg.critic.loss.cliprange_value == 0.5 and cfg.critic.optim.lr == 1e-5
    assert cfg.actor.optim.lr != cfg.critic.optim.lr  # its own optimizer settings


def test_critic_needs_its_pool(files):
    assert_in(validate_error(files, "algorithm.adv_estimator=gae"),
              "critic.pool='critic' is not a pool in resources.pools (pools: actor, rollout)")


def test_critic_may_share_the_actor_pool_but_not_the_rollout_pool(files):
    layout = validate(job(files, "algorithm.adv_estimator=gae", "critic.pool=actor"))
    assert layout.critic == RoleLayout(pool="actor", gpus=2, tp=1, pp=1, dp=2)
    assert_in(validate_error(files, "algorithm.adv_estimator=gae", "critic.pool=rollout"),
              "critic.pool and rollout.pool are both 'rollout'")


def test_critic_layout_checks_name_critic_keys(files):
    gae = ["algorithm.adv_estimator=gae", "resources.pools={actor: 2, rollout: 1, critic: 4}"]
    assert_in(validate_error(files, *gae, "critic.tp=3"), "critic.tp*critic.pp=3*1=3 does not divide the 4 GPUs "
              "of pool 'critic' (resources.pools.critic=4)")
    assert_in(validate_error(files, *gae, "critic.tp=4"), "critic.tp=4 does not divide the model's 2 key-value heads")
    assert_in(validate_error(files, *gae, "critic.pp=4"), "critic.pp=4 does not divide the model's 2 layers")
    assert_in(validate_error(files, *gae, "critic.micro_batch_size=3"),
              "data.batch_size*rollout.n=8*8=64 sequences do not split into equal micro-batches for the critic: "
              "dp=4 x critic.micro_batch_size=3 = 12 must divide it")


def test_critic_batch_split_follows_the_actor_mini_batches(files):
    assert_in(validate_error(files, "algorithm.adv_estimator=gae", CRITIC_POOLS, "actor.ppo_mini_batch_size=1",
                             "actor.micro_batch_size=1", "critic.micro_batch_size=8"),
              "actor.ppo_mini_batch_size*rollout.n=1*8=8 sequences", "for the critic",
              "dp=2 x critic.micro_batch_size=8 = 16 must divide it")


def test_critic_mini_batches_default_to_the_actors_and_may_be_its_own(files):
    from rlcore.config import resolved_critic

    cfg = job(files, "actor.ppo_mini_batch_size=4", "actor.ppo_epochs=2", "actor.loss_agg_mode=seq-mean-token-sum")
    c = resolved_critic(cfg)
    assert (c.ppo_mini_batch_size, c.ppo_epochs, c.loss_agg_mode) == (4, 2, "seq-mean-token-sum")
    assert cfg.critic.ppo_mini_batch_size is None  # the job spec keeps what was given
    c = resolved_critic(job(files, "critic.ppo_mini_batch_size=2", "critic.ppo_epochs=1",
                            "critic.loss_agg_mode=token-mean", "actor.ppo_epochs=3"))
    assert (c.ppo_mini_batch_size, c.ppo_epochs, c.loss_agg_mode) == (2, 1, "token-mean")
    gae = ["algorithm.adv_estimator=gae", CRITIC_POOLS]
    assert_in(validate_error(files, *gae, "critic.ppo_mini_batch_size=3"),
              "critic.ppo_mini_batch_size=3 does not divide data.batch_size=8")
    # 1 prompt x 8 samples = 8 sequences per critic step, but dp 2 x micro-batch 8 = 16 per round.
    assert_in(validate_error(files, *gae, "critic.ppo_mini_batch_size=1", "critic.micro_batch_size=8"),
              "critic.ppo_mini_batch_size*rollout.n=1*8=8 sequences", "for the critic",
              "dp=2 x critic.micro_batch_size=8 = 16 must divide it")
    validate(job(files, *gae, "critic.ppo_mini_batch_size=2", "critic.micro_batch_size=8"))


def test_critic_model_path(files):
    gae = ["algorithm.adv_estimator=gae", CRITIC_POOLS]
    missing = files["tmp"] / "no-such-critic"
    assert_in(validate_error(files, *gae, f"critic.model_path={missing}"),
              f"critic.model_path={missing} is not a HuggingFace model folder")
    other_vocab = make_model(files["tmp"] / "critic-vocab", vocab_size=256)
    assert_in(validate_error(files, *gae, f"critic.model_path={other_vocab}"),
              f"critic.model_path={other_vocab}/config.json has vocab_size=256, but the actor's model has 128")
    # The critic's own shape is what its layout is checked against.
    four_layers = make_model(files["tmp"] / "critic-4-layers", num_hidden_layers=4)
    layout = validate(job(files, *gae, f"critic.model_path={four_layers}", "critic.pp=2"))
    assert layout.critic.pp == 2 and layout.critic.dp == 1
    one_layer = make_model(files["tmp"] / "critic-1-layer", num_hidden_layers=1)
    assert_in(validate_error(files, *gae, f"critic.model_path={one_layer}", "critic.pp=2"),
              f"critic.pp=2 does not divide the model's 1 layers (critic.model_path={one_layer}/config.json")
    bad = make_model(files["tmp"] / "critic-bad", num_attention_heads=0)
    assert_in(validate_error(files, *gae, f"critic.model_path={bad}"),
              f"critic.model_path={bad}/config.json needs a positive integer 'num_attention_heads'")


@pytest.mark.parametrize("override, key", [
    ("critic.tp=0", "critic.tp=0"),
    ("critic.pp=-1", "critic.pp=-1"),
    ("critic.micro_batch_size=0", "critic.micro_batch_size=0"),
    ("critic.optim.lr=0", "critic.optim.lr=0.0"),
    ("critic.loss.cliprange_value=0", "critic.loss.cliprange_value=0.0"),
    ("critic.ppo_epochs=0", "critic.ppo_epochs=0"),
    ("critic.ppo_mini_batch_size=0", "critic.ppo_mini_batch_size=0"),
])
def test_critic_values_that_must_be_positive(files, override, key):
    assert_in(validate_error(files, "algorithm.adv_estimator=gae", CRITIC_POOLS, override), key, "must be positive")


def test_checkpoints_with_the_distributed_optimizer_are_refused_on_cpu(files):
    message = validate_error(files, "resources.device=cpu", "trainer.save_every=2",
                             "actor.optim.use_distributed_optimizer=true")
    assert_in(message, "trainer.save_every=2", "actor.optim.use_distributed_optimizer=true", "cpu profile")
    validate(job(files, "trainer.save_every=0", "actor.optim.use_distributed_optimizer=true"))


# ------------------------------------------------------------------------ virtual pipeline stages
def eight_layers(files) -> str:
    return f"model.path={make_model(files['tmp'] / 'model-8-layers', num_hidden_layers=8)}"


def test_vpp_resolves_for_every_role_and_the_reference_inherits_the_actors(files):
    # 8 layers = PP 2 x VPP 2 chunks of 2; 64 sequences / (dp 1 x mbs 4) = 16 micro-batches, a multiple of PP.
    layout = validate(job(files, eight_layers(files), "actor.pp=2", "actor.vpp=2"))
    assert layout.actor == RoleLayout(pool="actor", gpus=2, tp=1, pp=2, dp=1, vpp=2)
    assert layout.reference.vpp == 2
    assert validate(job(files, eight_layers(files), "actor.pp=2", "actor.vpp=2", "reference.vpp=1")).reference.vpp == 1
    assert validate(job(files)).actor.vpp == 1  # the default: no interleaving


@pytest.mark.parametrize("overrides, parts", [
    (["actor.vpp=0"], ["actor.vpp=0 must be positive"]),
    (["reference.vpp=-1"], ["reference.vpp=-1 must be positive"]),
    (["actor.vpp=2"], ["actor.vpp=2 needs actor.pp=1 > 1"]),
    (["actor.pp=2", "actor.vpp=3"],
     ["actor.pp=2 x actor.vpp=3 = 6 model chunks do not divide the model's 8 layers", "num_hidden_layers"]),
    # 3 prompts x 8 = 24 sequences / (dp 1 x mbs 8) = 3 micro-batches: not a multiple of PP=2.
    (["actor.pp=2", "actor.vpp=2", "data.batch_size=3", "actor.micro_batch_size=8"],
     ["actor.vpp=2 (interleaved pipeline) needs each DP rank's micro-batches per forward/backward to be a "
      "multiple of actor.pp=2, but data.batch_size*rollout.n=3*8=24 sequences / (dp=1 x "
      "actor.micro_batch_size=8) = 3 micro-batches"]),
    # Each update's mini-batch: 1 prompt x 8 = 8 sequences / (1 x 8) = 1 micro-batch.
    (["actor.pp=2", "actor.vpp=2", "actor.ppo_mini_batch_size=1", "actor.micro_batch_size=8"],
     ["actor.vpp=2 (interleaved pipeline)", "actor.ppo_mini_batch_size*rollout.n=1*8=8 sequences",
      "= 1 micro-batches"]),
    # The reference's log-prob pass: 64 sequences / (1 x 64) = 1 micro-batch, with the actor's vpp.
    (["actor.pp=2", "actor.vpp=2", "reference.micro_batch_size=64"],
     ["reference.vpp (the actor's, by default)=2 (interleaved pipeline)", "= 1 micro-batches"]),
    (["algorithm.adv_estimator=gae", CRITIC_POOLS, "critic.pp=2", "critic.vpp=2", "data.batch_size=3",
      "critic.micro_batch_size=8"],
     ["critic.vpp=2 (interleaved pipeline)", "multiple of critic.pp=2",
      "critic.micro_batch_size=8) = 3 micro-batches"]),
])
def test_vpp_errors_name_the_key_and_the_rule(files, overrides, parts):
    assert_in(validate_error(files, eight_layers(files), *overrides), *parts)


# ------------------------------------------------------------------ micro-batch shape (packing)
@pytest.mark.parametrize("overrides, parts", [
    (["actor.max_tokens_per_micro_batch=0"], ["actor.max_tokens_per_micro_batch=0 must be positive"]),
    (["reference.max_tokens_per_micro_batch=-5"], ["reference.max_tokens_per_micro_batch=-5 must be positive"]),
    (["actor.pp=2", "actor.vpp=2", "actor.max_tokens_per_micro_batch=512"],
     ["actor.max_tokens_per_micro_batch with actor.vpp=2", "a multiple of actor.pp"]),
    # The reference inherits the actor's shape (and vpp), unless it sets its own.
    (["actor.pp=2", "actor.vpp=2", "reference.vpp=2", "reference.max_tokens_per_micro_batch=512"],
     ["reference.max_tokens_per_micro_batch with reference.vpp=2"]),
])
def test_micro_batch_shape_errors_name_the_key(files, overrides, parts):
    assert_in(validate_error(files, eight_layers(files), *overrides), *parts)


def test_shared_prompt_rows_validate_under_an_interleaved_pipeline(files):
    # Each packed row at its own length through the interleaved schedule (tests/test_packing.py runs it).
    layout = validate(job(files, eight_layers(files), "actor.pp=2", "actor.vpp=2", "actor.shared_prompt=true"))
    assert (layout.actor.pp, layout.actor.vpp) == (2, 2)


def test_token_budget_needs_only_an_even_dp_split(files):
    # 64 sequences, micro_batch_size 7 would not divide them: under a token budget it is unused.
    validate(job(files, "actor.micro_batch_size=7", "reference.micro_batch_size=7", "actor.max_tokens_per_micro_batch=256"))
    assert "actor.micro_batch_size=7" in validate_error(files, "actor.micro_batch_size=7", "reference.micro_batch_size=7")


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), ("gpu", "bfloat16")])
def test_shared_prompt_validates_on_both_profiles(files, device, dtype):
    # The gpu profile runs shared-prompt rows through TransformerEngine's unfused attention with their
    # explicit mask and unfused RoPE (megatron_workers/model.py explicit_mask; tests/test_packing.py).
    layout = validate(job(files, f"resources.device={device}", f"model.dtype={dtype}", "actor.shared_prompt=true",
                          "critic.shared_prompt=true"))
    assert (layout.device, layout.dtype) == (device, dtype)


# ------------------------------------------------------------------------ uneven pipeline stages
def test_pp_layers_resolve_for_every_role_and_the_reference_inherits_the_actors(files):
    layout = validate(job(files, eight_layers(files), "actor.pp=2", "actor.pp_layers=[5,3]"))
    assert layout.actor.pp_layers == (5, 3) and layout.actor.stage_layers(8) == [5, 3]
    assert layout.reference.pp_layers == (5, 3)  # pp and its split are the actor's
    # A reference with a pp of its own splits evenly unless it says otherwise.
    ref = validate(job(files, eight_layers(files), "actor.pp=2", "actor.pp_layers=[5,3]", "reference.pp=2"))
    assert ref.reference.pp_layers is None and ref.reference.stage_layers(8) == [4, 4]
    assert validate(job(files, eight_layers(files), "actor.pp=2", "actor.pp_layers=[5,3]", "reference.pp=2",
                        "reference.pp_layers=[2,6]")).reference.pp_layers == (2, 6)
    critic = validate(job(files, eight_layers(files), "algorithm.adv_estimator=gae", CRITIC_POOLS, "critic.pp=2",
                          "critic.pp_layers=[3,5]")).critic
    assert critic.pp_layers == (3, 5)
    # Three stages: any first and last count, the middle ones equal; interleaved, multiples of vpp.
    assert validate(job(files, eight_layers(files), "resources.pools={actor: 3, rollout: 1}", "actor.pp=3",
                        "actor.pp_layers=[1,3,4]", "actor.micro_batch_size=8")).actor.pp_layers == (1, 3, 4)
    assert validate(job(files, eight_layers(files), "resources.pools={actor: 3, rollout: 1}", "actor.pp=3",
                        "actor.vpp=2", "actor.pp_layers=[2,2,4]", "data.batch_size=6",
                        "actor.micro_batch_size=8")).actor.pp_layers == (2, 2, 4)
    assert validate(job(files, eight_layers(files), "actor.pp=2", "actor.vpp=2",
                        "actor.pp_layers=[4,4]")).actor.pp_layers == (4, 4)  # even: megatron's own split


@pytest.mark.parametrize("overrides, parts", [
    (["actor.pp=2", "actor.pp_layers=[8]"], ["actor.pp_layers=[8] has 1 entries but actor.pp=2"]),
    (["actor.pp=2", "actor.pp_layers=[5,4]"],
     ["actor.pp_layers=[5, 4] sums to 9 layers, but the model has 8", "num_hidden_layers"]),
    (["actor.pp=2", "actor.pp_layers=[8,0]"], ["actor.pp_layers=[8, 0]: every PP stage needs at least 1 layer"]),
    (["actor.pp=2", "actor.vpp=2", "actor.pp_layers=[2,6]"],
     ["actor.pp_layers=[2, 6] with actor.vpp=2", "uneven split of 2 PP stages", "pp >= 3"]),
    (["resources.pools={actor: 4, rollout: 1}", "actor.pp=4", "actor.pp_layers=[1,2,3,2]"],
     ["actor.pp_layers=[1, 2, 3, 2]: the middle stages", "must hold the same number of layers"]),
    (["resources.pools={actor: 3, rollout: 1}", "actor.pp=3", "actor.vpp=2", "actor.pp_layers=[3,2,3]"],
     ["actor.pp_layers=[3, 2, 3]: with actor.vpp=2 every stage's layers must split into 2 equal model chunks"]),
    (["actor.pp=2", "actor.pp_layers=[5,3]", "reference.pp=2", "reference.pp_layers=[4]"],
     ["reference.pp_layers=[4] has 1 entries but reference.pp=2"]),
    (["algorithm.adv_estimator=gae", CRITIC_POOLS, "critic.pp=2", "critic.pp_layers=[1,1]"],
     ["critic.pp_layers=[1, 1] sums to 2 layers"]),
    (["actor.pp_layers=[a,b]"], ["actor.pp_layers"]),
])
def test_pp_layers_errors_name_the_key_and_the_rule(files, overrides, parts):
    cfg_error = None
    try:
        message = validate_error(files, eight_layers(files), *overrides)
    except ConfigError as e:  # a mistyped list is refused when the spec is loaded
        cfg_error = message = str(e)
    assert_in(message, *parts)
    assert cfg_error is None or "actor.pp_layers" in cfg_error
