"""The pipelined-phases schedule (rlcore/rollout_queue.py) against a fake engine, without Ray: which
weight version makes each batch, that a sync never overlaps a generation, where errors surface, and
the batches and loader position a checkpoint keeps, and a resume from them (here and through the
``Trainer`` with a fake engine)."""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from rlcore.job import ConfigError, load_job
from rlcore.metrics import is_measurement
from rlcore.rollout_queue import RolloutQueue, SavedBatch, staleness
from rlcore.validate import validate


class FakeEngine:
    """Generation that takes a while and records the weight version it ran with; a sync that
    refuses to run while a generation is in flight (as the real engines cannot)."""

    def __init__(self, fail_batch: int | None = None):
        self.version = 0
        self.busy = threading.Event()
        self.made_by: dict[int, int] = {}
        self.position = 0  # the "loader": prompts drawn so far
        self.fail_batch = fail_batch

    def sample(self, batch: int) -> tuple[int, int]:
        assert threading.current_thread() is not threading.main_thread() or self.inline
        self.busy.set()
        try:
            self.position += 1
            time.sleep(0.02)
            if batch == self.fail_batch:
                raise ValueError(f"reward function failed on batch {batch}")
            self.made_by[batch] = self.version
            return batch, self.version
        finally:
            self.busy.clear()

    def sync(self, version: int) -> None:
        assert not self.busy.is_set(), "weight sync during a generation"
        self.version = version


def _run(k: int, steps: int, engine: FakeEngine, train_s: float = 0.01, first: int = 1,
         saved: list[SavedBatch] | None = None, save_after: int | None = None) -> list[dict]:
    """Steps ``first..steps`` as the trainer runs them; ``saved``: a checkpoint's batches restored
    first; after step ``save_after`` the checkpoint's content is kept in the last result's "saved"."""
    engine.inline = k == 0
    queue = RolloutQueue(engine.sample, k, lambda: {"position": engine.position}, last_batch=steps)
    if saved is not None:
        queue.restore(saved)
    out = []
    try:
        for step in range(first, steps + 1):
            batch, version = queue.take(step)
            assert batch == step
            out.append(staleness([version], engine.version, k))
            out[-1]["made_by"] = version
            time.sleep(train_s)  # "training"
            queue.wait_idle()
            engine.sync(engine.version + 1)
            queued, loader_after = queue.saved_batches()
            out[-1]["loader"] = loader_after or {"position": engine.position}  # what the checkpoint keeps
            out[-1]["queued"] = [q.batch for q in queued]
            if step == save_after:
                out[-1]["saved"] = queued
    finally:
        queue.close()
    return out


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_batch_b_is_made_by_version_b_minus_1_minus_k_and_syncs_never_overlap(k):
    engine = FakeEngine()
    metrics = _run(k, 8, engine)
    assert engine.made_by == {b: max(0, b - 1 - k) for b in range(1, 9)}
    assert [m["rollout/staleness_max"] for m in metrics] == [min(s - 1, k) for s in range(1, 9)]
    # K batches are drawn ahead and complete at each step's end: a checkpoint after step s keeps
    # batches s+1..s+K and the loader position after them (nothing is generated past the last step).
    assert [m["queued"] for m in metrics] == [list(range(s + 1, min(s + k, 8) + 1)) for s in range(1, 9)]
    assert [m["loader"] for m in metrics] == [{"position": min(s + k, 8)} for s in range(1, 9)]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_run_resumed_with_its_queued_batches_equals_the_uninterrupted_run(k):
    whole = _run(k, 8, FakeEngine())
    before = _run(k, 8, FakeEngine(), save_after=3)[:3]
    # The resumed run: a fresh engine holding the restored weights (version 3), the loader where the
    # checkpoint left it, the saved batches queued again; none of them is generated again.
    engine = FakeEngine()
    engine.version, engine.position = 3, before[-1]["loader"]["position"]
    saved = before[-1].pop("saved")
    assert [q.batch for q in saved] == list(range(4, 4 + k)) and [q.samples for q in saved] == [
        (b, max(0, b - 1 - k)) for b in range(4, 4 + k)]
    after = _run(k, 8, engine, first=4, saved=saved)
    assert sorted(engine.made_by) == list(range(4 + k, 9))
    assert before + after == whole  # every batch made by the same version, every lag, every checkpoint


