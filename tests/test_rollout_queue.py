"""The pipelined-phases schedule (rlcore/rollout_queue.py) against a fake engine, without Ray: which
weight version makes each batch, that a sync never overlaps a generation, where errors surface, and
the loader position a checkpoint saves."""
from __future__ import annotations

import threading
import time

import pytest

from rlcore.job import ConfigError, load_job
from rlcore.rollout_queue import RolloutQueue, staleness
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


def _run(k: int, steps: int, engine: FakeEngine, train_s: float = 0.01) -> list[dict]:
    engine.inline = k == 0
    queue = RolloutQueue(engine.sample, k, lambda: {"position": engine.position}, last_batch=steps)
    out = []
    try:
        for step in range(1, steps + 1):
            batch, version = queue.take(step)
            assert batch == step
            out.append(staleness([version], engine.version, k))
            time.sleep(train_s)  # "training"
            queue.wait_idle()
            engine.sync(engine.version + 1)
            out[-1]["loader"] = queue.loader_state_before()
    finally:
        queue.close()
    return out


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_batch_b_is_made_by_version_b_minus_1_minus_k_and_syncs_never_overlap(k):
    engine = FakeEngine()
    metrics = _run(k, 8, engine)
    assert engine.made_by == {b: max(0, b - 1 - k) for b in range(1, 9)}
    assert [m["rollout/staleness_max"] for m in metrics] == [min(s - 1, k) for s in range(1, 9)]
    # K batches are drawn ahead: a checkpoint after step s must save the position before batch s + 1.
    # (Nothing is generated past the last step.)
    assert [m["loader"] for m in metrics] == ([None] * 8 if k == 0 else
                                              [{"position": s} for s in range(1, 8)] + [None])


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
