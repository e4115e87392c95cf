"""The training loop: one controller process drives the roles through small interfaces.

    prompts -> rollout pool (vLLM) -> trajectories -> rewards -> old/ref log-probs, values (Megatron)
            -> advantages (here, plain torch) -> critic and actor updates (Megatron) -> weight sync -> metrics
"""
from __future__ import annotations

import dataclasses
import os
import time

import torch

from rlcore.algos import (ADV_ESTIMATORS, AdvantageInputs, apply_kl_penalty, compute_advantages,
                          explained_variance, groups_with_variance, kl_controller,
                          last_token_rewards, loss_weights, overlong_penalty)
from rlcore import checkpoint
from rlcore.batch import Batch, Trajectory
from rlcore.config import JobConfig, resolved_critic
from rlcore.data import PromptItem, PromptLoader, load_datasets
from rlcore.validate import JobLayout
from rlcore.metrics import MetricsLogger, timer
from rlcore.placement import ResourcePools, start_ray
from rlcore.reward import RewardError, compute_rewards, load_reward_fn
from rlcore.weight_sync import connect_weight_sync, sync_weights


class SamplingError(RuntimeError):
    """Dynamic sampling could not fill a batch: a property of the data and the policy, not a bug."""


class Trainer:
    def __init__(self, cfg: JobConfig, layout: JobLayout):
        from transformers import AutoTokenizer

        from megatron_workers import MegatronGroup
        from rollout import RolloutPool

        self.cfg, self.layout = cfg, layout
        checkpoint.seed_everything(cfg.trainer.seed)  # python, numpy, torch
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        # Padding sits right of every real token under a causal mask, so its id never matters.
        self.pad_id = next(i for i in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0) if i is not None)
        self.reward_fn = load_reward_fn(cfg.reward.function)
        train, self.val_set = load_datasets(cfg.data, self.tokenizer)  # before Ray: bad rows fail fast
        self.loader = PromptLoader(train, cfg.data.batch_size, cfg.data.shuffle, cfg.trainer.seed)
        dtype = layout.dtype

        start_ray(layout.device, layout.total_gpus, cfg.resources.ray_address, cfg.resources.num_cpus)
        roles = {"actor": layout.actor.pool, "rollout": layout.rollout.pool}
        if layout.reference:
            roles["reference"] = layout.reference.pool
        if layout.critic:
            roles["critic"] = layout.critic.pool
        self.pools = ResourcePools(cfg.resources.pools, roles)

        def megatron_group(role, lay, micro_batch_size, optim, model_path=cfg.model.path):
            return MegatronGroup(role, model_path, lay.tp, lay.pp, lay.dp, self.pools.placement(role),
                                 micro_batch_size, layout.device, dtype, optim, cfg.trainer.seed, vpp=lay.vpp)

        a = cfg.actor
        self.actor = megatron_group("actor", layout.actor, a.micro_batch_size, a.optim)
        self.reference = (megatron_group("reference", layout.reference,
                                         cfg.reference.micro_batch_size or a.micro_batch_size, None)
                          if layout.reference else None)
        c = cfg.critic  # PPO's value model: only when the advantage estimator needs values
        self.critic = (megatron_group("critic", layout.critic, c.micro_batch_size, c.optim,
                                      c.model_path or cfg.model.path) if layout.critic else None)
        self.critic_loss_cfg = c.loss
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon) if cfg.algorithm.kl_in_reward else None
        self.rollout = RolloutPool(cfg.model.path, cfg.rollout, self.pools.placement("rollout"),
                                   layout.device, dtype, cfg.trainer.seed)
        self.loss_cfg = a.loss
        self.version = 0  # the engines start from the same HF checkpoint as the actor
        connect_weight_sync(self.actor, self.rollout, cfg.rollout.engines, cfg.rollout.bucket_mb * 1024 ** 2, dtype,
                            cfg.rollout.weight_transport)

    # ------------------------------------------------------------------------------ the iteration
    def fit(self) -> list[dict]:
        t = self.cfg.trainer
        history = []
        # Before the logger opens metrics.jsonl: resuming drops the lines of steps it will redo.
        start = checkpoint.resume(self)  # the step to continue after; 0 on a fresh start
        logger = MetricsLogger(t.run_dir, t.total_steps, t.tensorboard)
        try:
            if self.val_set is not None and t.val_every and start == 0:
                logger.log(0, self.validate())
            for step in range(start + 1, t.total_steps + 1):
                metrics = self.train_step(step)
                if self.val_set is not None and t.val_every and step % t.val_every == 0:
                    metrics.update(self.validate())
                logger.log(step, metrics)
                history.append(metrics)
                checkpoint.maybe_save(self, step)
        finally:
            logger.close()
        return history

    def train_step(self, step: int) -> dict[str, float]:
        cfg, m = self.cfg, {}
        temperature = cfg.rollout.temperature
        t0 = time.perf_counter()
        prompts, trajs, scores = self.sample(step, m)  # timed inside: rollout and reward
        batch = build_batch(trajs, self.pad_id)
        with timer("logprob", m):
            batch["old_logprobs"] = (batch["rollout_logprobs"] if cfg.actor.use_rollout_logprobs
                                     else self.actor.compute_logprobs(batch, temperature))
            if self.reference is not None:
                batch["ref_logprobs"] = self.reference.compute_logprobs(batch, temperature)
        if self.critic is not None:
            with timer("values", m):
                batch["values"] = self.critic.compute_values(batch)
        with timer("advantages", m):
            m.update(self.compute_advantages(batch, prompts, trajs, scores))
        if self.critic is not None:
            with timer("critic_update", m):
                batch["old_values"] = batch["values"]  # the anchor of the clipped value loss
                m.update(self.train_role(self.critic, batch, self.critic_loss_cfg, resolved_critic(cfg)))
        with timer("update", m):
            m.update(self.train_role(self.actor, batch, self.loss_cfg, cfg.actor, temperature))
        with timer("weight_sync", m):
            self.version += 1
            sync_weights(self.actor, self.rollout, self.version, check=cfg.rollout.check_weights)
        m.update(batch_metrics(batch, trajs, scores))
        m.update({"weights/version": float(self.version), "timing/step_s": time.perf_counter() - t0})
        return m

    # ---------------------------------------------------------------------------------- phases
    def sample(self, step: int, m: dict) -> tuple[list[PromptItem], list[Trajectory], torch.Tensor]:
        """One batch of prompts, their rollout.n responses each and their scores.

        With DAPO's dynamic sampling, groups whose samples all scored the same (no group-relative
        signal) are dropped and more prompts are drawn until data.batch_size groups are kept."""
        cfg, ds = self.cfg, self.cfg.algorithm.dynamic_sampling
        prompts: list[PromptItem] = []
        trajs: list[Trajectory] = []
        scores: list[torch.Tensor] = []
        for draw in range(1, (ds.max_gen_batches if ds.enable else 1) + 1):
            drawn: list[PromptItem] = next(self.loader)
            with timer("rollout", m):
                new = self.rollout.generate([p.prompt_ids for p in drawn], n=cfg.rollout.n,
                                            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                            top_k=cfg.rollout.top_k, max_tokens=cfg.rollout.max_response_length,
                                            seed=cfg.trainer.seed * 100_003 + step + 1_000_000 * (draw - 1))
            with timer("reward", m):
                new_scores, reward_metrics = self.score(drawn, new, step)
            if draw == 1:  # what the policy scores on a plain batch, before any filtering
                m.update(reward_metrics)
            new_scores = new_scores + self.shaping(new, m)
            if not ds.enable:
                return drawn, new, new_scores
            keep = groups_with_variance(new_scores, torch.tensor([t.prompt_index for t in new]))
            kept_prompts = sorted({t.prompt_index for t, k in zip(new, keep) if k})
            renumber = {old: len(prompts) + i for i, old in enumerate(kept_prompts)}
            prompts += [drawn[i] for i in kept_prompts]
            trajs += [dataclasses.replace(t, prompt_index=renumber[t.prompt_index]) for t, k in zip(new, keep) if k]
            scores.append(new_scores[keep])
            m["dynamic_sampling/gen_batches"] = float(draw)
            if len(prompts) >= cfg.data.batch_size:
                n_keep = cfg.data.batch_size * cfg.rollout.n  # trajectories are grouped by prompt, in order
                return prompts[:cfg.data.batch_size], trajs[:n_keep], torch.cat(scores)[:n_keep]
        raise SamplingError(
            f"step {step}: dynamic sampling kept {len(prompts)} of the data.batch_size={cfg.data.batch_size} "
            f"prompts after algorithm.dynamic_sampling.max_gen_batches={ds.max_gen_batches} generation rounds "
            f"(the others' {cfg.rollout.n} samples all scored the same); raise max_gen_batches or rollout.n")

    def shaping(self, trajs: list[Trajectory], m: dict) -> torch.Tensor:
        """Reward shaping added to the verifier's scores: DAPO's soft overlong punishment."""
        ob = self.cfg.algorithm.overlong_buffer
        if not ob.enable:
            return torch.zeros(len(trajs))
        penalty = overlong_penalty(torch.tensor([len(t.response_ids) for t in trajs]),
                                   self.cfg.rollout.max_response_length, ob.len, ob.penalty_factor)
        m["reward/overlong_penalty_mean"] = penalty.mean().item()
        return penalty

    def compute_advantages(self, batch: Batch, prompts: list[PromptItem], trajs: list[Trajectory],
                           scores: torch.Tensor) -> dict[str, float]:
        """Token rewards (score on the last token, minus the in-reward KL), then advantages and returns."""
        alg, mask, m = self.cfg.algorithm, batch["response_mask"], {}
        token_rewards = last_token_rewards(scores, mask)
        if self.kl_ctrl is not None:
            token_rewards, kl = apply_kl_penalty(token_rewards, batch["old_logprobs"], batch["ref_logprobs"],
                                                 mask, self.kl_ctrl.value, alg.kl_penalty)
            m.update({"actor/reward_kl_penalty": kl, "actor/reward_kl_coef": self.kl_ctrl.value})
            self.kl_ctrl.update(kl, n_steps=batch.size)
        baseline = None
        if ADV_ESTIMATORS.meta(alg.adv_estimator).baseline_rollout:  # ReMax: the greedy response's score per prompt
            greedy = self.rollout.generate([p.prompt_ids for p in prompts], n=1, temperature=0.0, top_p=1.0,
                                           top_k=-1, max_tokens=self.cfg.rollout.max_response_length)
            greedy_scores = self.score(prompts, greedy)[0] + self.shaping(greedy, {})
            baseline = greedy_scores[torch.tensor([t.prompt_index for t in trajs])]
            m["reward/greedy_baseline_mean"] = greedy_scores.mean().item()
        inputs = AdvantageInputs(token_rewards, mask, torch.tensor([t.prompt_index for t in trajs]),
                                 batch.get("values"), baseline)
        batch["advantages"], batch["returns"] = compute_advantages(alg.adv_estimator, inputs, alg.gamma, alg.lam,
                                                                   alg.norm_adv_by_std)
        valid = mask.bool()
        m["advantages/mean"] = batch["advantages"][valid].mean().item()
        m["advantages/abs_mean"] = batch["advantages"][valid].abs().mean().item()
        m["returns/mean"] = batch["returns"][valid].mean().item()
        if "values" in batch:
            m["critic/values_mean"] = batch["values"][valid].mean().item()
            m["critic/vf_explained_var"] = explained_variance(batch["values"], batch["returns"], mask)
        return m

    def train_role(self, group, batch: Batch, loss_cfg, role, *args) -> dict[str, float]:
        """role.ppo_epochs passes over ``batch`` in mini-batches of role.ppo_mini_batch_size prompts
        (``role``: cfg.actor, or resolved_critic(cfg)), one optimizer step each; the loss weights
        (role.loss_agg_mode) are normalised over each mini-batch. Returns the metrics averaged over
        the steps."""
        rows = (role.ppo_mini_batch_size or self.cfg.data.batch_size) * self.cfg.rollout.n
        totals: dict[str, float] = {}
        n_steps = 0
        for _ in range(role.ppo_epochs):
            for mini in batch.split(rows):
                mini["loss_weights"] = loss_weights(mini["response_mask"], role.loss_agg_mode,
                                                    self.cfg.rollout.max_response_length)
                for k, v in group.update(mini, loss_cfg, *args).items():
                    totals[k] = totals.get(k, 0.0) + v
                n_steps += 1
        return {k: v / n_steps for k, v in totals.items()}

    # ---------------------------------------------------------------------------------- helpers
    def score(self, prompts: list[PromptItem], trajs: list[Trajectory], step: int | None = None):
        items = [prompts[tr.prompt_index] for tr in trajs]
        texts = [self.tokenizer.decode(tr.response_ids, skip_special_tokens=True) for tr in trajs]
        try:
            return compute_rewards(self.reward_fn, items, texts, spec=self.cfg.reward.function)
        except RewardError as e:
            raise RewardError(f"step {step}: {e}" if step is not None else str(e)) from e

    def validate(self) -> dict[str, float]:
        """Greedy accuracy (mean reward) on the validation prompts with the current weights."""
        items = list(self.val_set)
        trajs = self.rollout.generate([p.prompt_ids for p in items], n=1, temperature=0.0, top_p=1.0, top_k=-1,
                                      max_tokens=self.cfg.rollout.max_response_length)
        scores, _ = self.score(items, trajs)
        return {"val/reward_mean": scores.mean().item()}

    def shutdown(self) -> None:
        for role in (self.rollout, self.critic, self.reference, self.actor):
            if role is not None:
                role.shutdown()
        self.pools.shutdown()


