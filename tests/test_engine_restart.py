"""A dead engine is not a dead run; a dead Megatron rank is one sentence.

The quickstart on the tiny model, its vLLM engine's process SIGKILLed by its pid twice: just before
step 2's generation and just before step 2's weight sync. Every step completes; the engine comes back
on a new process, with the weights of the version the others had (the engine/trainer log-prob gap
stays under 1e-3 in the steps after each restart), and ``rollout/engine_restarts`` counts both. With
``rollout.max_engine_restarts=0`` the first death stops the run with one sentence naming the engine
and the count, after step 1's checkpoint and nothing later. A death under a batch generating ahead
(trainer.off_policy_steps=1) is restarted by the next sync and that batch sampled again at its step.
A Megatron rank killed under a group is
``RankDied`` naming the role and the rank, and the CLI prints it as one line."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from rlcore.metrics import is_measurement
from tests.runs import ONE_RANK, step_metrics

SPEC = "yaml_configs/quickstart_cpu.yaml"


def _job(model, data, run_dir, *overrides):
    from rlcore.job import load_job
    from rlcore.validate import validate

    cfg = load_job(SPEC, [f"model.path={model}", f"data.train_files=[{data}]", f"data.val_files=[{data}]",
                          f"trainer.run_dir={run_dir}", "trainer.val_every=0", "data.batch_size=4", "rollout.n=4",
                          "actor.micro_batch_size=16", "resources.num_cpus=2", *overrides])
    return cfg, validate(cfg)


def _sigkill(pid: int) -> None:
    """SIGKILLs the process and waits until it is gone (Ray reaps its workers)."""
    os.kill(pid, signal.SIGKILL)
    for _ in range(200):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def _kill_engine_before(pool, method: str, call: int, killed: list) -> None:
    """Before the ``call``-th call of the pool's ``method``, SIGKILLs engine 0's process (its pid
    recorded in ``killed``): a real death at a known point of the loop."""
    real, calls = getattr(pool, method), [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            killed.append(pool.pids()[0])
            _sigkill(killed[-1])
        return real(*args, **kwargs)

    setattr(pool, method, wrapped)


def _metrics(run_dir) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]



def _fit_with_engine_killed_before_second_generation(cfg, layout):
    """Trains ``cfg`` with the engine SIGKILLed just before the second generation; the EngineDied the
    run stops with (pytest's ExceptionInfo)."""
    import ray

    from launch.compose import build_trainer
    from rlcore.faults import EngineDied

    trainer = None
    try:
        trainer = build_trainer(cfg, layout)
        _kill_engine_before(trainer.rollout, "generate", 2, [])
        with pytest.raises(EngineDied) as err:
            trainer.fit()
    finally:
        if trainer is not None:
            trainer.shutdown()
        ray.shutdown()
    return err

def _train(cfg, layout, kills=(), then=None) -> tuple[list[dict], list[int], list[int]]:
    """Trains ``cfg`` to the end with engine 0 SIGKILLed before each (pool method, call number) of
    ``kills``, then calls ``then(trainer)`` (if given) before the shut-down; returns its metrics lines,
    the killed pids and the engines' pids at the end."""
    import ray

    from launch.compose import build_trainer

    trainer, killed = None, []
    try:
        trainer = build_trainer(cfg, layout)
        for method, call in kills:
            _kill_engine_before(trainer.rollout, method, call, killed)
        trainer.fit()
        pids_after = trainer.rollout.pids()
        if then is not None:
            then(trainer)
    finally:
        if trainer is not None:
            trainer.shutdown()
        ray.shutdown()
    return _metrics(cfg.trainer.run_dir), killed, pids_after


@pytest.fixture(scope="module")
def killed_run(tiny_assets, tmp_path_factory):
    """The small quickstart of tests/runs.py for 3 steps, engine 0 SIGKILLed before step 2's generation
    and again before step 2's sync; after its last step, its TP2 actor group's Megatron rank 1 is
    ``ray.kill``ed and the group asked for a forward. (metrics lines, killed pids, the engines' pids at
    the end, the RankDied the forward raised or None): one start-up for both tests."""
    import ray
    import torch

    from rlcore.batch import Batch
    from rlcore.faults import RankDied
    from rlcore.job import load_job
    from rlcore.validate import validate
    from tests.runs import small_quickstart

    model, data = tiny_assets
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    # A short sync timeout: the death during a sync leaves the senders waiting for the dead peer
    # until their collectives time out.
    cfg = load_job(SPEC, small_quickstart(model, data, run_dir, "rollout.sync_timeout_s=10", steps=3))
    raised = {}

    def kill_a_megatron_rank(trainer):
        assert trainer.actor.tp == 2
        ray.kill(trainer.actor.workers[1], no_restart=True)
        rows = cfg.actor.micro_batch_size  # the group refuses a batch of part of a micro-batch before it starts
        try:
            trainer.actor.forward(Batch(input_ids=torch.randint(0, 10, (rows, 6))), temperature=1.0)
        except RankDied as err:
            raised["error"] = err

    # generate: call 1 is step 1's, call 2 step 2's. receive_weights: 1 is step 1's sync, 2 the
    # restart's re-sync (version 1 again), 3 step 2's sync.
    lines, killed, pids_after = _train(cfg, validate(cfg), kills=[("generate", 2), ("receive_weights", 3)],
                                       then=kill_a_megatron_rank)
    return lines, killed, pids_after, raised.get("error")


@pytest.mark.e2e
def test_a_killed_engine_is_restarted_and_every_step_completes(killed_run, reference_run):
    lines, killed, pids_after, _ = killed_run
    assert len(killed) == 2 and killed[0] != killed[1] and pids_after[0] not in killed
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert [x["rollout/engine_restarts"] for x in lines] == [0.0, 2.0, 2.0]  # both in step 2
    # The version survives the restarts: step k samples from version k-1 and syncs version k.
    assert [x["rollout/weight_version"] for x in lines] == [0.0, 1.0, 2.0]
    assert [x["weights/version"] for x in lines] == [1.0, 2.0, 3.0]
    # Step 2 sampled on the engine restarted with version 1, step 3 on the one restarted in step 2's sync.
    for x in lines:
        assert x["rollout/logprob_diff_max"] < 1e-3, (x["step"], x["rollout/logprob_diff_max"])

    # The redone generation drew the samples the step would have drawn anyway (same prompts, seeds and
    # weights): the run's metrics are the uninterrupted run's (the session's reference run, the same
    # small quickstart: tests/conftest.py; its steps 1-3).
    uninterrupted = [m for step, m in sorted(step_metrics(reference_run.run_dir).items()) if step <= 3]
    assert [x["step"] for x in uninterrupted] == [1, 2, 3]
    for got, want in zip(lines, uninterrupted):
        for key in want:
            if is_measurement(key) or key == "rollout/engine_restarts":
                continue
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (got["step"], key)


@pytest.mark.e2e
def test_with_no_restarts_allowed_a_dead_engine_stops_the_run_with_one_sentence(tiny_assets, tmp_path):
    from rlcore.faults import RunStopped

    model, data = tiny_assets
    run_dir = tmp_path / "run"
    cfg, layout = _job(model, data, run_dir, "trainer.total_steps=3", "trainer.save_every=1",
                       "rollout.max_engine_restarts=0", *ONE_RANK)
    err = _fit_with_engine_killed_before_second_generation(cfg, layout)
    message = str(err.value)
    assert isinstance(err.value, RunStopped) and "\n" not in message
    assert message == ("rollout engine 0 died during generation (its process exited) after 0 engine restart(s) "
                       "in this run, the limit of rollout.max_engine_restarts=0: stopping, the last checkpoint is "
                       "intact"), message
    assert [x["step"] for x in _metrics(run_dir)] == [1]
    from rlcore.checkpoint import checkpoint_dir_of

    saved = sorted(os.listdir(checkpoint_dir_of(cfg.trainer)))
    assert [n for n in saved if "step_" in n] == ["step_00000001"], saved


@pytest.mark.e2e
def test_an_engine_dying_in_a_generation_ahead_is_restarted_and_that_batch_sampled_again(tiny_assets, tmp_path):
    """trainer.off_policy_steps=1: batch 2 generates on the producer thread while step 1 trains, and
    its engine is SIGKILLed first. That thread cannot redo it (the actor has moved past version 0);
    step 1's sync meets the dead engine and restarts it, and step 2 samples its batch again, on the
    trainer's thread, with version 1 (lag 0). Every step completes."""
    model, data = tiny_assets
    run_dir = tmp_path / "run"
    cfg, layout = _job(model, data, run_dir, "trainer.total_steps=3", "trainer.off_policy_steps=1",
                       "rollout.sync_timeout_s=10", *ONE_RANK)
    lines, killed, pids_after = _train(cfg, layout, kills=[("generate", 2)])
    assert len(killed) == 1 and pids_after[0] not in killed
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert [x["rollout/engine_restarts"] for x in lines] == [1.0, 1.0, 1.0]  # by step 1's sync
    # Batch 2 again at step 2 by version 1; batch 3 submitted at step 3, after step 2's sync.
    assert [x["rollout/weight_version"] for x in lines] == [0.0, 1.0, 2.0]
    assert [x["rollout/staleness_max"] for x in lines] == [0.0, 0.0, 0.0]
    for x in lines:  # the restarted engine samples with the trained weights
        assert x["rollout/logprob_diff_max"] < 1e-3, (x["step"], x["rollout/logprob_diff_max"])


@pytest.mark.e2e
def test_a_killed_megatron_rank_is_one_sentence_naming_role_and_rank(killed_run):
    """Rank 1 of the killed-engine run's TP2 actor group, ``ray.kill``ed after its last step."""
    from rlcore.faults import RankDied

    err = killed_run[3]
    assert isinstance(err, RankDied), err
    message = str(err)
    assert message == ("the actor's Megatron rank 1 died during forward; the run stops here and the last checkpoint "
                       "is intact (nothing was written after the death)"), message


def test_rlx_train_prints_a_dead_process_as_one_line_and_exits_1(tiny_assets, tmp_path, monkeypatch, capsys):
    """What `rlx train` does with the errors above once the run raised one (here without starting it)."""
    import launch.compose
    from launch import cli
    from rlcore.faults import RankDied

    def dies(cfg, layout):
        raise RankDied("actor", 1, "forward")

    monkeypatch.setattr(launch.compose, "run", dies)
    model, data = tiny_assets
    code = cli.main(["train", SPEC, f"model.path={model}", f"data.train_files=[{data}]",
                     f"data.val_files=[{data}]", f"trainer.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err == ["rlx train: the actor's Megatron rank 1 died during forward; the run stops here "
                                 "and the last checkpoint is intact (nothing was written after the death)"], err


def test_a_weight_sync_peer_that_never_comes_is_an_error_within_the_links_timeout():
    """The link's timeout bounds joining the group and every collective: a member waiting for one
    that vanished gets an error after it, not a hang (gloo, the cpu profile's backend)."""
    import socket
    import threading

    from rlcore.weight_sync import StageLink, WeightSyncGroup

    def link() -> StageLink:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return StageLink(0, "127.0.0.1", port, writers=1, receivers=1, transport="broadcast", timeout_s=2.0)

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="waiting for clients. 1/2 clients joined"):  # rank 1 never joins
        WeightSyncGroup.join(link(), 0)
    assert time.monotonic() - t0 < 30

    both, groups = link(), [None, None]
    threads = [threading.Thread(target=lambda r=r: groups.__setitem__(r, WeightSyncGroup.join(both, r)))
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(g is not None for g in groups)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="Timed out waiting 2000ms"):
        groups[1].barrier()  # rank 0 never posts its part
    assert time.monotonic() - t0 < 30
