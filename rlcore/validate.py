"""Validating a job spec: everything that can be checked before start-up (names, ranges, files, pools,
layouts that must divide the model and the batch), each failure one ``ConfigError`` sentence naming the
key; ``validate`` returns the resolved ``JobLayout`` of every role. The layout checks themselves are
``rlcore/layout.py``'s, which the Megatron side runs again.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from rlcore import algos, lr_schedule
from rlcore.config import JobConfig, resolved_critic
from rlcore.hf_config import HFModelSpec, read_hf_config
from rlcore.job import ConfigError
from rlcore.judge import validate_judge
from rlcore.nonfinite import POLICIES as NONFINITE_POLICIES
from rlcore.layout import (INHERITED, RoleLayout, RolloutLayout, check_micro_batches, check_model_split,
                           check_rollout_split)
from rlcore.loggers import check_loggers
from rlcore.reward import RewardError, load_reward_fn
from rlcore import reward_sources
from rlcore.weight_sync import TRANSPORTS

DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "gpu")
HOST_MALLOC_MODES = ("glibc", "keep")  # resources.host_malloc (megatron_workers/host_malloc.py)
DATA_SUFFIXES = (".parquet", ".jsonl")


@dataclass
class JobLayout:
    actor: RoleLayout
    reference: Optional[RoleLayout]  # None when no KL needs it (actor.loss.kl_coeff == 0, no algorithm.kl_in_reward)
    rollout: Optional[RolloutLayout]  # None: a preference job without greedy validation generates nothing
    device: str  # the resolved profile: cpu | gpu
    total_gpus: int  # all pools together
    dtype: str  # the resolved model dtype: float32 | bfloat16
    critic: Optional[RoleLayout] = None  # None unless the advantage estimator needs values (needs_critic)
    reward: dict[str, RoleLayout] = field(default_factory=dict)  # the scoring roles by source: "rm", "prm"
    judge: Optional[RolloutLayout] = None  # the LLM judge's engines (reward.judge); None: no judge
    host_malloc: str = "glibc"  # resources.host_malloc, for every Megatron rank
    host_hugepages: bool = False  # resources.host_hugepages, for every Megatron rank


def for_another_machine(cfg: JobConfig) -> bool:
    """A cluster spec checked here: model.path is not a folder on this machine but model.hf_config
    describes the model, so the layout can be checked without the weights, tokenizer or data."""
    return cfg.model.hf_config is not None and not os.path.isdir(cfg.model.path)


def validate(cfg: JobConfig, require_files: Optional[bool] = None) -> JobLayout:
    """Check everything that can be checked before start-up; raise ``ConfigError`` on the first
    problem, else return the resolved layout of every role. ``require_files`` (default: unless the
    spec is ``for_another_machine``) also checks that the weights and data files are here."""
    if cfg.algorithm.type != "rl":  # a preference objective (DPO, reward-model training): its own roles
        from rlcore.preference_validate import validate_preference

        return validate_preference(cfg, require_files)
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
    _check_partial_rollouts(cfg)

    a = cfg.actor
    actor = _role_layout(cfg, "actor", a.pool, a.tp, a.pp, a.vpp, a.pp_layers)
    check_model_split(model, actor.tp, actor.pp, actor.vpp, "actor", pp_layers=actor.pp_layers)
    _check_micro_batch_shapes(cfg, "actor", actor)
    # The actor's log-prob pass runs on the whole batch, a multiple of its mini-batch: checking the
    # mini-batch suffices.
    _check_batch_split(cfg, "actor", actor, *_prompts(cfg, a.ppo_mini_batch_size, "actor"),
                       "actor.micro_batch_size", a.micro_batch_size, "actor.vpp")

    reference = None
    if needs_reference(cfg):  # the reference model only exists to compute the KL
        ref = cfg.reference
        inherited = tuple(k for k in ("tp", "pp", "vpp") if getattr(ref, k) is None)
        # The actor's stage split comes with the actor's pp; a pp of its own splits evenly by default.
        ref_pp_layers = ref.pp_layers
        if ref_pp_layers is None and ref.pp is None:
            ref_pp_layers = a.pp_layers
            inherited += ("pp_layers",)
        reference = _role_layout(cfg, "reference", _default(ref.pool, a.pool), _default(ref.tp, a.tp),
                                 _default(ref.pp, a.pp), _default(ref.vpp, a.vpp), ref_pp_layers,
                                 defaulted=ref.pool is None and ref.tp is None and ref.pp is None)
        check_model_split(model, reference.tp, reference.pp, reference.vpp, "reference", inherited,
                          pp_layers=reference.pp_layers)
        _check_micro_batch_shapes(cfg, "reference", reference)
        _check_batch_split(cfg, "reference", reference, "data.batch_size", cfg.data.batch_size,
                           _key("reference", "micro_batch_size", ref.micro_batch_size is None),
                           _default(ref.micro_batch_size, a.micro_batch_size),
                           _key("reference", "vpp", ref.vpp is None))
        reference.host = reference_host(cfg, actor, reference)

    critic = _critic_layout(cfg, model, require_files) if needs_critic(cfg) else None

    rollout = _rollout_layout(cfg, model, device)
    _check_data(cfg, model, require_files)
    _check_algorithm(cfg)
    check_lr_schedule(cfg, "actor")
    if critic is not None:
        check_lr_schedule(cfg, "critic")
    try:
        load_reward_fn(cfg.reward.function)
    except RewardError as e:
        raise ConfigError(str(e)) from e
    reward = reward_layouts(cfg, model, require_files)
    judge = validate_judge(cfg, device, require_files, {name: lay.pool for name, lay in (
        ("actor", actor), ("reference", reference), ("critic", critic), ("rollout", rollout),
        *((f"reward.{REWARD_MODEL_SECTIONS[n]}", lay) for n, lay in reward.items())) if lay is not None})
    return JobLayout(actor=actor, reference=reference, rollout=rollout, device=device,
                     total_gpus=sum(cfg.resources.pools.values()), dtype=dtype, critic=critic, reward=reward,
                     judge=judge, host_malloc=host_malloc(cfg),
                     host_hugepages=cfg.resources.host_hugepages)


# ------------------------------------------------------------------------------- reward models
REWARD_MODEL_SECTIONS = {"rm": "model", "prm": "process"}  # source name -> its section of reward:


def reward_layouts(cfg: JobConfig, model: HFModelSpec, require_files: bool) -> dict[str, RoleLayout]:
    """The reward sources' keys (rlcore/reward_sources.py), and the layout of each scoring role the spec
    configures (reward.model, reward.process), checked against its own checkpoint."""
    _one_of("reward.normalize", cfg.reward.normalize, reward_sources.NORMALIZE)
    try:
        reward_sources.source_weights(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    layouts = {}
    for name, attr in REWARD_MODEL_SECTIONS.items():
        section, key = getattr(cfg.reward, attr), f"reward.{attr}"
        if section.path is None:
            continue
        for sub in ("tp", "pp", "micro_batch_size"):
            if not getattr(section, sub) > 0:
                raise ConfigError(f"{key}.{sub}={getattr(section, sub)} must be positive")
        pool = section.pool or cfg.actor.pool
        if pool not in cfg.resources.pools:
            raise ConfigError(f"{key}.pool={pool!r} is not a pool in resources.pools "
                              f"(pools: {', '.join(cfg.resources.pools)})")
        if pool == cfg.rollout.pool:
            raise ConfigError(f"{key}.pool and rollout.pool are both {pool!r}: colocating a reward model and "
                              "rollout on one pool is not supported yet")
        layouts[name] = _role_layout(cfg, key, pool, section.tp, section.pp, 1, defaulted=False)
        if name == "prm":
            _check_process_keys(cfg, model)
        if require_files or os.path.isdir(section.path):
            scorer = _read_reward_model(section.path, f"{key}.path")
            check_model_split(scorer, section.tp, section.pp, 1, key)
            if os.path.isdir(cfg.model.path):  # the policy's tokenizer is here to compare with
                _check_reward_tokenizer(cfg, name, section.path, key, scorer)
    return layouts


def _read_reward_model(path: str, key: str) -> HFModelSpec:
    """A reward model's shape; one sentence unless ``path`` is an HF *ForSequenceClassification
    checkpoint with one label."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(f"{key}={path} is not a HuggingFace model folder (no config.json); expected a "
                          "*ForSequenceClassification checkpoint with num_labels 1")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key}={config_path} is not valid JSON: {e}") from e
    archs = raw.get("architectures") or [] if isinstance(raw, dict) else []
    if not archs or not all(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in archs):
        raise ConfigError(f"{key}={path} is not a sequence-classification checkpoint: its config.json has "
                          f"architectures {archs} (expected an HF *ForSequenceClassification with num_labels 1)")
    # transformers' default for a config without num_labels or id2label is 2 labels.
    labels = raw.get("num_labels") or len(raw.get("id2label") or {}) or 2
    if labels != 1:
        raise ConfigError(f"{key}={path} has {labels} labels (config.json num_labels/id2label); a reward model "
                          "scores with one (num_labels 1)")
    return _read_model(path, key=key)