def test_a_batch_whose_sampling_failed_is_never_saved():
    engine = FakeEngine(fail_batch=4)
    engine.inline = False
    queue = RolloutQueue(engine.sample, 3, lambda: {"position": engine.position})
    try:
        queue.take(1)  # submits batches 1-4; 4 fails, 5 is not submitted yet
        queue.wait_idle()
        queued, loader_after = queue.saved_batches()
        # Batches 2 and 3 are kept; the loader goes back to before batch 4, which a resumed run samples again.
        assert [q.batch for q in queued] == [2, 3] and [q.loader_before for q in queued] == [{"position": 1},
                                                                                            {"position": 2}]
        assert loader_after == {"position": 3}
    finally:
        queue.close()
    with pytest.raises(RuntimeError, match="not consecutive"):
        RolloutQueue(lambda b: b, 2, lambda: {}).restore([SavedBatch(2, {}, 2), SavedBatch(4, {}, 4)])
    with pytest.raises(RuntimeError, match="off_policy_steps > 0"):
        RolloutQueue(lambda b: b, 0, lambda: {}).restore([SavedBatch(2, {}, 2)])


def test_a_failed_batch_raises_at_its_own_step_not_at_the_sync_before():
    engine = FakeEngine(fail_batch=3)
    engine.inline = False
    queue = RolloutQueue(engine.sample, 1, lambda: {})
    try:
        queue.take(1)
        queue.wait_idle()
        engine.sync(1)
        queue.take(2)  # batch 3 is generated (and fails) meanwhile
        queue.wait_idle()  # does not raise: step 2 still finishes and is logged
        engine.sync(2)
        with pytest.raises(ValueError, match="batch 3"):
            queue.take(3)
    finally:
        queue.close()


class EngineGone(RuntimeError):
    """Stands in for rlcore.faults.EngineDiedAhead: an error the queue redoes the batch for."""


def test_a_batch_whose_engine_died_ahead_is_sampled_again_at_its_step_on_the_callers_thread():
    """Batch 3 fails ahead with a redo_on error (once), on the producer thread: batch 4, queued after
    it, fails at once without sampling; at step 3 the queue waits, puts the loader back to before
    batch 3 and samples it on the caller's thread with the weights of then; batch 4 is submitted
    again at step 4 and drawn after it."""
    engine, calls = FakeEngine(), []
    engine.inline = True  # the redone batch runs on the main thread
    failed = []

    def sample(batch):
        calls.append((batch, threading.current_thread() is threading.main_thread()))
        if batch == 3 and not failed:
            failed.append(batch)
            engine.position += 1  # it drew its prompts before the engine died
            raise EngineGone("engine 0 died during generation ahead of its step")
        return engine.sample(batch)

    def restore(state):
        engine.position = state["position"]

    queue = RolloutQueue(sample, 2, lambda: {"position": engine.position}, last_batch=6,
                         loader_restore_fn=restore, redo_on=(EngineGone,))
    got = []
    try:
        for step in range(1, 7):
            batch, version = queue.take(step)
            got.append((batch, version, engine.position))
            queue.wait_idle()
            engine.sync(engine.version + 1)
    finally:
        queue.close()
    # Batch 3 was made by version 2 (its step's weights; scheduled: version 0); the others as scheduled
    # from where the redo left them: batch 4 submitted at step 4 with batches 5, 6 after it.
    assert [(b, v) for b, v, _ in got] == [(1, 0), (2, 0), (3, 2), (4, 3), (5, 3), (6, 3)]
    assert (3, True) in calls and (4, False) in calls  # batch 3 again inline; batch 4 on the producer
    assert calls.count((4, False)) == 1  # the poisoned batch 4 never sampled: the failure raised first
    assert engine.position == 6  # every batch drawn once in the end, in order
    assert [p for _, _, p in got][2] == 3  # right after batch 3's redo: 3 batches drawn
    with pytest.raises(ValueError, match="needs loader_restore_fn"):
        RolloutQueue(sample, 1, lambda: {}, redo_on=(EngineGone,))


def test_steps_must_come_in_order():
    queue = RolloutQueue(lambda b: b, 1, lambda: {})
    try:
        assert queue.take(5) == 5  # a resumed run starts anywhere
        with pytest.raises(RuntimeError, match="asked for batch 8, the next one is 7"):
            queue.take(8)
    finally:
        queue.close()


def test_staleness_outside_the_bound_is_an_error():
    assert staleness([3, 3, 2], 3, 1) == {"rollout/staleness_mean": pytest.approx(1 / 3), "rollout/staleness_max": 1.0}
    with pytest.raises(RuntimeError, match=r"lags 0\.\.2 outside 0\.\.trainer.off_policy_steps=1"):
        staleness([3, 1], 3, 1)


