"""verl's command line onto an rlx job spec: ``rlx train JOB.yaml --verl key=value ...``.

verl users launch ``python -m verl.trainer.main_ppo`` with Hydra overrides of verl's
``ppo_trainer.yaml`` / ``ppo_megatron_trainer.yaml``. With ``--verl`` those overrides are read instead of
rlx's: each verl key maps onto one or more rlx keys, keeping verl's meaning where the two differ
(``MAPPING`` below, one row a key). The positional JOB.yaml is still the base spec (pools, device,
reward function, everything verl's keys do not say); the mapped keys are applied on top of it, in the
order given. Keys with no rlx counterpart are named together, in one sentence, before anything starts.

Where verl's meaning differs, the translation keeps verl's:
- verl counts its lr warm-up/decay steps in TRAINING steps (its scheduler steps once per step); rlx in
  optimizer steps, so the step counts are multiplied by the optimizer steps of one training step.
- verl's ``vanilla`` policy loss is PPO clip with the dual clip built in: rlx's ``dual_clip``. It is
  verl's default, so with --verl the policy loss is dual_clip unless loss_mode says otherwise.
- verl's KL loss is off unless ``use_kl_loss=True``: with --verl, actor.loss.kl_coeff is 0 unless it is.
- verl colocates every role on all n_gpus_per_node x nnodes GPUs; rlx cannot colocate the actor and the
  rollout yet, so the GPUs are split in two equal pools (actor: actor, reference, critic; rollout).
- ``trainer.total_epochs`` needs the dataset's size: counted from data.train_files when they are here
  (verl drops the last partial batch of an epoch, as rlx's loader).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from rlcore.config import JobConfig, TrainerConfig
from rlcore.job import ConfigError, load_job
from rlcore.lr_schedule import optimizer_steps_per_step

AR = "actor_rollout_ref"


class Unmappable(Exception):
    """This verl key (or this value of it) has no rlx counterpart; the message says why."""


@dataclass
class Row:
    """One verl override and what it became: rlx key -> value, and a note where meaning was translated."""
    verl_key: str
    verl_value: Any
    rlx: dict[str, Any] = field(default_factory=dict)
    note: str = ""


# ---------------------------------------------------------------------------------- values
def parse_value(text: str) -> Any:
    """A Hydra override's value: bools, null, numbers, [a,b] lists, quoted or bare strings."""
    t = text.strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    if t.lower() in ("null", "none", "~"):
        return None
    if t.startswith("[") and t.endswith("]"):
        inner = t[1:-1].strip()
        return [parse_value(x) for x in inner.split(",")] if inner else []
    for kind in (int, float):
        try:
            return kind(t)
        except ValueError:
            pass
    return t


def format_value(value: Any) -> str:
    """A value as an rlx ``key=value`` override's YAML (JSON is YAML)."""
    return json.dumps(value)


# --------------------------------------------------------------------------- value mappings
KL_ESTIMATORS = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
LOSS_MODES = {"vanilla": "dual_clip", "geo_mean": "gmpo", "gspo": "gspo", "gpg": "gpg", "clip_cov": "clip_cov",
              "kl_cov": "kl_cov", "cispo": "cispo", "sapo": "sapo"}
DECAY_STYLES = {"constant": "constant", "linear": "linear", "cosine": "cosine"}
LOGGERS = {"console": "console", "wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow", "file": "jsonl"}


def _choice(table: dict, what: str) -> Callable[[Any], Any]:
    def pick(value):
        if value not in table:
            raise Unmappable(f"{what} {value!r} has no rlx counterpart (rlx takes {', '.join(sorted(table))})")
        return table[value]
    return pick