def _check_process_keys(cfg: JobConfig, model: HFModelSpec) -> None:
    p, estimator = cfg.reward.process, cfg.algorithm.adv_estimator
    _one_of("reward.process.aggregate", p.aggregate, reward_sources.PRM_AGGREGATES)
    if p.aggregate == "token" and not algos.ADV_ESTIMATORS.meta(estimator).token_rewards:
        users = [n for n in algos.ADV_ESTIMATORS if algos.ADV_ESTIMATORS.meta(n).token_rewards]
        raise ConfigError(f"reward.process.aggregate=token puts step rewards on tokens, which "
                          f"algorithm.adv_estimator={estimator} cannot use (it sees each sample's total only); "
                          f"use {' or '.join(users)}, or reward.process.aggregate=min, last or mean")
    if p.separator_token_id is not None:
        if not 0 <= p.separator_token_id < model.vocab_size:
            raise ConfigError(f"reward.process.separator_token_id={p.separator_token_id} is not a token id of the "
                              f"policy's vocabulary (0..{model.vocab_size - 1})")
    elif not p.separator:
        raise ConfigError("reward.process.separator is empty: give the text that ends a step (e.g. \"\\n\\n\") or "
                          "reward.process.separator_token_id")


def _check_reward_tokenizer(cfg: JobConfig, name: str, path: str, key: str, scorer: HFModelSpec) -> None:
    """A scoring model sharing the policy's tokenizer reads the policy's ids (their length is bounded
    here); one with its own re-tokenises the chat, which needs its chat template. A PRM must share it."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises several types for a folder without a usable tokenizer
        raise ConfigError(f"{key}.path: cannot load its tokenizer ({type(e).__name__}: {e})") from e
    if not reward_sources.same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(cfg.model.path)):
        if name == "prm":
            raise ConfigError(f"{key}.path: the process reward model's tokenizer or chat template differs from "
                              "the policy's (model.path); it must share them, since its step scores are placed "
                              "on the policy's tokens")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError(f"{key}.path: its tokenizer differs from the policy's and has no chat template, "
                              "so the prompt and response cannot be re-tokenised for it")
        return
    total = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if total > scorer.max_position_embeddings:
        raise ConfigError(f"data.max_prompt_length+rollout.max_response_length={total} exceeds {key}'s "
                          f"max_position_embeddings={scorer.max_position_embeddings} ({scorer.source})")


def needs_critic(cfg: JobConfig) -> bool:
    """PPO's value model (the critic: section) runs exactly when the advantage estimator needs values."""
    return algos.ADV_ESTIMATORS.meta(cfg.algorithm.adv_estimator).critic