def test_negative_off_policy_steps_is_refused():
    with pytest.raises(ConfigError, match="trainer.off_policy_steps=-1 must not be negative"):
        validate(load_job("yaml_configs/quickstart_cpu.yaml", ["trainer.off_policy_steps=-1"]))
    with pytest.raises(ValueError, match="trainer.off_policy_steps=-1 must not be negative"):
        RolloutQueue(lambda b: b, -1, lambda: {})


# ------------------------------------------------------- through the Trainer's checkpoint state
class FakeRollout:
    """Stands in for the rollout pool only (the Trainer's sampling, scoring and checkpoint state are
    the real code): samples that depend on the seed and the weight version, and which batches it
    was asked for. ``fail_seed``: that generation raises."""

    def __init__(self, fail_seed: int | None = None):
        self.version, self.seeds, self.fail_seed = 0, [], fail_seed

    def generate(self, prompt_ids, n, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=256, seed=None):
        from rlcore.batch import Trajectory

        if seed is not None and seed == self.fail_seed:
            raise RuntimeError(f"generation with seed {seed} failed")
        self.seeds.append(seed)  # None: a greedy call (ReMax's baseline)
        g = torch.Generator().manual_seed((seed or 0) * 31 + self.version)
        return [Trajectory(i, list(p), torch.randint(3, 13, (1 + j % 2,), generator=g).tolist(),
                           (-torch.rand(1 + j % 2, generator=g, dtype=torch.float64)).tolist(),
                           "length", self.version)
                for i, p in enumerate(prompt_ids) for j in range(n)]


def _trainer(tmp_path, tiny_assets, k: int, rollout: FakeRollout, *overrides: str):
    from rlcore.data import load_task
    from rlcore.roles import Roles
    from rlcore.trainer import Trainer

    model, data = tiny_assets
    cfg = load_job("yaml_configs/quickstart_cpu.yaml", [
        f"model.path={model}", f"data.train_files=[{data}]", "data.val_files=[]", "data.batch_size=4",
        "rollout.n=3", f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=10",
        f"trainer.off_policy_steps={k}", *overrides])
    return cfg, Trainer(cfg, load_task(cfg), Roles(actor=object(), rollout=rollout))


def _train_steps(trainer, rollout: FakeRollout, steps) -> list:
    """What the loop does around sampling: take the batch, (train), wait for the engines, sync."""
    out = []
    for step in steps:
        out.append(trainer.rollouts.take(step))
        trainer.rollouts.wait_idle()
        trainer.version = rollout.version = trainer.version + 1
    return out


def _save_and_load(trainer, cfg, tmp_path, step: int, edit=None, log=lambda m: None) -> dict:
    from rlcore import checkpoint

    state = trainer.state_dict(step)
    if edit is not None:
        state = edit(state)
    folder = checkpoint.save_checkpoint(str(tmp_path / "ckpt"), step, {}, state, checkpoint.job_yaml(cfg), log=log)
    cfg.trainer.resume = folder
    return checkpoint.resume(cfg, {}, log=log)


def _same(a, b) -> bool:
    """Two Samples equal in every field, tensors bitwise, metrics but the timings."""
    def eq(x, y):
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, (list, tuple)):
            return isinstance(y, (list, tuple)) and len(x) == len(y) and all(eq(u, v) for u, v in zip(x, y))
        return x == y

    def untimed(m):
        return {k: v for k, v in m.items() if not is_measurement(k)}

    return untimed(a.metrics) == untimed(b.metrics) and all(
        eq(getattr(a, f), getattr(b, f)) for f in ("prompts", "trajs", "scores", "baseline_scores", "token_rewards"))


