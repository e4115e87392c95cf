"""The training loop: one controller process drives the roles through small interfaces.

    prompts -> rollout pool (vLLM) -> trajectories -> rewards -> old/ref log-probs, values (Megatron)
            -> advantages (here, plain torch) -> critic and actor updates (Megatron) -> weight sync -> metrics

With ``trainer.off_policy_steps = K > 0`` the first two arrows run ahead on a background thread
(``rlcore/rollout_queue.py``): step k's batch was sampled by weight version max(0, k - 1 - K) while
the actor trained on earlier batches; everything after them is the same code. With
``rollout.partial_rollouts`` the weight sync does not wait for the batch generating ahead: its
later tokens are sampled by the new version (its first token's version stays the staleness one).

The roles arrive built (``launch/compose.py`` is the composition root); the trainer knows them only
as ``rlcore.roles`` protocols, and the task (tokenizer, datasets, reward function) as a ``Task``.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from rlcore import checkpoint
from rlcore.algos import (ADV_ESTIMATORS, AdvantageInputs, apply_kl_penalty, compute_advantages, explained_variance,
                          groups_with_variance, kl_controller, last_token_rewards, loss_weights, overlong_penalty)
from rlcore.batch import Batch, Trajectory, build_batch
from rlcore.config import JobConfig, on_policy_update, resolved_critic
from rlcore.data import PromptItem, Task
from rlcore.engine_restarts import EngineRestarts
from rlcore.faults import EngineDiedAhead
from rlcore.loop import StepLoop
from rlcore.metrics import timer
from rlcore.nonfinite import NonFiniteGuard
from rlcore.reward import RewardError
from rlcore.reward_sources import RewardCombination, SourceScores, placed_token_rewards, total_rewards
from rlcore.roles import Roles, UpdateResult
from rlcore.rollout_queue import RolloutQueue, staleness
from rlcore.samples import Samples, queued_batches_to_restore
from rlcore.weight_sync import sync_metrics


class SamplingError(RuntimeError):
    """Dynamic sampling could not fill a batch: a property of the data and the policy, not a bug."""


class Trainer(StepLoop):
    def __init__(self, cfg: JobConfig, task: Task, roles: Roles):
        self.cfg, self.task, self.roles = cfg, task, roles
        self.actor, self.reference, self.critic, self.rollout = roles.actor, roles.reference, roles.critic, roles.rollout
        self.tokenizer, self.loader, self.val_set = task.tokenizer, task.loader, task.val_set
        self.rewards = RewardCombination.for_job(cfg, task, roles.reward)  # reward.weights over the sources
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon) if cfg.algorithm.kl_in_reward else None
        self.version = 0  # the engines start from the same HF checkpoint as the actor
        self.nonfinite = NonFiniteGuard(cfg.trainer.on_nonfinite, cfg.trainer.run_dir, roles.trainable())
        # Generations and syncs go through it: a dead engine is restarted, re-synced, the call redone.
        self.engines = EngineRestarts(self.actor, self.rollout, cfg.rollout)
        # Sampling inline (off_policy_steps 0) or ahead on a producer thread; weight syncs, validation
        # and checkpoints wait for it to go idle.
        # A batch whose engine died under it ahead of its step is sampled again at its step (EngineDiedAhead).
        self.rollouts = RolloutQueue(self.sample_batch, cfg.trainer.off_policy_steps, self.loader.state_dict,
                                     last_batch=cfg.trainer.total_steps, loader_restore_fn=self.loader.load_state_dict,
                                     redo_on=(EngineDiedAhead,))

    @property
    def reward_fn(self):
        """The rule source's reward function (reward.function)."""
        return self.rewards.by_name["rule"].fn

    @reward_fn.setter
    def reward_fn(self, fn) -> None:
        self.rewards.by_name["rule"].fn = fn

    # ------------------------------------------------------------------------------ the iteration
    # fit() (rlcore/loop.py) runs train_step for each step, with validation, checkpoints and the stop on signals.
    def train_step(self, step: int) -> dict[str, float]:
        cfg, m = self.cfg, {}
        temperature = cfg.rollout.temperature
        t0 = time.perf_counter()
        self.nonfinite.start(step)
        s = self.rollouts.take(step)  # sampled now or while earlier steps trained; timed inside
        m.update(s.metrics)
        m.update(staleness([t.weight_version for t in s.trajs], self.version, cfg.trainer.off_policy_steps))
        batch = build_batch(s.trajs, self.task.pad_id)
        on_policy = on_policy_update(cfg)  # the update's own forward gives the old log-probs
        with timer("logprob", m):
            if cfg.actor.use_rollout_logprobs:
                batch["old_logprobs"] = batch["rollout_logprobs"]
            elif not on_policy:  # on-policy: the update's own forward gives them (below)
                batch["old_logprobs"] = self.actor.forward(batch, temperature=temperature)["logprobs"]
            if self.reference is not None:
                batch["ref_logprobs"] = self.reference.forward(batch, temperature=temperature)["logprobs"]
        if self.critic is not None:
            with timer("values", m):
                batch["values"] = self.critic.forward(batch)["values"]
        with timer("advantages", m):
            m.update(self.compute_advantages(batch, s))
        if self.critic is not None:
            with timer("critic_update", m):
                batch["old_values"] = batch["values"]  # the anchor of the clipped value loss
                m.update(self.train_role(self.critic, batch, resolved_critic(cfg)))
        with timer("update", m):
            update = self.train_role(self.actor, batch, cfg.actor, temperature=temperature,
                                     **({"on_policy": True} if on_policy else {}))
            m.update(update)
        if on_policy:
            batch["old_logprobs"] = update.outputs["logprobs"]
        with timer("rollout_wait", m):  # for the batch generating ahead: the engines must be idle to sync,
            if not cfg.rollout.partial_rollouts:  # unless they pause it between two engine steps
                self.rollouts.wait_idle()
        with timer("weight_sync", m):
            reports = self.sync_weights(self.version + 1)
        m.update(sync_metrics(reports))
        if cfg.rollout.partial_rollouts:  # whether this sync paused a generation (else it found the engines idle)
            m["rollout/sync_mid_generation"] = float(any(r.get("mid_generation") for r in reports))
        m.update(batch_metrics(batch, s.trajs, total_rewards(s.scores, s.token_rewards)))
        m.update(self.nonfinite.metrics())
        m.update({"weights/version": float(self.version), "rollout/engine_restarts": float(self.engines.restarts),
                  "timing/step_s": time.perf_counter() - t0})
        return m

    # ---------------------------------------------------------------------------------- phases
    def sample_batch(self, step: int) -> Samples:
        """``sample`` with the metrics it reports kept on the batch (it may run ahead of its step)."""
        m: dict[str, float] = {}
        return dataclasses.replace(self.sample(step, m), metrics=m)

    def sample(self, step: int, m: dict) -> Samples:
        """One batch of prompts, their rollout.n responses each and their scores.

        With DAPO's dynamic sampling, groups whose samples all scored the same (no group-relative
        signal) are dropped and more prompts are drawn until data.batch_size groups are kept. An
        estimator that needs a baseline rollout (ReMax) gets the greedy response's score per prompt."""
        cfg, ds = self.cfg, self.cfg.algorithm.dynamic_sampling
        prompts: list[PromptItem] = []
        trajs: list[Trajectory] = []
        scores: list[torch.Tensor] = []
        tokens: list[torch.Tensor] | None = None
        for draw in range(1, (ds.max_gen_batches if ds.enable else 1) + 1):
            drawn: list[PromptItem] = next(self.loader)
            with timer("rollout", m):
                new = self.engines.generate([p.prompt_ids for p in drawn], n=cfg.rollout.n,
                                            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                            top_k=cfg.rollout.top_k, max_tokens=cfg.rollout.max_response_length,
                                            seed=cfg.trainer.seed * 100_003 + step + 1_000_000 * (draw - 1))
            with timer("reward", m):
                rewards = self.score(drawn, new, step)
            if draw == 1:  # what the policy scores on a plain batch, before any filtering
                m.update(rewards.metrics)
            new_scores = rewards.sequence + self.shaping(new, m)
            if not ds.enable:
                return self.with_baseline(Samples(drawn, new, new_scores, token_rewards=rewards.token), m)
            keep = groups_with_variance(total_rewards(new_scores, rewards.token),
                                        torch.tensor([t.prompt_index for t in new]))
            kept_prompts = sorted({t.prompt_index for t, k in zip(new, keep) if k})
            renumber = {old: len(prompts) + i for i, old in enumerate(kept_prompts)}
            prompts += [drawn[i] for i in kept_prompts]
            trajs += [dataclasses.replace(t, prompt_index=renumber[t.prompt_index]) for t, k in zip(new, keep) if k]
            scores.append(new_scores[keep])
            if rewards.token is not None:
                tokens = (tokens or []) + [t for t, k in zip(rewards.token, keep) if k]
            m["dynamic_sampling/gen_batches"] = float(draw)
            if len(prompts) >= cfg.data.batch_size:
                n_keep = cfg.data.batch_size * cfg.rollout.n  # trajectories are grouped by prompt, in order
                return self.with_baseline(Samples(prompts[:cfg.data.batch_size], trajs[:n_keep],
                                                  torch.cat(scores)[:n_keep],
                                                  token_rewards=None if tokens is None else tokens[:n_keep]), m)
        raise SamplingError(
            f"step {step}: dynamic sampling kept {len(prompts)} of the data.batch_size={cfg.data.batch_size} "
            f"prompts after algorithm.dynamic_sampling.max_gen_batches={ds.max_gen_batches} generation rounds "
            f"(the others' {cfg.rollout.n} samples all scored the same); raise max_gen_batches or rollout.n")

    def with_baseline(self, s: Samples, m: dict) -> Samples:
        """ReMax's baseline: the score of each prompt's greedy response, given to its samples."""
        if not ADV_ESTIMATORS.meta(self.cfg.algorithm.adv_estimator).baseline_rollout:
            return s
        with timer("baseline_rollout", m):
            greedy = self.engines.generate([p.prompt_ids for p in s.prompts], n=1, temperature=0.0, top_p=1.0,
                                           top_k=-1, max_tokens=self.cfg.rollout.max_response_length)
            rewards = self.score(s.prompts, greedy)
            greedy_scores = total_rewards(rewards.sequence, rewards.token) + self.shaping(greedy, {})
        m["reward/greedy_baseline_mean"] = greedy_scores.mean().item()
        return dataclasses.replace(s, baseline_scores=greedy_scores[torch.tensor([t.prompt_index for t in s.trajs])])

    def shaping(self, trajs: list[Trajectory], m: dict) -> torch.Tensor:
        """Reward shaping added to the verifier's scores: DAPO's soft overlong punishment."""
        ob = self.cfg.algorithm.overlong_buffer
        if not ob.enable:
            return torch.zeros(len(trajs))
        penalty = overlong_penalty(torch.tensor([len(t.response_ids) for t in trajs]),
                                   self.cfg.rollout.max_response_length, ob.len, ob.penalty_factor)
        m["reward/overlong_penalty_mean"] = penalty.mean().item()
        return penalty

    def compute_advantages(self, batch: Batch, s: Samples) -> dict[str, float]:
        """Token rewards (score on the last token, plus a process reward model's, minus the in-reward
        KL), then advantages and returns."""
        alg, mask, m = self.cfg.algorithm, batch["response_mask"], {}
        token_rewards = last_token_rewards(s.scores, mask)
        if s.token_rewards is not None:
            token_rewards = token_rewards + placed_token_rewards(s.token_rewards, mask)
        if self.kl_ctrl is not None:
            token_rewards, kl = apply_kl_penalty(token_rewards, batch["old_logprobs"], batch["ref_logprobs"],
                                                 mask, self.kl_ctrl.value, alg.kl_penalty)
            m.update({"actor/reward_kl_penalty": kl, "actor/reward_kl_coef": self.kl_ctrl.value})
            self.kl_ctrl.update(kl, n_steps=batch.size)
        inputs = AdvantageInputs(token_rewards, mask, torch.tensor([t.prompt_index for t in s.trajs]),
                                 batch.get("values"), s.baseline_scores)
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

    def train_role(self, role, batch: Batch, role_cfg, **head_args) -> UpdateResult:
        """``role_cfg.ppo_epochs`` passes over ``batch`` in mini-batches of ``role_cfg.ppo_mini_batch_size``
        prompts (``role_cfg``: cfg.actor, or resolved_critic(cfg)), one optimizer step each with
        ``role_cfg.loss``; the loss weights (``role_cfg.loss_agg_mode``) are normalised over each
        mini-batch. Returns the metrics averaged over the steps, and the outputs the role kept when it
        took one step on the whole batch."""
        rows = (role_cfg.ppo_mini_batch_size or self.cfg.data.batch_size) * self.cfg.rollout.n
        totals: dict[str, float] = {}
        n_steps = 0
        for _ in range(role_cfg.ppo_epochs):
            for mini in batch.split(rows):
                mini["loss_weights"] = loss_weights(mini["response_mask"], role_cfg.loss_agg_mode,
                                                    self.cfg.rollout.max_response_length)
                self.nonfinite.poison_for_test(role, mini)
                result = role.update(mini, role_cfg.loss, **head_args)
                self.nonfinite.check(role, mini, result)  # trainer.on_nonfinite: stop here, or count a skip
                for k, v in result.items():
                    totals[k] = totals.get(k, 0.0) + v
                n_steps += 1
        return UpdateResult({k: v / n_steps for k, v in totals.items()}, result.outputs if n_steps == 1 else {})

    def sync_weights(self, version: int) -> list[dict]:
        """The actor's current weights to every rollout engine, as weight version ``version``; the
        engines' reports."""
        reports = self.engines.sync_weights(version)
        self.version = version
        return reports

    # ---------------------------------------------------------------------------------- helpers
    def score(self, prompts: list[PromptItem], trajs: list[Trajectory], step: int | None = None,
              only: str | None = None) -> SourceScores:
        """The trajectories' rewards from every reward source, combined (``reward.weights``); ``only``:
        one source's scores alone."""
        texts = [self.tokenizer.decode(tr.response_ids, skip_special_tokens=True) for tr in trajs]
        try:
            if only is not None:
                return self.rewards.by_name[only].score(prompts, trajs, texts)
            return self.rewards.score(prompts, trajs, texts)
        except RewardError as e:
            raise RewardError(f"step {step}: {e}" if step is not None else str(e)) from e

    @property
    def validates(self) -> bool:
        return self.val_set is not None

    def validate(self) -> dict[str, float]:
        """Greedy accuracy on the validation prompts with the current weights: the mean score of the
        rule source (reward.function, the verifier), whatever the training reward combines: held-out
        accuracy is measured by the verifier, never by a reward model."""
        items = list(self.val_set)
        self.rollouts.wait_idle()  # never next to a generation on the same engines
        trajs = self.engines.generate([p.prompt_ids for p in items], n=1, temperature=0.0, top_p=1.0, top_k=-1,
                                      max_tokens=self.cfg.rollout.max_response_length)
        return {"val/reward_mean": self.score(items, trajs, only="rule").sequence.mean().item()}

    # ------------------------------------------------------------------------ checkpoint state
    def state_dict(self, step: int) -> dict:
        """What the controller must restore to continue exactly after ``step``: with batches queued
        ahead, those batches (sampled by versions a resumed run no longer has) and the loader position
        after them."""
        self.rollouts.wait_idle()
        queued, loader_after = self.rollouts.saved_batches()
        state = {"step": step, "weight_version": self.version,
                 "loader": self.loader.state_dict() if loader_after is None else loader_after,
                 "off_policy_steps": self.cfg.trainer.off_policy_steps,
                 checkpoint.QUEUED_KEY: [{"batch": q.batch, "loader_before": q.loader_before,
                                          "samples": q.samples.to_saved()} for q in queued]}
        if loader_after is not None:  # the batch after the saved ones failed: a resumed run samples it again
            state["failed_batch"] = step + 1 + len(queued)
        if self.kl_ctrl is not None:
            state["kl_controller"] = self.kl_ctrl.state_dict()
        return state

    def load_state_dict(self, state: dict, log=print) -> None:
        self.version = int(state["weight_version"])
        self.restore_queue(state, log)
        kl = state.get("kl_controller")
        if kl is not None and self.kl_ctrl is None:
            raise checkpoint.CheckpointError(f"{checkpoint.CONTROLLER}: the checkpoint has an in-reward KL "
                                             "controller, the job has none (algorithm.kl_in_reward)")
        if kl is not None:
            self.kl_ctrl.load_state_dict(kl)

    def restore_queue(self, state: dict, log) -> None:
        """The loader position, and the batches queued after the saved step back in the queue when
        they fit this job; otherwise they are sampled again by the restored weights (one log line)."""
        restored, loader, why = queued_batches_to_restore(state, self.cfg, self.loader.dataset)
        self.loader.load_state_dict(loader)
        if restored:
            self.rollouts.restore(restored)
        elif why is not None:
            log(f"checkpoint: no queued batches restored after step {state['step']} ({why}); the next batches are "
                f"sampled from the saved loader position by the restored weights (version {self.version})")

    def resume(self) -> int:
        """Continues from a checkpoint per ``trainer.resume``: the roles' weights and optimizers, the
        controller state, then the restored weights to the engines. Returns the step to continue after
        (0: a fresh start)."""
        state = checkpoint.resume(self.cfg, self.roles.trainable())
        self.saved_step = 0 if state is None else int(state["step"])  # the step a checkpoint holds already
        if state is None:
            return 0
        self.load_state_dict(state)
        self.sync_weights(self.version)
        return int(state["step"])

    def shutdown(self) -> None:
        self.rollouts.close()  # the batch in flight finishes before the engines stop
        self.roles.shutdown()


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
        # Trajectories whose tokens more than one weight version sampled (rollout.partial_rollouts).
        "rollout/multi_version_frac": sum(tr.spans_versions for tr in trajs) / len(trajs),
    }