def needs_reference(cfg: JobConfig) -> bool:
    """The reference model is loaded only for a KL: as a loss term or as a reward penalty."""
    return cfg.actor.loss.kl_coeff > 0 or cfg.algorithm.kl_in_reward


def _critic_layout(cfg: JobConfig, model: HFModelSpec, require_files: bool) -> RoleLayout:
    c = resolved_critic(cfg)
    layout = _role_layout(cfg, "critic", c.pool, c.tp, c.pp, c.vpp, c.pp_layers)
    # The critic's own checkpoint when it has one here (a spec for another machine may name a path
    # that only exists there: its shape is then taken to be the actor's).
    if c.model_path is not None and (require_files or os.path.isdir(c.model_path)):
        model = _read_critic_model(cfg, model)
    check_model_split(model, layout.tp, layout.pp, layout.vpp, "critic", pp_layers=layout.pp_layers)
    _check_micro_batch_shapes(cfg, "critic", layout)
    # The critic trains on its own mini-batches (by default the actor's), split into its own
    # micro-batches; the value pass runs on the whole batch, a multiple of them.
    own = cfg.critic.ppo_mini_batch_size is not None
    _check_mini_batch("critic", cfg.critic.ppo_mini_batch_size, cfg.data.batch_size)
    _check_batch_split(cfg, "critic", layout, *_prompts(cfg, c.ppo_mini_batch_size, "critic" if own else "actor"),
                       "critic.micro_batch_size", c.micro_batch_size, "critic.vpp")
    return layout