def build_batch(trajs: list[Trajectory], pad_id: int) -> Batch:
    """Right-padded prompt+response tokens with token-aligned masks and engine log-probs."""
    seq_len = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    n = len(trajs)
    input_ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, seq_len), dtype=torch.long)
    response_mask = torch.zeros((n, seq_len))
    rollout_logprobs = torch.zeros((n, seq_len))
    for i, t in enumerate(trajs):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, :p + r] = torch.tensor(t.prompt_ids + t.response_ids)
        attention_mask[i, :p + r] = 1
        response_mask[i, p:p + r] = 1.0
        rollout_logprobs[i, p:p + r] = torch.tensor(t.response_logprobs)
    return Batch(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                 rollout_logprobs=rollout_logprobs)


def batch_metrics(batch: Batch, trajs: list[Trajectory], scores: torch.Tensor) -> dict[str, float]:
    mask = batch["response_mask"].bool()
    # How far the engine's sampling distribution is from the trainer's before the update: large
    # values mean a resharding or numerics bug, not an algorithm issue.
    diff = (batch["old_logprobs"] - batch["rollout_logprobs"])[mask].abs()
    return {
        "reward/trained_mean": scores.mean().item(),  # the trained batch's scores, shaping and filtering included
        "response_length/mean": batch["response_mask"].sum(1).mean().item(),
        "response_length/clip_frac": sum(tr.finish_reason == "length" for tr in trajs) / len(trajs),
        "rollout/logprob_diff_max": diff.max().item(),
        "rollout/logprob_diff_mean": diff.mean().item(),
        "rollout/weight_version": float(min(tr.weight_version for tr in trajs)),
    }


def run(cfg: JobConfig, layout: JobLayout) -> list[dict]:
    import ray

    os.makedirs(cfg.trainer.run_dir, exist_ok=True)
    try:
        trainer = Trainer(cfg, layout)
        try:
            return trainer.fit()
        finally:
            trainer.shutdown()
    finally:
        ray.shutdown()
