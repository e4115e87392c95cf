"""The preference loop: DPO / IPO (and reward-model training) on (prompt, chosen, rejected) pairs.

    pairs -> a batch of 2P rows (chosen, rejected alternating) -> the reference's log-probs (when the
          objective needs them) -> the trained role's update with the objective's head -> metrics

The RL trainer's little sibling (``rlcore/trainer.py``): the same roles (the trained role is
``roles.actor``, built with the objective's head by ``launch/compose.py``; the reference is the usual
forward-only LM group), the same metrics loggers, non-finite guard, checkpoints and exact resume
(``rlcore/checkpoint.py``: the controller state is the step and the pair loader's position), the same
preemption handling. No sampling: the only generation is the optional greedy validation
(``algorithm.dpo.greedy_val_files``), for which the job has a rollout pool whose weights are synced
from the actor right before it generates.

Validation every ``trainer.val_every`` steps (and before step 1): the objective's metrics on the
``data.val_files`` pairs (``val/dpo_loss``, ``val/dpo_reward_accuracy``, ...), and the greedy held-out
accuracy ``val/reward_mean`` on the prompts of ``greedy_val_files`` scored by ``reward.function``, as
the RL trainer's validation reports it.
"""
from __future__ import annotations

import time

from rlcore import checkpoint, preemption
from rlcore.batch import Batch
from rlcore.config import JobConfig
from rlcore.metrics import MetricsLogger, timer
from rlcore.nonfinite import NonFiniteGuard
from rlcore.preference_data import PreferencePair, PreferenceTask, pair_batch
from rlcore.preference_losses import PREFERENCE_OBJECTIVES, objective_loss_config, pair_weights
from rlcore.reward import compute_rewards
from rlcore.roles import Roles, UpdateResult