def _read_critic_model(cfg: JobConfig, actor_model: HFModelSpec) -> HFModelSpec:
    path = cfg.critic.model_path
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"critic.model_path={path} is not a HuggingFace model folder (no config.json)")
    model = _read_model(path, key="critic.model_path")
    if model.vocab_size != actor_model.vocab_size:
        raise ConfigError(f"{model.source} has vocab_size={model.vocab_size}, but the actor's model has "
                          f"{actor_model.vocab_size} ({actor_model.source}): the critic reads the actor's "
                          "token ids, so both need the same vocabulary")
    total = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if total > model.max_position_embeddings:
        raise ConfigError(f"data.max_prompt_length+rollout.max_response_length={total} exceeds the critic's "
                          f"max_position_embeddings={model.max_position_embeddings} ({model.source})")
    return model


def _read_model(path: str, hf_config: Any = None, key: str = "model.path") -> HFModelSpec:
    """The model's shape from its folder (weights required) or, given ``hf_config``, from that when
    ``path`` is not a folder here."""
    model = read_hf_config(path, hf_config, key)
    if os.path.isdir(path) and not glob.glob(os.path.join(path, "*.safetensors")):
        raise ConfigError(f"{key}={path} has no *.safetensors weights")
    return model


def _default(value, actor_value):
    return actor_value if value is None else value


def _key(role: str, name: str, defaulted: bool) -> str:
    """The dotted key a value came from, saying so when the reference inherited it from the actor."""
    return f"{role}.{name}" + (INHERITED if defaulted else "")


def _prompts(cfg: JobConfig, mini_batch_size: Optional[int], owner: str) -> tuple[str, int]:
    """(key, prompts) of one update's mini-batch: ``owner``.ppo_mini_batch_size, or the whole batch."""
    if mini_batch_size is None:
        return "data.batch_size", cfg.data.batch_size
    return f"{owner}.ppo_mini_batch_size", mini_batch_size


def _check_mini_batch(role: str, mini_batch_size: Optional[int], batch_size: int) -> None:
    if mini_batch_size is not None and batch_size % mini_batch_size:
        raise ConfigError(f"{role}.ppo_mini_batch_size={mini_batch_size} does not divide "
                          f"data.batch_size={batch_size} (both count prompts)")


def _check_batch_split(cfg: JobConfig, role: str, layout: RoleLayout, prompts_key: str, prompts: int,
                       micro_batch_key: str, micro_batch_size: int, vpp_key: str) -> None:
    budget = _micro_batch_budget(cfg, role)
    if budget:  # micro-batches by tokens: only the DP split must be even
        if prompts * cfg.rollout.n % layout.dp:
            raise ConfigError(f"{prompts_key}*rollout.n={prompts}*{cfg.rollout.n} sequences do not split evenly "
                              f"over the {role}'s dp={layout.dp} ranks")
        return
    check_micro_batches(role, layout, f"{prompts_key}*rollout.n={prompts}*{cfg.rollout.n}", prompts * cfg.rollout.n,
                        micro_batch_key, micro_batch_size, vpp_key)