@pytest.mark.parametrize("estimator", ["grpo", "remax"])  # remax: with the greedy baseline's scores
def test_trainer_checkpoint_keeps_the_queued_batches_and_a_resume_trains_on_them(tmp_path, tiny_assets, estimator):
    from rlcore.checkpoint import CONTROLLER, QUEUED

    rollout = FakeRollout()
    cfg, trainer = _trainer(tmp_path, tiny_assets, 2, rollout, f"algorithm.adv_estimator={estimator}")
    try:
        before = _train_steps(trainer, rollout, [1, 2])
        state = _save_and_load(trainer, cfg, tmp_path, 2)
        whole = before + _train_steps(trainer, rollout, [3, 4, 5])
    finally:
        trainer.rollouts.close()
    saved = tmp_path / "ckpt" / "step_00000002"
    controller = json.loads((saved / CONTROLLER).read_text())
    assert [q["batch"] for q in controller["queued_batches"]] == [3, 4] and (saved / QUEUED).is_file()
    assert controller["loader"] == {"epoch": 0, "position": 16} and controller["off_policy_steps"] == 2

    resumed_rollout = FakeRollout()
    resumed_rollout.version = 2  # the restored weights, synced by Trainer.resume
    cfg2, resumed = _trainer(tmp_path, tiny_assets, 2, resumed_rollout, f"algorithm.adv_estimator={estimator}")
    try:
        resumed.load_state_dict(state)
        after = _train_steps(resumed, resumed_rollout, [3, 4, 5])
    finally:
        resumed.rollouts.close()
    # Batches 3 and 4 come from the checkpoint, bitwise (made by versions 0 and 1, which the resumed run
    # never had); batch 5 is sampled on version 2 as in the uninterrupted run (and 6, 7 ahead, on 3 and 4).
    sampled = [seed for seed in resumed_rollout.seeds if seed is not None]
    assert sampled == [cfg.trainer.seed * 100_003 + b for b in (5, 6, 7)] == [s for s in rollout.seeds if s][-3:]
    assert (after[0].baseline_scores is not None) == (estimator == "remax")
    assert [t.weight_version for s in after for t in s.trajs[:1]] == [0, 1, 2]
    assert all(_same(a, b) for a, b in zip(after, whole[2:])), "the resumed run trains on other batches"
    assert after[0].metrics["reward/mean"] == whole[2].metrics["reward/mean"]


@pytest.mark.parametrize("case", ["other_k", "old_checkpoint", "sync_job", "other_n"])
def test_queued_batches_that_do_not_fit_are_sampled_again_from_the_loader_position_before_them(
        tmp_path, tiny_assets, case):
    rollout = FakeRollout()
    cfg, trainer = _trainer(tmp_path, tiny_assets, 1, rollout)
    try:
        _train_steps(trainer, rollout, [1, 2])

        def old_format(state):  # as checkpoints were written before queued batches were kept
            return {"step": state["step"], "weight_version": state["weight_version"],
                    "loader": state["queued_batches"][0]["loader_before"]}
        state = _save_and_load(trainer, cfg, tmp_path, 2, edit=old_format if case == "old_checkpoint" else None)
        uninterrupted_next = trainer.rollouts.take(3)  # the batch queued at the save
    finally:
        trainer.rollouts.close()
    k = {"other_k": 2, "sync_job": 0}.get(case, 1)
    resumed_rollout, lines = FakeRollout(), []
    resumed_rollout.version = 2
    _, resumed = _trainer(tmp_path, tiny_assets, k, resumed_rollout, *(["rollout.n=2"] if case == "other_n" else []))
    try:
        resumed.load_state_dict(state, log=lines.append)
        again = resumed.rollouts.take(3)
    finally:
        resumed.rollouts.close()
    why = {"other_k": "they were queued under trainer.off_policy_steps=1, this job has 2",
           "old_checkpoint": "it was written before checkpoints kept them",
           "sync_job": "they were queued under trainer.off_policy_steps=1, this job has 0",
           "other_n": "they do not fit data.batch_size=4 x rollout.n=2"}[case]
    assert lines == [f"checkpoint: no queued batches restored after step 2 ({why}); the next batches are "
                     "sampled from the saved loader position by the restored weights (version 2)"]
    # The same prompts and seeds as the saved batch 3, sampled again by version 2.
    assert resumed_rollout.seeds[0] == cfg.trainer.seed * 100_003 + 3
    assert [p.index for p in again.prompts] == [p.index for p in uninterrupted_next.prompts]
    assert {t.weight_version for t in again.trajs} == {2} != {t.weight_version for t in uninterrupted_next.trajs}


def test_a_failed_queued_batch_is_not_in_the_trainer_checkpoint(tmp_path, tiny_assets):
    rollout = FakeRollout(fail_seed=1 * 100_003 + 3)  # batch 3's generation
    cfg, trainer = _trainer(tmp_path, tiny_assets, 1, rollout)
    try:
        _train_steps(trainer, rollout, [1, 2])
        state = trainer.state_dict(2)
    finally:
        trainer.rollouts.close()
    assert state["queued_batches"] == [] and state["loader"] == {"epoch": 0, "position": 8}  # before batch 3
    assert state["failed_batch"] == 3
    lines = []
    _, resumed = _trainer(tmp_path, tiny_assets, 1, FakeRollout())
    try:
        resumed.load_state_dict(state, log=lines.append)
        assert resumed.loader.state_dict() == {"epoch": 0, "position": 8}
    finally:
        resumed.rollouts.close()
    assert lines == ["checkpoint: no queued batches restored after step 2 (batch 3's sampling had failed); the next "
                     "batches are sampled from the saved loader position by the restored weights (version 2)"]