class PreferenceTrainer:
    def __init__(self, cfg: JobConfig, task: PreferenceTask, roles: Roles):
        self.cfg, self.task, self.roles = cfg, task, roles
        self.actor, self.reference = roles.actor, roles.reference
        self.objective = PREFERENCE_OBJECTIVES.meta(cfg.algorithm.type)
        self.pair_metrics = PREFERENCE_OBJECTIVES[cfg.algorithm.type]
        self.loss_cfg = objective_loss_config(cfg)
        self.loader, self.val_pairs = task.loader, task.val_pairs
        self.nonfinite = NonFiniteGuard(cfg.trainer.on_nonfinite, cfg.trainer.run_dir, roles.trainable())
        self.engines = None
        if roles.rollout is not None:  # only for the greedy validation
            from rlcore.engine_restarts import EngineRestarts

            self.engines = EngineRestarts(self.actor, roles.rollout, cfg.rollout)
        self.synced_step = 0  # the training step whose weights the engines hold (None: unknown)
        self.saved_step = 0

    # ------------------------------------------------------------------------------ the iteration
    def fit(self) -> list[dict]:
        t = self.cfg.trainer
        history = []
        start = self.resume()  # before the logger opens metrics.jsonl: resuming trims it
        logger = MetricsLogger.for_job(self.cfg, start)
        stop = preemption.StopOnSignal().install()
        try:
            if t.val_every and start == 0 and self.validates:
                logger.log(0, self.validate(0))
            for step in range(start + 1, t.total_steps + 1):
                stop.check(step - 1, t.total_steps, self.save_unless_saved)
                metrics = self.train_step(step)
                if t.val_every and step % t.val_every == 0 and self.validates:
                    metrics.update(self.validate(step))
                logger.log(step, metrics)
                history.append(metrics)
                self.maybe_save(step)
        finally:
            stop.restore()
            logger.close()
        return history

    def train_step(self, step: int) -> dict[str, float]:
        m: dict[str, float] = {}
        t0 = time.perf_counter()
        self.nonfinite.start(step)
        pairs: list[PreferencePair] = next(self.loader)
        batch = self.batch(pairs)
        with timer("reference", m):
            self.add_reference(batch)
        with timer("update", m):
            m.update(self.train_actor(batch))
        mask = batch["response_mask"]
        m.update({"response_length/chosen_mean": mask[0::2].sum(1).mean().item(),
                  "response_length/rejected_mean": mask[1::2].sum(1).mean().item()})
        m.update(self.nonfinite.metrics())
        m["timing/step_s"] = time.perf_counter() - t0
        return m

    def batch(self, pairs: list[PreferencePair]) -> Batch:
        return pair_batch(pairs, self.task.pad_id)

    def add_reference(self, batch: Batch) -> None:
        if self.objective.needs_reference:
            batch["ref_logprobs"] = self.reference.forward(batch)["logprobs"]

    def train_actor(self, batch: Batch) -> UpdateResult:
        """``actor.ppo_epochs`` passes over the batch in mini-batches of ``actor.ppo_mini_batch_size``
        pairs (default: all of them), one optimizer step each with the objective's loss; each pair
        weighs 1 / pairs in its mini-batch. Returns the metrics averaged over the steps."""
        a = self.cfg.actor
        rows = 2 * (a.ppo_mini_batch_size or self.cfg.data.batch_size)
        totals: dict[str, float] = {}
        n_steps = 0
        for _ in range(a.ppo_epochs):
            for mini in batch.split(rows):
                mini["loss_weights"] = pair_weights(mini.size)
                result = self.actor.update(mini, self.loss_cfg)
                self.nonfinite.check(self.actor, mini, result)
                for k, v in result.items():
                    totals[k] = totals.get(k, 0.0) + v
                n_steps += 1
        return UpdateResult({k: v / n_steps for k, v in totals.items()})

    # ------------------------------------------------------------------------------ validation
    @property
    def validates(self) -> bool:
        return self.val_pairs is not None or self.task.greedy_val_set is not None

    def validate(self, step: int) -> dict[str, float]:
        m: dict[str, float] = {}
        if self.val_pairs is not None:
            with timer("validation_pairs", m):
                m.update(self.validate_pairs())
        if self.task.greedy_val_set is not None:
            with timer("validation_greedy", m):
                m.update(self.validate_greedy(step))
        return m

    def validate_pairs(self) -> dict[str, float]:
        """The objective's metrics (means over the pairs) on every validation pair, as ``val/<name>``
        (``dpo/reward_accuracy`` -> ``val/dpo_reward_accuracy``). The pairs go through the roles in
        chunks of data.batch_size pairs (a shape the layout is validated for); the last chunk is
        filled up with copies of its first pair, which the metrics do not count."""
        pairs, chunk = list(self.val_pairs), self.cfg.data.batch_size
        totals: dict[str, float] = {}
        for start in range(0, len(pairs), chunk):
            real = pairs[start:start + chunk]
            batch = self.batch(real + [real[0]] * (chunk - len(real)))
            self.add_reference(batch)
            outputs = self.actor.forward(batch)
            kept = 2 * len(real)
            metrics = self.pair_metrics({k: v[:kept] for k, v in outputs.items()}, batch.slice(0, kept),
                                        self.loss_cfg)
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v * len(real)
        return {"val/" + k.replace("/", "_"): v / len(pairs) for k, v in totals.items()}

    def validate_greedy(self, step: int) -> dict[str, float]:
        """The policy's greedy held-out accuracy: the mean reward of its greedy responses to the
        greedy_val_files prompts, with the current weights (synced to the engines first)."""
        if self.synced_step != step:
            self.engines.sync_weights(step)
            self.synced_step = step
        items = list(self.task.greedy_val_set)
        trajs = self.engines.generate([p.prompt_ids for p in items], n=1, temperature=0.0, top_p=1.0, top_k=-1,
                                      max_tokens=self.cfg.rollout.max_response_length)
        texts = [self.task.tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in trajs]
        scores, _ = compute_rewards(self.task.reward_fn, [items[t.prompt_index] for t in trajs], texts,
                                    spec=self.cfg.reward.function)
        return {"val/reward_mean": scores.mean().item()}

    # ------------------------------------------------------------------------ checkpoint state
    def state_dict(self, step: int) -> dict:
        # weight_version: the count of actor updates, as the RL controller's (checkpoint.resume logs it).
        return {"step": step, "weight_version": step, "loader": self.loader.state_dict()}

    def resume(self) -> int:
        state = checkpoint.resume(self.cfg, self.roles.trainable())
        if state is None:
            return 0
        self.loader.load_state_dict(state["loader"])
        self.saved_step = int(state["step"])
        self.synced_step = None  # the engines hold the initial weights: sync before generating
        return self.saved_step

    def maybe_save(self, step: int) -> None:
        t = self.cfg.trainer
        if t.save_every and (step % t.save_every == 0 or step == t.total_steps):
            self.save(step)

    def save(self, step: int) -> str:
        t = self.cfg.trainer
        folder = checkpoint.save_checkpoint(checkpoint.checkpoint_dir_of(t), step, self.roles.trainable(),
                                            self.state_dict(step), checkpoint.job_yaml(self.cfg), t.keep_last)
        self.saved_step = step
        return folder

    def save_unless_saved(self, step: int) -> str:
        if step == self.saved_step:
            return checkpoint.read_latest(checkpoint.checkpoint_dir_of(self.cfg.trainer)) or f"of step {step}"
        return self.save(step)

    def shutdown(self) -> None:
        self.roles.shutdown()