def _role_layout(cfg: JobConfig, role: str, pool: str, tp: int, pp: int, vpp: int,
                 pp_layers: Optional[list[int]] = None, defaulted: bool = False) -> RoleLayout:
    gpus = cfg.resources.pools[pool]
    if gpus % (tp * pp):
        raise ConfigError(f"{role}.tp*{role}.pp={tp}*{pp}={tp * pp} does not divide the {gpus} GPUs of "
                          f"pool {pool!r} (resources.pools.{pool}={gpus})"
                          + (" (tp, pp and pool are the actor's, by default)" if defaulted else ""))
    return RoleLayout(pool=pool, gpus=gpus, tp=tp, pp=pp, dp=gpus // (tp * pp), vpp=vpp,
                      pp_layers=None if pp_layers is None else tuple(pp_layers))


def reference_host(cfg: JobConfig, actor: RoleLayout, reference: RoleLayout) -> Optional[str]:
    """``"actor"`` when the reference's model goes into the actor's processes (reference.colocate):
    one parallel state per process, so its pool, tp, pp and vpp must be the actor's. None: its own."""
    if cfg.reference.colocate is False:
        return None
    differ = [f"reference.{k}={getattr(reference, k)} (actor.{k}={getattr(actor, k)})"
              for k in ("pool", "tp", "pp", "vpp") if getattr(reference, k) != getattr(actor, k)]
    if differ and cfg.reference.colocate:
        raise ConfigError(f"reference.colocate=true puts the reference in the actor's processes, which needs the "
                          f"actor's pool, tp, pp and vpp, but {', '.join(differ)}; drop those keys or set "
                          "reference.colocate=false")
    return None if differ else "actor"


def _rollout_layout(cfg: JobConfig, model: HFModelSpec, device: str) -> RolloutLayout:
    r = cfg.rollout
    gpus = cfg.resources.pools[r.pool]
    if r.engines * r.tp != gpus:
        raise ConfigError(f"rollout.engines*rollout.tp={r.engines}*{r.tp}={r.engines * r.tp} does not equal "
                          f"the {gpus} GPUs of pool {r.pool!r} (resources.pools.{r.pool}={gpus})")
    check_rollout_split(model, r.tp, device)
    return RolloutLayout(pool=r.pool, gpus=gpus, engines=r.engines, tp=r.tp)


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
        "rollout.engine_timeout_s": cfg.rollout.engine_timeout_s,
        "rollout.sync_timeout_s": cfg.rollout.sync_timeout_s,
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
        "critic.loss.cliprange_value": cfg.critic.loss.cliprange_value,
    }
    optional = {"reference": ("tp", "pp", "vpp", "micro_batch_size"),  # None means the actor's
                "critic": ("ppo_epochs", "ppo_mini_batch_size")}
    for section, keys in optional.items():
        for key in keys:
            if getattr(getattr(cfg, section), key) is not None:
                positive[f"{section}.{key}"] = getattr(getattr(cfg, section), key)
    for key, value in positive.items():
        if not value > 0:
            raise ConfigError(f"{key}={value} must be positive")
    non_negative = {
        "actor.loss.kl_coeff": cfg.actor.loss.kl_coeff,
        "actor.loss.clip_ratio_low": cfg.actor.loss.clip_ratio_low,
        "actor.loss.clip_ratio_high": cfg.actor.loss.clip_ratio_high,
        "trainer.val_every": cfg.trainer.val_every,
        "trainer.off_policy_steps": cfg.trainer.off_policy_steps,
        "trainer.save_every": cfg.trainer.save_every,
        "trainer.keep_last": cfg.trainer.keep_last,
        "rollout.max_engine_restarts": cfg.rollout.max_engine_restarts,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{key}={value} must not be negative")
    _check_resume(cfg.trainer.resume)
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p} must be in (0, 1]")
    if not cfg.actor.loss.clip_ratio_low < 1:
        raise ConfigError(f"actor.loss.clip_ratio_low={cfg.actor.loss.clip_ratio_low} must be below 1 "
                          "(the ratio is clipped at 1 - clip_ratio_low)")
    if not 0 < cfg.rollout.gpu_memory_utilization <= 1:
        raise ConfigError(f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} "
                          "must be in (0, 1]")


