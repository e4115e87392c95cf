"""The training loop: one controller process drives the roles through small interfaces.

    prompts -> rollout pool (vLLM) -> trajectories -> rewards -> old/ref log-probs (Megatron)
            -> advantages (here, plain torch) -> actor update (Megatron) -> weight sync -> metrics
"""
from __future__ import annotations

import os
import time

import torch

from rlcore.algos import ADV_ESTIMATORS, LossConfig
from rlcore.batch import Batch, Trajectory
from rlcore.config import JobConfig
from rlcore.data import PromptItem, PromptLoader, load_datasets
from rlcore.job import JobLayout
from rlcore.metrics import MetricsLogger, timer
from rlcore.placement import ResourcePools, start_ray
from rlcore.reward import RewardError, compute_rewards, load_reward_fn
from rlcore.weight_sync import connect_weight_sync, sync_weights


class Trainer:
    def __init__(self, cfg: JobConfig, layout: JobLayout):
        from transformers import AutoTokenizer

        from megatron_workers import MegatronGroup
        from rollout import RolloutPool

        self.cfg, self.layout = cfg, layout
        torch.manual_seed(cfg.trainer.seed)
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
        self.pools = ResourcePools(cfg.resources.pools, roles)

        def megatron_group(role, lay, micro_batch_size, optim):
            return MegatronGroup(role, cfg.model.path, lay.tp, lay.pp, lay.dp, self.pools.placement(role),
                                 micro_batch_size, layout.device, dtype, optim, cfg.trainer.seed)

        a = cfg.actor
        self.actor = megatron_group("actor", layout.actor, a.micro_batch_size, a.optim)
        self.reference = (megatron_group("reference", layout.reference,
                                         cfg.reference.micro_batch_size or a.micro_batch_size, None)
                          if layout.reference else None)
        self.rollout = RolloutPool(cfg.model.path, cfg.rollout, self.pools.placement("rollout"),
                                   layout.device, dtype, cfg.trainer.seed)
        self.loss_cfg = LossConfig(a.policy_loss, a.clip_ratio_low, a.clip_ratio_high, a.entropy_coeff,
                                   a.kl_coeff, a.kl_estimator, a.loss_agg_mode)
        self.version = 0  # the engines start from the same HF checkpoint as the actor
        connect_weight_sync(self.actor, self.rollout, cfg.rollout.engines, cfg.rollout.bucket_mb * 1024 ** 2, dtype)

    # ------------------------------------------------------------------------------ the iteration
    def fit(self) -> list[dict]:
        t = self.cfg.trainer
        history = []
        logger = MetricsLogger(t.run_dir, t.total_steps, t.tensorboard)
        try:
            if self.val_set is not None and t.val_every:
                logger.log(0, self.validate())
            for step in range(1, t.total_steps + 1):
                metrics = self.train_step(step)
                if self.val_set is not None and t.val_every and step % t.val_every == 0:
                    metrics.update(self.validate())
                logger.log(step, metrics)
                history.append(metrics)
        finally:
            logger.close()
        return history

    def train_step(self, step: int) -> dict[str, float]:
        cfg, m = self.cfg, {}
        temperature = cfg.rollout.temperature
        t0 = time.perf_counter()
        prompts: list[PromptItem] = next(self.loader)
        with timer("rollout", m):
            trajs = self.rollout.generate([p.prompt_ids for p in prompts], n=cfg.rollout.n, temperature=temperature,
                                          top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                                          max_tokens=cfg.rollout.max_response_length,
                                          seed=cfg.trainer.seed * 100_003 + step)
        with timer("reward", m):
            scores, reward_metrics = self.score(prompts, trajs, step)
        batch = build_batch(trajs, self.pad_id)
        with timer("logprob", m):
            batch["old_logprobs"] = self.actor.compute_logprobs(batch, temperature)
            if self.reference is not None:
                batch["ref_logprobs"] = self.reference.compute_logprobs(batch, temperature)
        groups = torch.tensor([tr.prompt_index for tr in trajs])
        adv = ADV_ESTIMATORS[cfg.algorithm.adv_estimator](scores, groups, cfg.algorithm.norm_adv_by_std)
        batch["advantages"] = adv[:, None] * batch["response_mask"]
        with timer("update", m):
            m.update(self.actor.update(batch, self.loss_cfg, temperature))
        with timer("weight_sync", m):
            self.version += 1
            sync_weights(self.actor, self.rollout, self.version)
        m.update(reward_metrics)
        m.update(batch_metrics(batch, trajs, scores))
        m.update({"weights/version": float(self.version), "timing/step_s": time.perf_counter() - t0})
        return m

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
        for role in (self.rollout, self.reference, self.actor):
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
        "reward/mean": scores.mean().item(),
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