def _files(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _never_if_negative(value):
    return 0 if value is None or value <= 0 else value


def _same(value):
    return value


def _trainer_has(name: str) -> bool:
    return any(f.name == name for f in dataclasses.fields(TrainerConfig))


# verl key -> (rlx key(s), value function, note). The value function may raise Unmappable.
Simple = tuple[tuple[str, ...], Callable[[Any], Any], str]


def _optim_rows(verl: str, rlx: str) -> dict[str, Simple]:
    return {
        f"{verl}.lr": ((f"{rlx}.lr",), float, ""),
        f"{verl}.weight_decay": ((f"{rlx}.weight_decay",), float, ""),
        f"{verl}.clip_grad": ((f"{rlx}.clip_grad",), float, ""),
        f"{verl}.lr_warmup_init": ((f"{rlx}.lr_warmup_init",), float, ""),
        f"{verl}.min_lr": ((f"{rlx}.min_lr",), float, ""),
        f"{verl}.lr_decay_style": ((f"{rlx}.lr_decay_style",), _choice(DECAY_STYLES, "lr_decay_style"), ""),
        f"{verl}.warmup_style": ((f"{rlx}.lr_decay_style",), _choice(DECAY_STYLES, "warmup_style"),
                                 "verl's FSDP name of the schedule after warm-up"),
        f"{verl}.lr_scheduler_type": ((f"{rlx}.lr_decay_style",), _choice(DECAY_STYLES, "lr_scheduler_type"), ""),
        f"{verl}.use_checkpoint_opt_param_scheduler": ((f"{rlx}.lr_schedule_from_checkpoint",), bool, ""),
    }


SIMPLE: dict[str, Simple] = {
    "algorithm.adv_estimator": (("algorithm.adv_estimator",), str, ""),
    "algorithm.gamma": (("algorithm.gamma",), float, ""),
    "algorithm.lam": (("algorithm.lam",), float, ""),
    "algorithm.norm_adv_by_std_in_grpo": (("algorithm.norm_adv_by_std",), bool, ""),
    "algorithm.use_kl_in_reward": (("algorithm.kl_in_reward",), bool, ""),
    "algorithm.kl_penalty": (("algorithm.kl_penalty",), _choice(KL_ESTIMATORS, "kl_penalty"), ""),
    "algorithm.kl_ctrl.type": (("algorithm.kl_ctrl.type",), str, ""),
    "algorithm.kl_ctrl.kl_coef": (("algorithm.kl_ctrl.kl_coef",), float, ""),
    "algorithm.kl_ctrl.target_kl": (("algorithm.kl_ctrl.target_kl",), float, ""),
    "algorithm.kl_ctrl.horizon": (("algorithm.kl_ctrl.horizon",), int, ""),
    "algorithm.filter_groups.enable": (("algorithm.dynamic_sampling.enable",), bool, ""),
    "algorithm.filter_groups.max_num_gen_batches": (("algorithm.dynamic_sampling.max_gen_batches",), int, ""),
    "reward_model.overlong_buffer.enable": (("algorithm.overlong_buffer.enable",), bool, ""),
    "reward_model.overlong_buffer.len": (("algorithm.overlong_buffer.len",), int, ""),
    "reward_model.overlong_buffer.penalty_factor": (("algorithm.overlong_buffer.penalty_factor",), float, ""),
    "data.train_files": (("data.train_files",), _files, ""),
    "data.val_files": (("data.val_files",), _files, ""),
    "data.train_batch_size": (("data.batch_size",), int, "prompts per step, as verl's"),
    "data.max_prompt_length": (("data.max_prompt_length",), int, ""),
    "data.max_response_length": (("rollout.max_response_length",), int, ""),
    "data.prompt_key": (("data.prompt_key",), str, ""),
    "data.truncation": ((), _choice({"error": None}, "data.truncation"),
                        "rlx refuses a longer prompt, as verl's error"),
    "data.shuffle": (("data.shuffle",), bool, ""),
    f"{AR}.model.path": (("model.path",), str, ""),
    f"{AR}.actor.ppo_mini_batch_size": (("actor.ppo_mini_batch_size",), int,
                                        "prompts per optimizer step (each with rollout.n samples), as verl's"),
    f"{AR}.actor.ppo_micro_batch_size_per_gpu": (("actor.micro_batch_size",), int,
                                                 "sequences per micro-batch per DP rank"),
    f"{AR}.actor.ppo_epochs": (("actor.ppo_epochs",), int, ""),
    f"{AR}.actor.entropy_coeff": (("actor.loss.entropy_coeff",), float, ""),
    f"{AR}.actor.clip_ratio_c": (("actor.loss.clip_ratio_c",), float, "the dual clip's bound"),
    f"{AR}.actor.loss_agg_mode": (("actor.loss_agg_mode",), str, ""),
    f"{AR}.actor.kl_loss_type": (("actor.loss.kl_estimator",), _choice(KL_ESTIMATORS, "kl_loss_type"), ""),
    f"{AR}.actor.policy_loss.loss_mode": (("actor.loss.policy_loss",), _choice(LOSS_MODES, "policy_loss.loss_mode"),
                                          "verl's vanilla has the dual clip built in: rlx's dual_clip"),
    f"{AR}.actor.policy_loss.clip_cov_ratio": (("actor.loss.clip_cov_ratio",), float, ""),
    f"{AR}.actor.policy_loss.clip_cov_lb": (("actor.loss.clip_cov_lb",), float, ""),
    f"{AR}.actor.policy_loss.clip_cov_ub": (("actor.loss.clip_cov_ub",), float, ""),
    f"{AR}.actor.policy_loss.kl_cov_ratio": (("actor.loss.kl_cov_ratio",), float, ""),
    f"{AR}.actor.policy_loss.ppo_kl_coef": (("actor.loss.kl_cov_coef",), float, ""),
    f"{AR}.actor.megatron.tensor_model_parallel_size": (("actor.tp",), int, ""),
    f"{AR}.actor.megatron.pipeline_model_parallel_size": (("actor.pp",), int, ""),
    f"{AR}.actor.megatron.virtual_pipeline_model_parallel_size": (("actor.vpp",), lambda v: 1 if v is None else int(v),
                                                                  "null: no virtual stages (1)"),
    f"{AR}.actor.megatron.use_distributed_optimizer": (("actor.optim.use_distributed_optimizer",), bool, ""),
    f"{AR}.ref.megatron.tensor_model_parallel_size": (("reference.tp",), int, ""),
    f"{AR}.ref.megatron.pipeline_model_parallel_size": (("reference.pp",), int, ""),
    f"{AR}.ref.megatron.virtual_pipeline_model_parallel_size": (("reference.vpp",),
                                                                lambda v: 1 if v is None else int(v), ""),
    f"{AR}.ref.log_prob_micro_batch_size_per_gpu": (("reference.micro_batch_size",), int, ""),
    f"{AR}.rollout.n": (("rollout.n",), int, ""),
    f"{AR}.rollout.temperature": (("rollout.temperature",), float, ""),
    f"{AR}.rollout.top_p": (("rollout.top_p",), float, ""),
    f"{AR}.rollout.top_k": (("rollout.top_k",), int, ""),
    f"{AR}.rollout.tensor_model_parallel_size": (("rollout.tp",), int, ""),
    f"{AR}.rollout.gpu_memory_utilization": (("rollout.gpu_memory_utilization",), float, ""),
    f"{AR}.rollout.response_length": (("rollout.max_response_length",), int, ""),
    f"{AR}.rollout.enforce_eager": (("rollout.enforce_eager",), bool, ""),
    f"{AR}.rollout.name": ((), _choice({"vllm": None}, "rollout.name"), "rlx's engines are vLLM"),
    "critic.model.path": (("critic.model_path",), str, ""),
    "critic.ppo_mini_batch_size": (("critic.ppo_mini_batch_size",), int, "prompts, as the actor's"),
    "critic.ppo_micro_batch_size_per_gpu": (("critic.micro_batch_size",), int, ""),
    "critic.ppo_epochs": (("critic.ppo_epochs",), int, ""),
    "critic.cliprange_value": (("critic.loss.cliprange_value",), float, ""),
    "critic.loss_agg_mode": (("critic.loss_agg_mode",), str, ""),
    "critic.megatron.tensor_model_parallel_size": (("critic.tp",), int, ""),
    "critic.megatron.pipeline_model_parallel_size": (("critic.pp",), int, ""),
    "critic.megatron.virtual_pipeline_model_parallel_size": (("critic.vpp",), lambda v: 1 if v is None else int(v), ""),
    "trainer.total_training_steps": (("trainer.total_steps",), int, ""),
    "trainer.save_freq": (("trainer.save_every",), _never_if_negative, "-1 (never): 0"),
    "trainer.test_freq": (("trainer.val_every",), _never_if_negative, "-1 (never): 0"),
    "trainer.default_local_dir": (("trainer.checkpoint_dir",), str, ""),
    "trainer.max_actor_ckpt_to_keep": (("trainer.keep_last",), lambda v: 0 if v is None else int(v), "null (all): 0"),
    "trainer.val_before_train": ((), _choice({True: None}, "trainer.val_before_train"),
                                 "rlx validates before step 1 whenever trainer.val_every > 0"),
    "trainer.critic_warmup": ((), _choice({0: None}, "trainer.critic_warmup"), ""),
    "trainer.device": (("resources.device",), _choice({"cuda": "gpu", "cpu": "cpu"}, "trainer.device"), ""),
    **_optim_rows(f"{AR}.actor.optim", "actor.optim"),
    **_optim_rows("critic.optim", "critic.optim"),
}
if _trainer_has("logger"):  # the loggers' list (rlcore/loggers)
    SIMPLE["trainer.logger"] = (("trainer.logger",), lambda v: [_choice(LOGGERS, "trainer.logger entry")(x)
                                                                 for x in _files(v)],
                               "verl's file logger is rlx's jsonl (metrics.jsonl is written either way)")
for _verl, _rlx in (("trainer.project_name", "project_name"), ("trainer.experiment_name", "experiment_name")):
    if _trainer_has(_rlx):
        SIMPLE[_verl] = ((f"trainer.{_rlx}",), str, "")

# Keys whose meaning needs the rest of the spec (the lr step counts, min_lr_ratio, the pools, the
# dataset size, the KL loss switch): read by ``_derived`` after the simple keys are applied.
DERIVED = {f"{AR}.actor.use_kl_loss", f"{AR}.actor.kl_loss_coef", "trainer.n_gpus_per_node", "trainer.nnodes",
           "trainer.total_epochs",
           *(f"{p}.{k}" for p in (f"{AR}.actor.optim", "critic.optim")
             for k in ("lr_warmup_steps", "lr_warmup_steps_ratio", "lr_decay_steps", "min_lr_ratio")),
           f"{AR}.actor.use_dynamic_bsz", f"{AR}.actor.ppo_max_token_len_per_gpu",
           "custom_reward_function.path", "custom_reward_function.name",
           *(f"{AR}.actor.{k}" for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high")),
           "trainer.resume_mode", "trainer.resume_from_path"}
# Keys that only tune verl's memory or speed, with no effect on what rlx computes: accepted, shown.
NO_EFFECT = {
    f"{AR}.model.use_remove_padding": "rlx always cuts micro-batches to their longest row",
    f"{AR}.model.enable_gradient_checkpointing": "not a knob in rlx",
    f"{AR}.rollout.log_prob_micro_batch_size_per_gpu": "rlx's log-prob pass uses actor.micro_batch_size",
    f"{AR}.rollout.mode": "rlx drives its engines itself",
    f"{AR}.actor.megatron.param_offload": "no offloading in rlx",
    f"{AR}.actor.megatron.grad_offload": "no offloading in rlx",
    f"{AR}.actor.megatron.optimizer_offload": "no offloading in rlx",
    f"{AR}.ref.megatron.param_offload": "no offloading in rlx",
    "critic.megatron.param_offload": "no offloading in rlx",
    "data.val_batch_size": "rlx validates every prompt at once",
    "data.return_raw_chat": "rlx applies the chat template itself (data.apply_chat_template)",
    # Not silent: a prompt over data.max_prompt_length stops rlx before start, naming its row.
    "data.filter_overlong_prompts": "rlx refuses (names) a prompt longer than data.max_prompt_length instead of "
                                    "dropping it",
}


def _key(text: str) -> str:
    return text.lstrip("+")  # Hydra's +key / ++key (add / force-add)


def _parse(overrides: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--verl override {item!r} is not of the form verl.key=value")
        out.append((_key(key.strip()), parse_value(value)))
    return out


# -------------------------------------------------------------------------------- the mapping
def translate(job: Optional[str], verl_overrides: list[str]) -> tuple[JobConfig, list[Row]]:
    """The job spec ``job`` with ``verl_overrides`` applied, and what each verl key became. Every verl
    key that cannot be mapped is named in the one ConfigError raised."""
    given = _parse(verl_overrides)
    rows, problems = [], []
    values = dict(given)  # the last value of each key wins, as in Hydra
    for key, value in given:
        row = Row(key, value)
        try:
            if key in SIMPLE:
                rlx_keys, convert, row.note = SIMPLE[key]
                converted = convert(value)
                row.rlx = {k: converted for k in rlx_keys}
            elif key in NO_EFFECT:
                row.note = f"no effect: {NO_EFFECT[key]}"
            elif key not in DERIVED:
                raise Unmappable("no rlx counterpart")
        except (Unmappable, TypeError, ValueError) as e:
            problems.append(f"{key}={value!r} ({e})")
        rows.append(row)
    # verl's defaults where rlx's differ in kind: no KL loss unless asked, the dual clip in vanilla.
    defaults = Row("(verl defaults)", None, note="verl: no KL loss unless use_kl_loss=True; vanilla = dual clip")
    if f"{AR}.actor.policy_loss.loss_mode" not in values:
        defaults.rlx["actor.loss.policy_loss"] = "dual_clip"
    rows.append(defaults)
    if problems:
        raise ConfigError(f"--verl: {len(problems)} verl key(s) have no rlx mapping: {'; '.join(problems)}")
    overrides = [f"{k}={format_value(v)}" for r in rows for k, v in r.rlx.items()]
    cfg = load_job(job, overrides)
    derived, problems = _derived(cfg, values)
    for row in rows:
        if row.verl_key in derived:
            row.rlx, note = derived[row.verl_key]
            row.note = row.note or note
    kl = derived.get("(kl)")
    if kl is not None:
        defaults.rlx.update(kl[0])
    if problems:
        raise ConfigError(f"--verl: {len(problems)} verl key(s) have no rlx mapping: {'; '.join(problems)}")
    overrides = [f"{k}={format_value(v)}" for r in rows for k, v in r.rlx.items() if k != "resources.pools"]
    cfg = load_job(job, overrides)
    pools = next((r.rlx["resources.pools"] for r in rows if "resources.pools" in r.rlx), None)
    if pools is not None:  # replaces the base spec's pools (a dotted override would merge into them)
        cfg.resources.pools = pools
    return cfg, rows


def _derived(cfg: JobConfig, values: dict[str, Any]) -> tuple[dict[str, tuple[dict, str]], list[str]]:
    """The rlx values of the keys that need the rest of the spec; (verl key -> (rlx dict, note)), problems."""
    out: dict[str, tuple[dict, str]] = {}
    problems: list[str] = []
    # The KL loss: verl's is off unless use_kl_loss=True, whatever kl_loss_coef says.
    use_kl = values.get(f"{AR}.actor.use_kl_loss", False)
    coef = values.get(f"{AR}.actor.kl_loss_coef", 0.001)
    out["(kl)"] = ({"actor.loss.kl_coeff": float(coef) if use_kl else 0.0}, "")
    for key in (f"{AR}.actor.use_kl_loss", f"{AR}.actor.kl_loss_coef"):
        if key in values:
            out[key] = ({"actor.loss.kl_coeff": float(coef) if use_kl else 0.0},
                        "" if use_kl else "use_kl_loss is not True: no KL loss (kl_coeff 0)")
    # The lr schedule, in verl's training steps -> rlx's optimizer steps.
    for verl, rlx, role_cfg in ((f"{AR}.actor.optim", "actor.optim", cfg.actor),
                                ("critic.optim", "critic.optim", _critic(cfg))):
        per_step = optimizer_steps_per_step(cfg, role_cfg)
        note = f"verl counts training steps; x{per_step} optimizer steps per step"
        steps = values.get(f"{verl}.lr_warmup_steps")
        if steps is not None and steps > 0:
            out[f"{verl}.lr_warmup_steps"] = ({f"{rlx}.lr_warmup_steps": int(steps) * per_step}, note)
        elif steps is not None:
            out[f"{verl}.lr_warmup_steps"] = ({}, "-1: verl's warm-up comes from lr_warmup_steps_ratio")
        ratio = values.get(f"{verl}.lr_warmup_steps_ratio")
        if ratio is not None:
            if steps is not None and steps > 0:
                out[f"{verl}.lr_warmup_steps_ratio"] = ({}, "unused: lr_warmup_steps > 0 wins, as in verl")
            else:
                out[f"{verl}.lr_warmup_steps_ratio"] = ({f"{rlx}.lr_warmup_ratio": float(ratio)},
                                                        "the same fraction of the run's optimizer steps")
        decay = values.get(f"{verl}.lr_decay_steps")
        if f"{verl}.lr_decay_steps" in values:
            out[f"{verl}.lr_decay_steps"] = (
                {f"{rlx}.lr_decay_steps": None if decay is None else int(decay) * per_step},
                note if decay is not None else "null: the run's last step")
        if f"{verl}.min_lr_ratio" in values:
            lr = role_cfg.optim.lr
            r = values[f"{verl}.min_lr_ratio"]
            out[f"{verl}.min_lr_ratio"] = ({f"{rlx}.min_lr": 0.0 if r is None else float(r) * lr},
                                           f"verl's min_lr = lr x min_lr_ratio (lr {lr:g})")
    # Token-budget micro-batches.
    if values.get(f"{AR}.actor.use_dynamic_bsz"):
        budget = int(values.get(f"{AR}.actor.ppo_max_token_len_per_gpu", 16384))
        out[f"{AR}.actor.use_dynamic_bsz"] = ({"actor.max_tokens_per_micro_batch": budget},
                                              "rlx's budget counts rows x the longest row, verl's real tokens")
        if f"{AR}.actor.ppo_max_token_len_per_gpu" in values:
            out[f"{AR}.actor.ppo_max_token_len_per_gpu"] = ({}, "see use_dynamic_bsz")
    else:
        for key in (f"{AR}.actor.use_dynamic_bsz", f"{AR}.actor.ppo_max_token_len_per_gpu"):
            if key in values:
                out[key] = ({}, "no effect: use_dynamic_bsz is not True")
    # GPUs -> two pools.
    gpn, nodes = values.get("trainer.n_gpus_per_node"), values.get("trainer.nnodes")
    if gpn is not None or nodes is not None:
        gpn = int(gpn if gpn is not None else cfg.resources.gpus_per_node or sum(cfg.resources.pools.values()))
        nodes = int(nodes if nodes is not None else cfg.resources.nodes)
        total = gpn * nodes
        if total % 2 or (total // 2) % cfg.rollout.tp:
            problems.append(f"trainer.n_gpus_per_node x trainer.nnodes={total} (rlx splits verl's GPUs into "
                            f"equal actor and rollout pools: needs an even total whose half divides by the "
                            f"rollout tp {cfg.rollout.tp}; set resources.pools in the base spec instead)")
        else:
            half = total // 2
            mapped = {"resources.pools": {"actor": half, "rollout": half}, "actor.pool": "actor",
                      "rollout.pool": "rollout", "critic.pool": "actor", "reference.pool": "actor",
                      "rollout.engines": half // cfg.rollout.tp, "resources.gpus_per_node": gpn,
                      "resources.nodes": nodes}
            note = ("verl colocates every role on all GPUs; rlx cannot colocate actor and rollout: "
                    f"{half} GPUs each (engines = {half} / rollout tp {cfg.rollout.tp})")
            key = "trainer.n_gpus_per_node" if "trainer.n_gpus_per_node" in values else "trainer.nnodes"
            out[key] = (mapped, note)
            other = "trainer.nnodes" if key == "trainer.n_gpus_per_node" else None
            if other in values:
                out[other] = ({}, "see trainer.n_gpus_per_node")
    # The clip bounds: verl's clip_ratio_low/high are 0.2 each in its yaml; clip_ratio only fills one set to null.
    eps = values.get(f"{AR}.actor.clip_ratio")
    for side in ("low", "high"):
        key = f"{AR}.actor.clip_ratio_{side}"
        if key in values:
            bound = values[key] if values[key] is not None else eps
            if bound is None:
                problems.append(f"{key}=None (null needs {AR}.actor.clip_ratio to fill it)")
            else:
                out[key] = ({f"actor.loss.clip_ratio_{side}": float(bound)},
                            "" if values[key] is not None else "null: verl's clip_ratio")
    if f"{AR}.actor.clip_ratio" in values:
        out[f"{AR}.actor.clip_ratio"] = ({}, "verl's bounds are clip_ratio_low/high (0.2 each unless given); "
                                         "clip_ratio only fills one given as null")
    # Resuming: verl's auto (the newest checkpoint of default_local_dir) | disable | resume_path (resume_from_path).
    if "trainer.resume_mode" in values or "trainer.resume_from_path" in values:
        mode, path = values.get("trainer.resume_mode", "auto"), values.get("trainer.resume_from_path")
        if mode == "resume_path" and path:
            out["trainer.resume_mode"] = ({"trainer.resume": str(path)},
                                          "the checkpoint trainer.resume_from_path names")
        elif mode in ("auto", "disable"):
            out["trainer.resume_mode"] = ({"trainer.resume": "auto" if mode == "auto" else "never"}, "")
        else:
            problems.append(f"trainer.resume_mode={mode!r} (rlx takes auto, disable, or resume_path with "
                            "trainer.resume_from_path)")
        if "trainer.resume_from_path" in values:
            out["trainer.resume_from_path"] = ({}, "used by resume_mode=resume_path only, as in verl")
    # The reward function: verl's file + function name -> rlx's "file.py:function".
    if "custom_reward_function.path" in values:
        fn = values.get("custom_reward_function.name") or "compute_score"  # verl's default name
        out["custom_reward_function.path"] = ({"reward.function": f"{values['custom_reward_function.path']}:{fn}"},
                                              "rlx calls it as verl does: fn(data_source, solution_str, "
                                              "ground_truth, extra_info)")
        if "custom_reward_function.name" in values:
            out["custom_reward_function.name"] = ({}, "see custom_reward_function.path")
    elif "custom_reward_function.name" in values:
        problems.append(f"custom_reward_function.name={values['custom_reward_function.name']!r} (without "
                        "custom_reward_function.path it names no file)")
    # Epochs -> steps.
    if "trainer.total_epochs" in values:
        if "trainer.total_training_steps" in values and values["trainer.total_training_steps"] is not None:
            out["trainer.total_epochs"] = ({}, "unused: total_training_steps wins, as in verl")
        else:
            try:
                rows = sum(_count_rows(f) for f in cfg.data.train_files)
            except (OSError, ValueError) as e:
                problems.append(f"trainer.total_epochs={values['trainer.total_epochs']!r} (the steps need the "
                                f"dataset's size, and data.train_files cannot be read here: {e}; give "
                                "trainer.total_training_steps)")
            else:
                epochs, per_epoch = int(values["trainer.total_epochs"]), rows // cfg.data.batch_size
                out["trainer.total_epochs"] = ({"trainer.total_steps": epochs * per_epoch},
                                               f"{rows} prompts // {cfg.data.batch_size} a step x {epochs} epochs")
    return out, problems


def _critic(cfg: JobConfig):
    from rlcore.config import resolved_critic

    return resolved_critic(cfg)


def _count_rows(path: str) -> int:
    """Prompts in one data file (parquet or jsonl) without loading them."""
    if not os.path.isfile(path):
        raise OSError(f"{path} is not a file on this machine")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def format_mapping(rows: list[Row]) -> str:
    """One line a verl key: ``verl.key=value -> rlx.key=value, ...  # note``."""
    lines = ["verl key -> rlx key(s)"]
    for r in rows:
        defaults_row = r.verl_value is None and r.verl_key.startswith("(")
        left = r.verl_key if defaults_row else f"{r.verl_key}={format_value(r.verl_value)}"
        right = ", ".join(f"{k}={format_value(v)}" for k, v in r.rlx.items()) or "-"
        lines.append(f"  {left} -> {right}" + (f"  # {r.note}" if r.note else ""))
    return "\n".join(lines)


def mapped_keys() -> list[str]:
    """Every verl key this module reads (for the tests and the README)."""
    return sorted(set(SIMPLE) | DERIVED | set(NO_EFFECT))




# ------------------------------------------------------------------------------------ the CLI
def add_verl_flag(parser) -> None:
    parser.add_argument("--verl", action="store_true",
                        help="the overrides are verl main_ppo keys (actor_rollout_ref.rollout.n=8 ...), mapped onto "
                             "rlx keys on top of JOB; the mapping is printed (README: Coming from verl)")


def load_verl_job(args) -> JobConfig:
    """``rlx <command> JOB --verl ...``: the translated spec; the mapping goes to stdout first. ``submit``
    then submits the resolved spec (written next to the run) instead of the verl keys."""
    cfg, rows = translate(args.job, args.overrides)
    print(format_mapping(rows))
    if args.command == "submit":
        from omegaconf import OmegaConf

        os.makedirs(cfg.trainer.run_dir, exist_ok=True)
        path = os.path.join(cfg.trainer.run_dir, "verl_job.yaml")
        with open(path, "w") as f:
            f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        print(f"the translated spec: {path}")
        args.job, args.overrides = path, []
    return cfg