def _micro_batch_budget(cfg: JobConfig, role: str) -> Optional[int]:
    """The role's max_tokens_per_micro_batch, the reference's defaulting to the actor's."""
    r, a = getattr(cfg, role), cfg.actor
    if role == "reference":
        return _default(r.max_tokens_per_micro_batch, a.max_tokens_per_micro_batch)
    return r.max_tokens_per_micro_batch


def _check_micro_batch_shapes(cfg: JobConfig, role: str, layout: RoleLayout) -> None:
    budget = _micro_batch_budget(cfg, role)
    if budget is not None and budget < 1:
        raise ConfigError(f"{role}.max_tokens_per_micro_batch={budget} must be positive (or null: micro-batches "
                          f"of {role}.micro_batch_size rows)")
    if layout.vpp > 1 and budget:
        raise ConfigError(f"{role}.max_tokens_per_micro_batch with {role}.vpp={layout.vpp}: the interleaved "
                          f"pipeline schedule needs each DP rank's micro-batches to be a multiple of {role}.pp, and "
                          f"a token budget makes as many as each batch's lengths need; use vpp=1, or micro-batches "
                          f"of {role}.micro_batch_size rows")


def _check_partial_rollouts(cfg: JobConfig) -> None:
    # A sync mid-generation only exists when a batch generates while the actor trains.
    if cfg.rollout.partial_rollouts and cfg.trainer.off_policy_steps < 1:
        raise ConfigError(f"rollout.partial_rollouts=true needs trainer.off_policy_steps >= 1 (it is "
                          f"{cfg.trainer.off_policy_steps}: nothing generates during a weight sync); set one of them")


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


