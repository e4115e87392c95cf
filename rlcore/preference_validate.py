"""Validating a preference job (algorithm.type dpo | rm): what ``rlcore.validate.validate`` checks for
an RL job, for the roles a preference job has (the trained actor, the reference when the objective
needs it, a rollout pool only for DPO's greedy validation), each failure one ``ConfigError`` sentence
naming the key.

Micro-batches must hold whole pairs (rows 2i, 2i+1): the losses read a micro-batch's pairs. So the
actor's micro_batch_size is even and its micro-batches are by rows (token-budget micro-batches sort
rows by length and would split pairs; shared_prompt is refused with them, as it has not been checked on
pairs). The forward-only reference scores rows one by one, so any split of its own suits it.
"""
from __future__ import annotations

import math
from typing import Optional

from rlcore.config import JobConfig
from rlcore.job import ConfigError
from rlcore.layout import check_micro_batches, check_model_split
from rlcore.preference_losses import DPO_LOSS_TYPES, PREFERENCE_OBJECTIVES, algorithm_types


def validate_preference(cfg: JobConfig, require_files: Optional[bool] = None):
    from rlcore import validate as v

    if require_files is None:
        require_files = not v.for_another_machine(cfg)
    v._one_of("algorithm.type", cfg.algorithm.type, algorithm_types())
    objective = PREFERENCE_OBJECTIVES.meta(cfg.algorithm.type)
    v._check_ranges(cfg)
    v._check_names(cfg)
    if cfg.algorithm.type == "dpo":
        _check_dpo(cfg)
    if cfg.algorithm.type == "rm":
        _check_rm(cfg)
    device = v._resolve_device(cfg.resources.device)
    dtype = v._resolve_dtype(cfg.model.dtype, device)
    model = v._read_model(cfg.model.path, None if require_files else cfg.model.hf_config)
    greedy = cfg.algorithm.type == "dpo" and bool(cfg.algorithm.dpo.greedy_val_files)
    _check_pools(cfg, objective.needs_reference, greedy)
    v._check_checkpointable(cfg, device)

    a, kind = cfg.actor, cfg.algorithm.type
    for key, on in (("actor.max_tokens_per_micro_batch", a.max_tokens_per_micro_batch is not None),
                    ("actor.shared_prompt", a.shared_prompt)):
        if on:
            raise ConfigError(f"{key} is not supported with algorithm.type={kind}: its micro-batches must hold "
                              "whole (chosen, rejected) pairs in consecutive rows; use micro-batches of "
                              "actor.micro_batch_size rows")
    if a.micro_batch_size % 2:
        raise ConfigError(f"actor.micro_batch_size={a.micro_batch_size} must be even with algorithm.type={kind}: "
                          "a micro-batch holds whole pairs (each pair is a chosen and a rejected row)")
    v._check_mini_batch("actor", a.ppo_mini_batch_size, cfg.data.batch_size)
    actor = v._role_layout(cfg, "actor", a.pool, a.tp, a.pp, a.vpp, a.pp_layers)
    check_model_split(model, actor.tp, actor.pp, actor.vpp, "actor", pp_layers=actor.pp_layers)
    key, pairs = v._prompts(cfg, a.ppo_mini_batch_size, "actor")
    check_micro_batches("actor", actor, f"2*{key}=2*{pairs}", 2 * pairs,
                        "actor.micro_batch_size", a.micro_batch_size, "actor.vpp")

    reference = _reference_layout(cfg, model, actor) if objective.needs_reference else None
    rollout = v._rollout_layout(cfg, model, device) if greedy else None
    _check_data(cfg, model, require_files, greedy)
    v.check_lr_schedule(cfg, "actor")
    if greedy:
        from rlcore.reward import RewardError, load_reward_fn

        try:
            load_reward_fn(cfg.reward.function)
        except RewardError as e:
            raise ConfigError(str(e)) from e
    return v.JobLayout(actor=actor, reference=reference, rollout=rollout, device=device,
                       total_gpus=sum(cfg.resources.pools.values()), dtype=dtype, host_malloc=v.host_malloc(cfg),
                       host_hugepages=cfg.resources.host_hugepages)