def _check_algorithm_ranges(cfg: JobConfig) -> None:
    a, loss, alg = cfg.actor, cfg.actor.loss, cfg.algorithm
    positive = {"actor.ppo_epochs": a.ppo_epochs, "actor.loss.rollout_is_threshold": loss.rollout_is_threshold,
                "actor.loss.rollout_is_threshold_low": loss.rollout_is_threshold_low,
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
    non_negative = {"actor.loss.entropy_coeff": loss.entropy_coeff, "algorithm.kl_ctrl.kl_coef": alg.kl_ctrl.kl_coef,
                    "algorithm.overlong_buffer.penalty_factor": alg.overlong_buffer.penalty_factor}
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{key}={value} must not be negative")
    for key, value in (("algorithm.gamma", alg.gamma), ("algorithm.lam", alg.lam)):
        if not 0 <= value <= 1:
            raise ConfigError(f"{key}={value} must be in [0, 1]")
    _check_mini_batch("actor", a.ppo_mini_batch_size, cfg.data.batch_size)
    if loss.policy_loss == "dual_clip" and not loss.clip_ratio_c > 1:
        raise ConfigError(f"actor.loss.clip_ratio_c={loss.clip_ratio_c} must be above 1 for "
                          "actor.loss.policy_loss=dual_clip")
    _check_policy_loss_knobs(loss)
    lo, hi = loss.rollout_is_threshold_low, loss.rollout_is_threshold
    if loss.rollout_correction in ("icepop", "seq_mask") and not lo < hi:
        raise ConfigError(f"actor.loss.rollout_is_threshold_low={lo} must be below "
                          f"actor.loss.rollout_is_threshold={hi} (the range of ratios kept)")
    if a.use_rollout_logprobs and loss.rollout_correction != "none":
        raise ConfigError(f"actor.loss.rollout_correction={loss.rollout_correction} corrects the old log-probs "
                          "towards the rollout engine's, but actor.use_rollout_logprobs=true makes them the same "
                          "(set one of them off)")
    if alg.overlong_buffer.enable and alg.overlong_buffer.len > cfg.rollout.max_response_length:
        raise ConfigError(f"algorithm.overlong_buffer.len={alg.overlong_buffer.len} exceeds "
                          f"rollout.max_response_length={cfg.rollout.max_response_length}")


def _check_policy_loss_knobs(loss) -> None:
    """The knobs of the policy loss chosen (the others are not read, so not checked)."""
    name = loss.policy_loss
    keys = {"sapo": ("sapo_tau_pos", "sapo_tau_neg"), "clip_cov": ("clip_cov_ratio",),
            "kl_cov": ("kl_cov_ratio", "kl_cov_coef")}.get(name, ())
    for key in keys:
        value = getattr(loss, key)
        if key.endswith("_ratio") and not 0 < value <= 1:
            raise ConfigError(f"actor.loss.{key}={value} must be in (0, 1] (the fraction of a micro-batch's "
                              f"response tokens picked) for actor.loss.policy_loss={name}")
        if key.startswith("sapo_tau") and not value > 0:
            raise ConfigError(f"actor.loss.{key}={value} must be positive for actor.loss.policy_loss={name}")
        if key == "kl_cov_coef" and value < 0:
            raise ConfigError(f"actor.loss.{key}={value} must not be negative for actor.loss.policy_loss={name}")
    if name == "clip_cov" and not loss.clip_cov_lb < loss.clip_cov_ub:
        raise ConfigError(f"actor.loss.clip_cov_lb={loss.clip_cov_lb} must be below actor.loss.clip_cov_ub="
                          f"{loss.clip_cov_ub} (the band of covariances whose tokens may be picked)")


def _check_resume(resume: str) -> None:
    if resume in ("auto", "never"):
        return
    if not os.path.isdir(resume):
        raise ConfigError(f"trainer.resume={resume!r} is neither auto, never nor an existing checkpoint folder")
    from rlcore.checkpoint import LATEST, MANIFEST

    if not (os.path.isfile(os.path.join(resume, MANIFEST)) or os.path.isfile(os.path.join(resume, LATEST))):
        raise ConfigError(f"trainer.resume={resume} is not a checkpoint: it has no {MANIFEST} (a step_N "
                          f"folder) and no {LATEST} pointer (a checkpoint_dir)")


def host_malloc(cfg: JobConfig) -> str:
    _one_of("resources.host_malloc", cfg.resources.host_malloc, HOST_MALLOC_MODES)
    return cfg.resources.host_malloc


def _one_of(key: str, value: str, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{key}={value!r} is not one of: {', '.join(valid)}")


def _check_names(cfg: JobConfig) -> None:
    """Names against the registries (rlcore/algos.py) and the fixed choices."""
    a, alg = cfg.actor, cfg.algorithm
    choices = [("algorithm.adv_estimator", alg.adv_estimator, algos.ADV_ESTIMATORS),
               ("actor.loss.policy_loss", a.loss.policy_loss, algos.POLICY_LOSSES),
               ("actor.loss.kl_estimator", a.loss.kl_estimator, algos.KL_ESTIMATORS),
               ("actor.loss_agg_mode", a.loss_agg_mode, algos.AGG_MODES),
               ("actor.loss.rollout_correction", a.loss.rollout_correction, algos.ROLLOUT_CORRECTIONS),
               ("algorithm.kl_penalty", alg.kl_penalty, algos.KL_ESTIMATORS),
               ("algorithm.kl_ctrl.type", alg.kl_ctrl.type, algos.KL_CONTROLLERS),
               ("model.dtype", cfg.model.dtype, DTYPES),
               ("rollout.weight_transport", cfg.rollout.weight_transport, TRANSPORTS),
               ("resources.device", cfg.resources.device, DEVICES),
               ("trainer.on_nonfinite", cfg.trainer.on_nonfinite, NONFINITE_POLICIES)]
    if cfg.critic.loss_agg_mode is not None:  # None: the actor's
        choices.append(("critic.loss_agg_mode", cfg.critic.loss_agg_mode, algos.AGG_MODES))
    for key, value, valid in choices:
        _one_of(key, value, valid)
    try:  # unknown names, and a logger whose package is not installed: before anything starts
        check_loggers(cfg.trainer.logger, cfg.trainer.wandb_mode)
    except ValueError as e:
        raise ConfigError(str(e)) from e


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


def _check_files(key: str, files: list[str], require_files: bool = True) -> None:
    for i, path in enumerate(files):
        if not path.endswith(DATA_SUFFIXES):
            raise ConfigError(f"{key}[{i}]={path} must end in .parquet or .jsonl")
        if require_files and not os.path.isfile(path):
            raise ConfigError(f"{key}[{i}]={path} not found")


def _check_data(cfg: JobConfig, model: HFModelSpec, require_files: bool = True) -> None:
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty; give at least one .parquet or .jsonl file")
    _check_files("data.train_files", cfg.data.train_files, require_files)
    _check_files("data.val_files", cfg.data.val_files, require_files)
    total = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if total > model.max_position_embeddings:
        raise ConfigError(
            f"data.max_prompt_length+rollout.max_response_length={cfg.data.max_prompt_length}+"
            f"{cfg.rollout.max_response_length}={total} exceeds the model's max_position_embeddings="
            f"{model.max_position_embeddings} ({model.source})")


def _check_algorithm(cfg: JobConfig) -> None:
    estimator = cfg.algorithm.adv_estimator
    needs = algos.ADV_ESTIMATORS.meta(estimator)
    if needs.groups and cfg.rollout.n < 2:
        raise ConfigError(f"rollout.n={cfg.rollout.n} but algorithm.adv_estimator={estimator} needs at least 2 "
                          "samples per prompt (the group its advantages are relative to)")
    if needs.critic and getattr(cfg, "critic", None) is None:
        raise ConfigError(f"algorithm.adv_estimator={estimator} needs a critic (a critic: section), "
                          "and this job spec has none")
    if cfg.algorithm.dynamic_sampling.enable and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.dynamic_sampling.enable=true drops prompts whose samples all scored the "
                          f"same, which needs rollout.n >= 2 (got rollout.n={cfg.rollout.n})")


def check_lr_schedule(cfg: JobConfig, role: str) -> None:
    """``<role>.optim``'s learning-rate schedule against the run's optimizer steps (rlcore/lr_schedule.py)."""
    o = getattr(cfg, role).optim
    key = f"{role}.optim"
    _one_of(f"{key}.lr_decay_style", o.lr_decay_style, lr_schedule.DECAY_STYLES)
    if o.lr_warmup_steps is not None and o.lr_warmup_ratio is not None:
        raise ConfigError(f"{key}.lr_warmup_steps={o.lr_warmup_steps} and {key}.lr_warmup_ratio={o.lr_warmup_ratio} "
                          "are two ways to say the same thing: give one of them")
    if o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"{key}.min_lr={o.min_lr} must be in [0, {key}.lr={o.lr}]")
    if not 0 <= o.lr_warmup_init <= o.lr:
        raise ConfigError(f"{key}.lr_warmup_init={o.lr_warmup_init} must be in [0, {key}.lr={o.lr}]")
    if o.lr_warmup_ratio is not None and not 0 <= o.lr_warmup_ratio < 1:
        raise ConfigError(f"{key}.lr_warmup_ratio={o.lr_warmup_ratio} must be in [0, 1)")
    if o.lr_warmup_steps is not None and o.lr_warmup_steps < 0:
        raise ConfigError(f"{key}.lr_warmup_steps={o.lr_warmup_steps} must not be negative")
    total = lr_schedule.run_optimizer_steps(cfg, cfg.actor if role == "actor" else resolved_critic(cfg))
    schedule = lr_schedule.role_schedule(cfg, role)
    if o.lr_decay_steps is not None and o.lr_decay_steps < 1:
        raise ConfigError(f"{key}.lr_decay_steps={o.lr_decay_steps} must be positive")
    if schedule.warmup_steps >= schedule.decay_steps:
        what = (f"{key}.lr_decay_steps={o.lr_decay_steps}" if o.lr_decay_steps is not None else
                f"the run's {total} optimizer steps (trainer.total_steps x ppo_epochs x batch_size / "
                "ppo_mini_batch_size)")
        raise ConfigError(f"{key}: {schedule.warmup_steps} warm-up steps must end before {what}")