def _check_dpo(cfg: JobConfig) -> None:
    d = cfg.algorithm.dpo
    if not d.beta > 0:
        raise ConfigError(f"algorithm.dpo.beta={d.beta} must be positive")
    if d.loss_type not in DPO_LOSS_TYPES:
        raise ConfigError(f"algorithm.dpo.loss_type={d.loss_type!r} is not one of: {', '.join(DPO_LOSS_TYPES)}")
    if not 0 <= d.label_smoothing < 0.5:
        raise ConfigError(f"algorithm.dpo.label_smoothing={d.label_smoothing} must be in [0, 0.5)")
    if d.sft_coeff < 0:
        raise ConfigError(f"algorithm.dpo.sft_coeff={d.sft_coeff} must not be negative")
    if d.label_smoothing and d.loss_type != "sigmoid":
        raise ConfigError(f"algorithm.dpo.label_smoothing={d.label_smoothing} applies to loss_type=sigmoid only, "
                          f"not {d.loss_type}; set it to 0")


def _check_rm(cfg: JobConfig) -> None:
    r = cfg.algorithm.rm
    if not math.isfinite(r.margin):
        raise ConfigError(f"algorithm.rm.margin={r.margin} must be a finite number")
    if not (math.isfinite(r.center_coeff) and r.center_coeff >= 0):
        raise ConfigError(f"algorithm.rm.center_coeff={r.center_coeff} must be >= 0")


def _check_pools(cfg: JobConfig, reference: bool, rollout: bool) -> None:
    pools = cfg.resources.pools
    if not pools:
        raise ConfigError("resources.pools is empty; name at least the actor's pool")
    for name, size in pools.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"resources.pools.{name}={size!r} must be an integer >= 1 (GPUs in the pool)")
    roles = {"actor.pool": cfg.actor.pool}
    if reference and cfg.reference.pool is not None:
        roles["reference.pool"] = cfg.reference.pool
    if rollout:
        roles["rollout.pool"] = cfg.rollout.pool
    for key, pool in roles.items():
        if pool not in pools:
            raise ConfigError(f"{key}={pool!r} is not a pool in resources.pools (pools: {', '.join(pools)})")
    for key in ("actor.pool", "reference.pool"):
        if rollout and roles.get(key) == cfg.rollout.pool:
            raise ConfigError(f"{key} and rollout.pool are both {cfg.rollout.pool!r}: colocating them on one pool "
                              "is not supported yet")


def _reference_layout(cfg: JobConfig, model, actor):
    from rlcore import validate as v

    ref, a = cfg.reference, cfg.actor
    inherited = tuple(k for k in ("tp", "pp", "vpp") if getattr(ref, k) is None)
    pp_layers = ref.pp_layers
    if pp_layers is None and ref.pp is None:
        pp_layers, inherited = a.pp_layers, inherited + ("pp_layers",)
    layout = v._role_layout(cfg, "reference", v._default(ref.pool, a.pool), v._default(ref.tp, a.tp),
                            v._default(ref.pp, a.pp), v._default(ref.vpp, a.vpp), pp_layers,
                            defaulted=ref.pool is None and ref.tp is None and ref.pp is None)
    check_model_split(model, layout.tp, layout.pp, layout.vpp, "reference", inherited, pp_layers=layout.pp_layers)
    # Its own micro-batch shape; the actor's is refused above, so it inherits nothing here.
    if ref.max_tokens_per_micro_batch is not None or ref.shared_prompt:
        v._check_micro_batch_shapes(cfg, "reference", layout)
    budget = ref.max_tokens_per_micro_batch
    rows = 2 * cfg.data.batch_size
    if budget:
        if rows % layout.dp:
            raise ConfigError(f"2*data.batch_size={rows} rows do not split evenly over the reference's "
                              f"dp={layout.dp} ranks")
    else:
        check_micro_batches("reference", layout, f"2*data.batch_size=2*{cfg.data.batch_size}", rows,
                            v._key("reference", "micro_batch_size", ref.micro_batch_size is None),
                            v._default(ref.micro_batch_size, a.micro_batch_size), v._key("reference", "vpp", ref.vpp is None))
    layout.host = v.reference_host(cfg, actor, layout)
    return layout


def _check_data(cfg: JobConfig, model, require_files: bool, greedy: bool) -> None:
    from rlcore import validate as v

    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty; give at least one .parquet or .jsonl file of preference pairs")
    v._check_files("data.train_files", cfg.data.train_files, require_files)
    v._check_files("data.val_files", cfg.data.val_files, require_files)
    if greedy:
        v._check_files("algorithm.dpo.greedy_val_files", cfg.algorithm.dpo.greedy_val_files, require_files)
    total = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if total > model.max_position_embeddings:
        raise ConfigError(f"data.max_prompt_length+rollout.max_response_length={cfg.data.max_prompt_length}+"
                          f"{cfg.rollout.max_response_length}={total} exceeds the model's max_position_embeddings="
                          f"{model.max_position_embeddings} ({model.source}); rollout.max_response_length bounds "
                          "the completions")
